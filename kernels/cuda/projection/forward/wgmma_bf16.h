// The projection forward of bf16 layers on warpgroup mmas, for x rows that
// take 16-, 8- or 4-byte copies (any C at n = 2, 4 and 8):
// one logit group (N <= 24: n <= 4 mHC layers and heads;
// projection/forward/wgmma_bf16.cu) or 49-80 logits (n = 7, 8;
// projection/forward/wgmma_bf16_wide.cu), where the plan (plan.h) picks
// them.
// Same units' chunks and partial layout as projection/forward/mma.cuh.
#ifndef MHC_KERNELS_CUDA_PROJECTION_FORWARD_WGMMA_BF16_H_
#define MHC_KERNELS_CUDA_PROJECTION_FORWARD_WGMMA_BF16_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "mhc/types.h"
#include "projection/plan.h"

namespace mhc::cuda {

// The wgmma_bf16 variant's chunk partials into the plan's workspace:
// phi' split into its planes once for the launch where the plan says so
// (the bytes the mma.sync units' split takes: 6 KB per 64 k, 9 KB under
// IEEE), else by every unit for its stages (small batches, where the split
// would cost more than the x it serves). Both give the same bits.
absl::Status LaunchBf16WgmmaProjectionPartials(
    const LayerSpec& spec, int64_t tokens, const void* x, const float* phi,
    const float* gamma, const ProjectionForwardPlan& plan, void* workspace,
    cudaStream_t stream);

// The wgmma_bf16_wide variant's; it splits phi' itself, from phi and gamma
// staged with x.
absl::Status LaunchBf16WideProjectionPartials(
    const LayerSpec& spec, int64_t tokens, const void* x, const float* phi,
    const float* gamma, const ProjectionForwardPlan& plan, void* workspace,
    cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_FORWARD_WGMMA_BF16_H_
