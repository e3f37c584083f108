// The registry's device side (DeviceMemoryOpener, HostMemoryPinner) over
// mhc::DeviceIpc (mhc/device_ipc.h): opening other processes' device
// allocations and events for RegisterCudaSharedMemory and RegisterCudaEvents,
// and page locks for the mappings of system regions. The device calls
// themselves live in the kernels (MakeCudaDeviceIpc on CUDA); what is here
// is the daemon's bookkeeping around them.
#ifndef MHC_SERVER_SHM_DEVICE_MEMORY_H_
#define MHC_SERVER_SHM_DEVICE_MEMORY_H_

#include <memory>

#include "mhc/device_ipc.h"
#include "server/shm/shm_registry.h"

namespace mhc::server {

// Opens handles through `ipc` on the requested device, checks the requested
// size against the allocation and closes them again. Regions over the same
// handle share one mapping, closed with the last of them.
std::unique_ptr<DeviceMemoryOpener> MakeDeviceMemoryOpener(
    std::shared_ptr<DeviceIpc> ipc);

// Page-locks host memory through `ipc`, portable across every device of the
// process (read-only registrations where the mapping is), and unlocks it
// again. `device` is a device this daemon serves: the one whose context
// registers, so that no other device gets a context just for this.
std::unique_ptr<HostMemoryPinner> MakeHostMemoryPinner(
    std::shared_ptr<DeviceIpc> ipc, int device);

}  // namespace mhc::server

#endif  // MHC_SERVER_SHM_DEVICE_MEMORY_H_
