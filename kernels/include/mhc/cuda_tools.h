// Device measurements beside the CUDA backend (kernels/cuda/tools, library
// mhc_cuda_tools): the daemon's copy bandwidth probe and the GPU
// benchmark's timing kernels. Built only when CUDA is enabled.
#ifndef MHC_CUDA_TOOLS_H_
#define MHC_CUDA_TOOLS_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "mhc/backend.h"

namespace mhc {

// Bytes read plus written per second by a 256 MiB device-to-device copy on
// `device`, best of a few: the roofline denominator. Takes tens of ms.
absl::StatusOr<double> MeasureCudaCopyBandwidth(int device);

// Benchmark support, enqueued on the stream of a backend made by
// MakeCudaBackend (FAILED_PRECONDITION for any other backend).
// An empty one-block kernel: what an event-timed repetition measures when
// the op itself costs nothing.
absl::Status EnqueueCudaEmptyKernel(Backend& cuda_backend);
// One thread that spins for `microseconds` of the GPU's global timer: queued
// before a timed run, it keeps the GPU busy while the host enqueues the
// run, so the events time the GPU's work and not the host's launches.
absl::Status EnqueueCudaSpin(Backend& cuda_backend, double microseconds);
// Reads `bytes` of that backend's device memory at `buffer` and writes
// nothing: an L2 flush that leaves only clean lines behind, so the timed op
// never pays for evicting the flush's dirty lines.
absl::Status EnqueueCudaReadFlush(Backend& cuda_backend, const void* buffer,
                                  size_t bytes);

}  // namespace mhc

#endif  // MHC_CUDA_TOOLS_H_
