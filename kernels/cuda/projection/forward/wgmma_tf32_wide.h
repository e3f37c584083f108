// The wgmma_tf32_wide variant of the projection forward
// (wgmma_tf32_wide.cu): wide layers on warpgroup mmas under TF32, x, phi
// and gamma rows of whole 16-byte vectors. Same units' chunks and partial
// layout as mma.cuh.
#ifndef MHC_KERNELS_CUDA_PROJECTION_FORWARD_WGMMA_TF32_WIDE_H_
#define MHC_KERNELS_CUDA_PROJECTION_FORWARD_WGMMA_TF32_WIDE_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "mhc/types.h"
#include "projection/plan.h"

namespace mhc::cuda {

// Into the plan's workspace (PartialOffset's layout, then the counter).
absl::Status LaunchWgmmaProjectionPartials(
    const LayerSpec& spec, int64_t tokens, DType dtype, const void* x,
    const float* phi, const float* gamma, const ProjectionForwardPlan& plan,
    void* workspace, cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_FORWARD_WGMMA_TF32_WIDE_H_
