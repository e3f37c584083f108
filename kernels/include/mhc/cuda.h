// The CUDA backend (kernels/cuda), built only when CUDA is enabled
// (MHC_HAVE_CUDA is then defined for every user of mhc_kernels).
#ifndef MHC_CUDA_H_
#define MHC_CUDA_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "mhc/backend.h"

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

// Bytes read plus written per second by a 256 MiB device-to-device copy on
// `device`, best of a few: the roofline denominator. Takes tens of ms.
absl::StatusOr<double> MeasureCudaCopyBandwidth(int device);

// Benchmark support, enqueued on the stream of a backend made by
// MakeCudaBackend (FAILED_PRECONDITION for any other backend).
// An empty one-block kernel: what an event-timed repetition measures when
// the op itself costs nothing.
absl::Status EnqueueCudaEmptyKernel(Backend& cuda_backend);
// Reads `bytes` of that backend's device memory at `buffer` and writes
// nothing: an L2 flush that leaves only clean lines behind, so the timed op
// never pays for evicting the flush's dirty lines.
absl::Status EnqueueCudaReadFlush(Backend& cuda_backend, const void* buffer,
                                  size_t bytes);

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
