// The CUDA backend (kernels/cuda, library mhc_cuda), built only when CUDA is
// enabled (MHC_HAVE_CUDA is then defined for every user of mhc_cuda).
#ifndef MHC_CUDA_H_
#define MHC_CUDA_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "mhc/backend.h"
#include "mhc/device_ipc.h"

namespace mhc {

// Number of usable CUDA devices; 0 when there is no driver or no GPU. Never
// crashes or aborts.
int CudaDeviceCount();

// The device allocation holding `pointer` (cuMemGetAddressRange, looked up
// through the runtime so that no libcuda link is needed): its first byte
// and size. NOT_FOUND when `pointer` is not device memory of this process.
struct CudaAllocation {
  char* base = nullptr;
  size_t bytes = 0;
};
absl::StatusOr<CudaAllocation> FindCudaAllocation(const void* pointer);

// A backend that owns one stream on `device`. Pointers given to its ops are
// device memory from Allocate (or any device allocation on that device).
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device);

// The stream (a cudaStream_t) that a backend made by MakeCudaBackend runs
// its ops on, for work enqueued beside them, such as collectives;
// FAILED_PRECONDITION for any other backend.
absl::StatusOr<void*> CudaOpStream(Backend& cuda_backend);

// The device work of shared memory (mhc/device_ipc.h) through the CUDA
// runtime: IPC handles, interprocess events and page-locked host memory.
std::unique_ptr<DeviceIpc> MakeCudaDeviceIpc();

// What a collective library running beside a CUDA backend's ops (NCCL, for
// groups) needs of the device besides Backend: the calling thread's current
// device, which NCCL's calls take theirs from, and a marker on the op
// stream that the host polls instead of waiting for the device.
absl::Status UseCudaDevice(int device);
class CudaStreamMarker {
 public:
  virtual ~CudaStreamMarker() = default;
  // Marks the work issued so far on `stream` (CudaOpStream's).
  virtual absl::Status Record(void* stream) = 0;
  // Whether the marked work has run, without waiting; an error when the
  // device failed. True before the first Record.
  virtual absl::StatusOr<bool> Done() = 0;
};
absl::StatusOr<std::unique_ptr<CudaStreamMarker>> MakeCudaStreamMarker(
    int device);

// Test-only fault injection (mhcd --fault_injection): from this call on,
// the process's CUDA backends fail their `alloc`-th device allocation,
// `launch`-th op launch (each op the backend runs, one or more kernels) and
// `copy`-th copy between host and device, each counted from 1 (0: none).
// An injected allocation fails as on a full device (RESOURCE_EXHAUSTED);
// an injected launch or copy loses the CUDA context as a faulting kernel
// does (INTERNAL, sticky: every later call fails too).
struct CudaFaultPlan {
  int64_t alloc = 0;
  int64_t launch = 0;
  int64_t copy = 0;
};
void InjectCudaFaults(const CudaFaultPlan& plan);

}  // namespace mhc

#endif  // MHC_CUDA_H_
