// The projection forward of fp16 and fp32 layers with one logit group (N <=
// 24: n <= 4 mHC layers and heads) under TF32 precision, on warpgroup mmas
// with A from registers (projection/forward/wgmma_tf32.cu), where the plan
// (plan.h) picks it: x rows on 16 bytes. Same units' chunks and partial
// layout as projection/forward/mma.cuh.
#ifndef MHC_KERNELS_CUDA_PROJECTION_FORWARD_WGMMA_TF32_H_
#define MHC_KERNELS_CUDA_PROJECTION_FORWARD_WGMMA_TF32_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "mhc/types.h"
#include "projection/plan.h"

namespace mhc::cuda {

// The wgmma_tf32 variant's chunk partials into the plan's workspace: phi'
// rounded to TF32 into its planes once for the launch, then the units.
// Where no tensor map of x can be made (a driver without the encoder, or
// M past 2^31 rows), the mma.sync units run instead (their own bits).
absl::Status LaunchTf32WgmmaProjectionPartials(
    const LayerSpec& spec, int64_t tokens, DType dtype, const void* x,
    const float* phi, const float* gamma, const ProjectionForwardPlan& plan,
    void* workspace, cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_FORWARD_WGMMA_TF32_H_
