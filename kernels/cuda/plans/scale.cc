// The scale plan's table and what it computes from a launch.
#include "plans/scale.h"

namespace mhc::cuda {
namespace {

using SV = ScaleVariant;

struct ScaleCase {
  const LayerSpec& spec;
  int alignment;
};

LayerExample Example(int n, int alignment = 16) {
  LayerExample e;
  e.n = n;
  e.dtype = DType::kF32;  // the op's tensors are fp32 at any dtype
  e.alignment = alignment;
  return e;
}

// Both directions, first row that holds wins.
const std::vector<PlanRule<SV, ScaleCase>>& Rules() {
  static const auto* rules = new std::vector<PlanRule<SV, ScaleCase>>{
      {{SV::kN4Vector, "`n = 4`, every row it moves on 16 bytes",
        "kernels/cuda/scale.cu",
        "a thread per (token, quarter of the `N` logits), each quarter one "
        "16-byte access of `h`, the gates / logits and their gradients; the "
        "backward sums `dalpha` / `dbeta` per block of 128 tokens and the "
        "last block adds the partial rows in block order, in one launch",
        Example(4)},
       [](const ScaleCase& c) { return c.spec.n == 4 && c.alignment >= 16; }},
      {{SV::kN4Scalar, "`n = 4`, otherwise", "kernels/cuda/scale.cu",
        "as `n4_vector`, each quarter by 4-byte accesses (the same bits)",
        Example(4, 4)},
       [](const ScaleCase& c) { return c.spec.n == 4; }},
      {{SV::kThread, "otherwise (`n != 4`)", "kernels/cuda/scale.cu",
        "one thread per token; the backward sums `dalpha` / `dbeta` by warps "
        "of 32 (an xor tree), then chunks of warp rows in order; the fused "
        "ops' overflow repair runs here",
        Example(8)},
       [](const ScaleCase&) { return true; }},
  };
  return *rules;
}

}  // namespace

absl::string_view ToString(ScaleVariant variant) {
  switch (variant) {
    case SV::kN4Vector:
      return "n4_vector";
    case SV::kN4Scalar:
      return "n4_scalar";
    case SV::kThread:
      return "thread";
  }
  return "unknown";
}

ScalePlan PlanScale(const LayerSpec& spec, int alignment) {
  ScalePlan plan;
  plan.row = FirstRowThatHolds(Rules(), ScaleCase{spec, alignment});
  plan.variant = Rules()[plan.row].row.variant;
  if (plan.variant != SV::kThread) {
    plan.quarters = spec.kind == LayerKind::kHead ? 1 : 6;
  }
  return plan;
}

const std::vector<ScaleRow>& ScaleRows() {
  static const auto* rows = new std::vector<ScaleRow>(RowsOf(Rules()));
  return *rows;
}

}  // namespace mhc::cuda
