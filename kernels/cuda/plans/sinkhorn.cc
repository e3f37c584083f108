// The Sinkhorn plan's table and what it computes from a launch.
#include "plans/sinkhorn.h"

namespace mhc::cuda {
namespace {

using SV = SinkhornVariant;

struct SinkhornCase {
  const LayerSpec& spec;
  bool backward;
};

LayerExample Example(int n, const char* preset = "deepseek_v4") {
  LayerExample e;
  e.preset = preset;
  e.n = n;
  e.dtype = DType::kF32;  // the op's tensors are fp32 at any dtype
  return e;
}

// Both directions, first row that holds wins.
const std::vector<PlanRule<SV, SinkhornCase>>& Rules() {
  static const auto* rules = new std::vector<PlanRule<SV, SinkhornCase>>{
      {{SV::kN4, "`n = 4`, LINEAR, `eps_sk >= FLT_MIN` (backward: `T <= 20`)",
        "kernels/cuda/sinkhorn4.cuh",
        "one thread per token, the iterate as `diag(u) K diag(v)` carried by "
        "inverse scales, exact reverse mode from the kept denominators; a "
        "warp's rows by 16-byte accesses through a shared tile where every "
        "tensor sits on 16 bytes",
        Example(4)},
       [](const SinkhornCase& c) {
         return SinkhornN4Applies(SinkhornShapeOf(c.spec), c.backward);
       }},
      {{SV::kLanes, "LINEAR, `T <= 20`, `2 <= n <= 16`",
        "kernels/cuda/sinkhorn_lanes.cuh",
        "the token's matrix in the corner of an `N x N` block (`N` = 2, 4, 8 "
        "or 16) over `N / 2` lanes (one at `N = 2`), padding held at exact "
        "zeros",
        Example(8)},
       [](const SinkhornCase& c) { return SinkhornLanesCover(c.spec); }},
      {{SV::kThread, "otherwise (LOG, `T > 20`, `n = 1`)",
        "kernels/cuda/sinkhorn.cu",
        "one thread per token, the matrix in registers (`n = 4`) or "
        "thread-local arrays; the reverse mode recomputes the forward from "
        "in-thread checkpoints",
        Example(4, "transformer_engine")},
       [](const SinkhornCase&) { return true; }},
  };
  return *rules;
}

SinkhornPlan Plan(const LayerSpec& spec, bool backward, int alignment) {
  SinkhornPlan plan;
  plan.row = FirstRowThatHolds(Rules(), SinkhornCase{spec, backward});
  plan.variant = Rules()[plan.row].row.variant;
  switch (plan.variant) {
    case SV::kN4:
      plan.vector_rows = alignment >= 16;
      break;
    case SV::kLanes:
      plan.block = spec.n <= 2 ? 2 : spec.n <= 4 ? 4 : spec.n <= 8 ? 8 : 16;
      plan.padded = (spec.n & (spec.n - 1)) != 0;
      break;
    case SV::kThread:
      plan.streams = spec.n == 4 ? 4 : kMaxStreams;
      break;
  }
  return plan;
}

}  // namespace

absl::string_view ToString(SinkhornVariant variant) {
  switch (variant) {
    case SV::kN4:
      return "n4";
    case SV::kLanes:
      return "lanes";
    case SV::kThread:
      return "thread";
  }
  return "unknown";
}

bool SinkhornLanesCover(const LayerSpec& spec) {
  return spec.sinkhorn_mode == SinkhornMode::kLinear &&
         spec.sinkhorn_iterations >= 1 &&
         spec.sinkhorn_iterations <= kLaneMaxIterations && spec.n >= 2 &&
         spec.n <= 16;
}

SinkhornPlan PlanSinkhornForward(const LayerSpec& spec, int alignment) {
  return Plan(spec, /*backward=*/false, alignment);
}

SinkhornPlan PlanSinkhornBackward(const LayerSpec& spec, int alignment) {
  return Plan(spec, /*backward=*/true, alignment);
}

const std::vector<SinkhornRow>& SinkhornRows() {
  static const auto* rows = new std::vector<SinkhornRow>(RowsOf(Rules()));
  return *rows;
}

}  // namespace mhc::cuda
