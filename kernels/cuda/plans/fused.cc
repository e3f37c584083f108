// The fused ops' plan: its two tables and what they compute from a layer.
#include "plans/fused.h"

#include "plans/sinkhorn.h"

namespace mhc::cuda {
namespace {

using FV = FusedVariant;
using Rule = PlanRule<FV, LayerSpec>;

LayerExample Example(int n, bool dynamic = true) {
  LayerExample e;
  e.n = n;
  e.dynamic = dynamic;
  return e;
}

constexpr char kFusedPre[] = "kernels/cuda/fused_pre.cu";
constexpr char kSplitWhen[] =
    "mHC, `n != 4`, the Sinkhorn lane kernels take the layer (LINEAR, "
    "`T <= 20`, `2 <= n <= 16`)";

const std::vector<Rule>& ForwardRules() {
  static const auto* rules = new std::vector<Rule>{
      {{FV::kStatic, "static layer (no projection)", kFusedPre,
        "a CTA per 4 tokens: the mixing values from `beta`, then the "
        "aggregate, in one kernel",
        Example(4, /*dynamic=*/false)},
       [](const LayerSpec& s) { return !s.dynamic; }},
      {{FV::kSplitMix, kSplitWhen, kFusedPre,
        "the projection, then the scale and Sinkhorn op kernels (the lane "
        "kernels keep the matrices in registers), then the aggregate",
        Example(8)},
       [](const LayerSpec& s) { return SplitMix(s); }},
      {{FV::kMix, "otherwise (mHC `n = 4`, HEAD, LOG, `T > 20`)", kFusedPre,
        "the projection's units, then one thread per token adds their chunk "
        "partials and runs scale and Sinkhorn (`sinkhorn4.cuh`'s form where "
        "the Sinkhorn plan's `n4` row holds), with the aggregate beside it "
        "(a CTA per token gates its `H_pre` from the partials itself)",
        Example(4)},
       [](const LayerSpec&) { return true; }},
  };
  return *rules;
}

const std::vector<Rule>& BackwardRules() {
  static const auto* rules = new std::vector<Rule>{
      {{FV::kSplitMix, kSplitWhen, kFusedPre,
        "`dh_pre`, the scale forward again, the lane kernels' reverse mode "
        "(and `R` for the residual term), the scale backward; then `dx` and "
        "the `dphi` partials (the projection backward plan with the fused "
        "terms)",
        Example(8)},
       [](const LayerSpec& s) { return SplitMix(s); }},
      {{FV::kMix, "otherwise (static layers of other `n` too)",
        "kernels/cuda/fused_pre_backward_mix.cu",
        "`dh_pre`, then the reverse mode of scale and Sinkhorn per token (one "
        "thread, or for mHC `n = 4` a quad of lanes up to "
        "`kQuadMixMaxTokens` tokens: `BackwardMixLanes`); then `dx` and the "
        "`dphi` partials (the projection backward plan with the fused terms) "
        "and the column sums of `dalpha` / `dbeta`",
        Example(4)},
       [](const LayerSpec&) { return true; }},
  };
  return *rules;
}

FusedPlan Plan(const std::vector<Rule>& rules, const LayerSpec& spec) {
  FusedPlan plan;
  plan.row = FirstRowThatHolds(rules, spec);
  plan.variant = rules[plan.row].row.variant;
  return plan;
}

}  // namespace

absl::string_view ToString(FusedVariant variant) {
  switch (variant) {
    case FV::kStatic:
      return "static";
    case FV::kMix:
      return "mix";
    case FV::kSplitMix:
      return "split_mix";
  }
  return "unknown";
}

bool SplitMix(const LayerSpec& spec) {
  return spec.kind == LayerKind::kMhc && spec.n != 4 &&
         SinkhornLanesCover(spec);
}

FusedPlan PlanFusedForward(const LayerSpec& spec) {
  return Plan(ForwardRules(), spec);
}

FusedPlan PlanFusedBackward(const LayerSpec& spec) {
  return Plan(BackwardRules(), spec);
}

int BackwardMixLanes(const LayerSpec& spec, int64_t tokens) {
  const bool quad =
      PlanFusedBackward(spec).variant == FusedVariant::kMix &&
      spec.kind == LayerKind::kMhc &&
      SinkhornN4Applies(SinkhornShapeOf(spec), /*backward=*/true) &&
      tokens <= kQuadMixMaxTokens;
  return quad ? 4 : 1;
}

const std::vector<FusedRow>& FusedForwardRows() {
  static const auto* rows = new std::vector<FusedRow>(RowsOf(ForwardRules()));
  return *rows;
}

const std::vector<FusedRow>& FusedBackwardRows() {
  static const auto* rows = new std::vector<FusedRow>(RowsOf(BackwardRules()));
  return *rows;
}

}  // namespace mhc::cuda
