// The CUDA backend (kernels/cuda). Declared whether or not the build has
// CUDA: without it CudaDeviceCount() is 0 and MakeCudaBackend fails cleanly.
#ifndef MHC_CUDA_H_
#define MHC_CUDA_H_

#include <memory>

#include "absl/status/statusor.h"
#include "mhc/backend.h"

namespace mhc {

// Number of usable CUDA devices; 0 when there is no driver or no GPU. Never
// crashes or aborts.
int CudaDeviceCount();

// A backend that owns one stream on `device`. Pointers given to its ops are
// device memory from Allocate (or any device allocation on that device).
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device);

}  // namespace mhc

#endif  // MHC_CUDA_H_
