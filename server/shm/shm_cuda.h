// CUDA IPC for RegisterCudaSharedMemory: opens another process's device
// allocation from its cudaIpcMemHandle_t. And page locks for the mappings of
// system regions. Built only with the CUDA backend.
#ifndef MHC_SERVER_SHM_SHM_CUDA_H_
#define MHC_SERVER_SHM_SHM_CUDA_H_

#include <memory>

#include "server/shm/shm_registry.h"

namespace mhc::server {

// Opens handles with cudaIpcOpenMemHandle on the requested device, checks
// the requested size against the allocation (cuMemGetAddressRange) and
// closes them with cudaIpcCloseMemHandle. Regions over the same handle share
// one mapping, closed with the last of them.
std::unique_ptr<DeviceMemoryOpener> MakeCudaIpcOpener();

// Page-locks host memory with cudaHostRegister, portable across every device
// of the process (read-only registrations where the mapping is), and
// unregisters it with cudaHostUnregister. `device` is a device this daemon
// serves: the one whose context registers, so that no other device gets a
// context just for this.
std::unique_ptr<HostMemoryPinner> MakeCudaHostPinner(int device);

}  // namespace mhc::server

#endif  // MHC_SERVER_SHM_SHM_CUDA_H_
