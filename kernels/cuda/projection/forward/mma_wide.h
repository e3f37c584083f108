// The mma_wide variant of the projection forward (mma_wide.cu): GEMM tiles
// on mma.sync for the dynamic layers with more than two mma.cuh groups of
// logits (n >= 7 mHC layers) that no wgmma variant takes. It writes the
// same chunk partials, in the same workspace.
#ifndef MHC_KERNELS_CUDA_PROJECTION_FORWARD_MMA_WIDE_H_
#define MHC_KERNELS_CUDA_PROJECTION_FORWARD_MMA_WIDE_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "mhc/types.h"
#include "projection/plan.h"

namespace mhc::cuda {

// Into the plan's workspace.
absl::Status LaunchWideProjectionPartials(const LayerSpec& spec, int64_t tokens,
                                          DType dtype, const void* x,
                                          const float* phi, const float* gamma,
                                          const ProjectionForwardPlan& plan,
                                          void* workspace, cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_FORWARD_MMA_WIDE_H_
