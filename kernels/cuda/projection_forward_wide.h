// The GEMM-tiled projection forward (projection_forward_wide.cu) for the
// dynamic layers with more than two proj_mma.cuh units of logits (n >= 7
// mHC layers); LaunchProjectionPartials picks it when UseWideProjection
// holds. It writes the same chunk partials, in the same workspace.
#ifndef MHC_KERNELS_CUDA_PROJECTION_FORWARD_WIDE_H_
#define MHC_KERNELS_CUDA_PROJECTION_FORWARD_WIDE_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "mhc/types.h"

namespace mhc::cuda {

bool UseWideProjection(const LayerSpec& spec);
// partial: PartialOffset's layout; next_unit: the launch's unit counter.
absl::Status LaunchWideProjectionPartials(const LayerSpec& spec, int64_t tokens,
                                          DType dtype, const void* x,
                                          const float* phi, const float* gamma,
                                          float* partial,
                                          unsigned long long* next_unit,
                                          cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_FORWARD_WIDE_H_
