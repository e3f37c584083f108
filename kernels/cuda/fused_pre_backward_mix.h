// The fused pre / head backward's mixing (fused_pre_backward_mix.cu): after
// dh_pre, each token's reverse mode of scale and Sinkhorn from its logits,
// which writes the rows the dx / dphi kernel and the parameter reductions
// read. One thread per token, or for mHC n = 4 layers in small batches a
// quad of lanes per token (BackwardMixLanes, plans/fused.h) with the same
// bits. SplitMix layers run the scale and Sinkhorn op kernels instead
// (fused_pre.cu).
#ifndef MHC_KERNELS_CUDA_FUSED_PRE_BACKWARD_MIX_H_
#define MHC_KERNELS_CUDA_FUSED_PRE_BACKWARD_MIX_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "mhc/types.h"
#include "overflow_repair.h"

namespace mhc::cuda {

// The mixing's inputs and per-token output rows.
struct BackwardMixDev {
  const float* alpha;
  const float* beta;
  const float* dh_post;
  const float* dh_res;
  float* dh;           // [M, N]
  float* dms;          // [M]
  float* h_pre;        // [M, n]
  float* r;            // [M, n, n] or null
  float* contrib;      // [M, N + num_alpha]
  const float* h_in;   // [M, N] recomputed projection (dynamic layers)
  const float* ms_in;  // [M] with h_in
};

// Launches the mixing of `tokens` tokens (dh_pre: [M, n]); errors name the
// pre or head backward and the shape.
absl::Status LaunchBackwardMix(const LayerSpec& spec, int64_t tokens,
                               DType act_dtype, const float* dh_pre,
                               const BackwardMixDev& d, const RepairSource& src,
                               const RepairRows& rows, cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_FUSED_PRE_BACKWARD_MIX_H_
