// The kernel plan of the fused pre and head ops (fused_pre.cu; head.cu runs
// the same kernels with the kHead kind): how a layer's mixing (scale and,
// for mHC layers, Sinkhorn) runs between the projection and the aggregate.
// One table per direction, first row that holds wins; the stages inside
// follow their own plans (the projection's with the fused terms, the row
// access plan for the aggregate, dh_pre and the static forward, the
// Sinkhorn plan for the split mixing). The layer alone picks the variant:
// not the dtype, the alignment or M; M sets one launch shape
// (BackwardMixLanes). The fused workspace layout
// (fused_pre_workspace.cuh) reads SplitMix.
#ifndef MHC_KERNELS_CUDA_PLANS_FUSED_H_
#define MHC_KERNELS_CUDA_PLANS_FUSED_H_

#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "mhc/types.h"
#include "plans/table.h"

namespace mhc::cuda {

enum class FusedVariant : uint8_t {
  kStatic,    // forward of a static layer: mixing and aggregate, one kernel
  kMix,       // one thread per token mixes, in one kernel
  kSplitMix,  // the scale and Sinkhorn op kernels mix
};
inline constexpr int kNumFusedVariants = 3;

// "static", "mix", "split_mix", as the metrics label and the docs spell
// them.
absl::string_view ToString(FusedVariant variant);

// mHC layers (n other than 4) whose Sinkhorn the lane kernels cover run the
// mixing, forward and backward, as the scale and Sinkhorn op kernels instead
// of one thread per token: the lane kernels keep the matrices in registers
// where a thread works from local memory (and replays checkpoints in the
// reverse mode), which made the backward mixing a large share of the layer
// (docs/decisions.md). n = 4 keeps the fused kernels (sinkhorn4.cuh's
// one-thread form).
bool SplitMix(const LayerSpec& spec);

struct FusedPlan {
  FusedVariant variant = FusedVariant::kMix;
  int row = -1;  // of FusedForwardRows() or FusedBackwardRows()
};

FusedPlan PlanFusedForward(const LayerSpec& spec);
FusedPlan PlanFusedBackward(const LayerSpec& spec);

// Lanes per token of the backward's `mix` kernel, a launch shape that keeps
// every output's bits: 4 (sinkhorn4_quad.cuh) for mHC n = 4 layers on
// sinkhorn4.cuh's form up to kQuadMixMaxTokens tokens, where one thread per
// token leaves most schedulers with a warp or none; 1 otherwise.
inline constexpr int64_t kQuadMixMaxTokens = 16384;
int BackwardMixLanes(const LayerSpec& spec, int64_t tokens);

using FusedRow = PlanRow<FusedVariant>;
const std::vector<FusedRow>& FusedForwardRows();
const std::vector<FusedRow>& FusedBackwardRows();

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PLANS_FUSED_H_
