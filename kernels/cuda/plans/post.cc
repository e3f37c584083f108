// The post plan's table and what it computes from a launch.
#include "plans/post.h"

namespace mhc::cuda {
namespace {

using PV = PostVariant;

struct PostCase {
  const LayerSpec& spec;
  DType dtype;
  const PostAlignment& alignment;
  RowAccess rows;  // the FFMA kernels' access (RowKernel::kPost)
};

LayerExample Example(int n, DType dtype = DType::kBF16, int alignment = 16) {
  LayerExample e;
  e.n = n;
  e.dtype = dtype;
  e.alignment = alignment;
  return e;
}

// Both directions, first row that holds wins. The mma row is there because
// the FFMA kernels' n^2 + n multiply-adds per channel held them at 45 % of
// copy at n = 8 and 8-12 % at n = 16 (docs/decisions.md).
const std::vector<PlanRule<PV, PostCase>>& Rules() {
  static const auto* rules = new std::vector<PlanRule<PV, PostCase>>{
      {{PV::kMma,
        "bf16, stream-major, `n = 3` or `5..16`, `C % 8 == 0`, every tensor "
        "(bias included) on 16 bytes",
        "kernels/cuda/post_mma.cu",
        "stream mixing on `mma.m16n8k16` (`R` and `H_post` as two bf16 "
        "terms, streams transposed in registers by `movmatrix`), a warp per "
        "32 channels of a token per step",
        Example(8)},
       [](const PostCase& c) {
         const LayerSpec& s = c.spec;
         return c.dtype == DType::kBF16 && s.layout == Layout::kStreamMajor &&
                s.n > 2 && s.n != 4 && s.hidden % 8 == 0 &&
                c.alignment.rows >= 16 && c.alignment.bias >= 16;
       }},
      {{PV::kVector, "otherwise, rows the row access plan reads as `vector`",
        "kernels/cuda/post.cu",
        "FFMA, a CTA per token; the backward splits a token's streams over 2 "
        "or 4 thread groups at `n >= 5` (the forward at `n >= 9`), and runs "
        "64-thread CTAs at `n = 4`, each thread with two channel steps of "
        "loads in flight; the stream-minor forward deals a step's 16-byte "
        "words to the threads in turn where a word holds whole channels "
        "(`n = 2, 4`; `n = 8` in 16 bits)",
        Example(4)},
       [](const PostCase& c) { return c.rows == RowAccess::kVector; }},
      {{PV::kStrided, "otherwise, `strided` rows", "kernels/cuda/post.cu",
        "FFMA as `vector`, channels 32 apart", Example(4, DType::kBF16, 8)},
       [](const PostCase& c) { return c.rows == RowAccess::kStrided; }},
      {{PV::kElement,
        "otherwise, `element` rows (`n = 16` too: a thread keeps `n^2` sums)",
        "kernels/cuda/post.cu", "FFMA, one channel per thread",
        Example(16, DType::kF32)},
       [](const PostCase&) { return true; }},
  };
  return *rules;
}

}  // namespace

absl::string_view ToString(PostVariant variant) {
  switch (variant) {
    case PV::kMma:
      return "mma";
    case PV::kVector:
      return "vector";
    case PV::kStrided:
      return "strided";
    case PV::kElement:
      return "element";
  }
  return "unknown";
}

PostPlan PlanPost(const LayerSpec& spec, DType dtype,
                  const PostAlignment& alignment) {
  PostPlan plan;
  plan.rows = PlanRowAccess(RowKernel::kPost, spec, dtype, alignment.rows);
  plan.row = FirstRowThatHolds(
      Rules(), PostCase{spec, dtype, alignment, plan.rows.access});
  plan.variant = Rules()[plan.row].row.variant;
  return plan;
}

const std::vector<PostRow>& PostRows() {
  static const auto* rows = new std::vector<PostRow>(RowsOf(Rules()));
  return *rows;
}

}  // namespace mhc::cuda
