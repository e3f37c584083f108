// The row access plan's table and what it computes from a launch.
#include "plans/row_access.h"

namespace mhc::cuda {
namespace {

using RA = RowAccess;

struct RowCase {
  RowKernel kernel;
  const LayerSpec& spec;
  DType dtype;
  int alignment;
};

// Elements per 16 bytes: the vector path's V at n = 2, 4.
int VectorWidth(DType dtype) { return 16 / static_cast<int>(DTypeSize(dtype)); }

// The stream counts whose vector and strided paths the kernel is built for.
bool VectorStreams(const RowCase& c) {
  const int n = c.spec.n;
  if (n == 16) return StateOf(c.kernel) != StreamState::kQuadratic;
  return n == 2 || n == 4 || n == 8;
}

// Where a kLinearWide kernel takes 16-byte accesses at n = 8 or 16: the
// aggregate forward at both; the expand backward at n = 16 only, since at
// n = 8 its 8-byte accesses already run near copy bandwidth and the wide
// ones measured slower (docs/decisions.md).
bool Wide(const RowCase& c) {
  switch (c.kernel) {
    case RowKernel::kAggregateForward:
      return WideAccesses(c.spec.hidden, c.dtype);
    case RowKernel::kExpandBackward:
      return c.spec.n == 16 && WideAccesses(c.spec.hidden, c.dtype);
    default:
      return false;
  }
}

LayerExample Example(int n, int alignment = 16) {
  LayerExample e;
  e.n = n;
  e.alignment = alignment;
  return e;
}

// First row that holds wins.
const std::vector<PlanRule<RA, RowCase>>& Rules() {
  static const auto* rules = new std::vector<PlanRule<RA, RowCase>>{
      {{RA::kVector,
        "`n = 2, 4, 8, 16` (the post: not 16), `C % V == 0` (`V` = 16 bytes "
        "of elements), every activation tensor on 16 bytes",
        "kernels/cuda/primitives/row_access.cuh",
        "one 16-byte access per stream at `n = 2, 4`; 8-byte at `n = 8, 16`, "
        "16-byte for the aggregate forward at `n = 8, 16` and the expand "
        "backward at `n = 16` where the channel passes stay at least 90 % "
        "full",
        Example(4)},
       [](const RowCase& c) {
         return VectorStreams(c) && c.spec.hidden % VectorWidth(c.dtype) == 0 &&
                c.alignment >= 16;
       }},
      {{RA::kStrided, "`n = 2, 4, 8, 16` (the post: not 16) otherwise",
        "kernels/cuda/primitives/row_access.cuh",
        "the vector path's `V` channels per stream, 32 apart: 16-bit "
        "stream-major rows of tensors on 16 bytes staged, each warp copying "
        "the 16-byte chunks around its 32 `V` channels into shared memory "
        "(`primitives/staged_windows.cuh`; not the expand forward, which "
        "mostly writes, nor the post backward, which measured slower "
        "staged), else element accesses, a warp reading 32 consecutive "
        "elements and a thread keeping `V` loads per stream in flight (the "
        "`n = 4` post backward's 16-bit stream-major rows with the next step's "
        "spans asked of L2, `primitives/l2_prefetch.cuh`)",
        Example(4, 8)},
       [](const RowCase& c) { return VectorStreams(c); }},
      {{RA::kElement, "every other `n`, and `n = 16` in the post",
        "kernels/cuda/primitives/row_access.cuh",
        "one channel per thread, the kernel built for the smallest of 2, 4, "
        "8, 16 streams that holds `n`",
        Example(3)},
       [](const RowCase&) { return true; }},
  };
  return *rules;
}

}  // namespace

absl::string_view ToString(RowAccess access) {
  switch (access) {
    case RA::kVector:
      return "vector";
    case RA::kStrided:
      return "strided";
    case RA::kElement:
      return "element";
  }
  return "unknown";
}

bool WideAccesses(int64_t hidden, DType dtype) {
  const int64_t per_pass = int64_t{kRowPlanThreads} * VectorWidth(dtype);
  const int64_t passes = (hidden + per_pass - 1) / per_pass;
  return 10 * hidden >= 9 * passes * per_pass;
}

RowAccessPlan PlanRowAccess(RowKernel kernel, const LayerSpec& spec,
                            DType dtype, int alignment) {
  const RowCase c{kernel, spec, dtype, alignment};
  RowAccessPlan plan;
  plan.row = FirstRowThatHolds(Rules(), c);
  plan.access = Rules()[plan.row].row.variant;
  const int n = spec.n;
  const int esize = static_cast<int>(DTypeSize(dtype));
  if (plan.access == RA::kElement) {
    plan.streams = n == 4 ? 4 : n <= 2 ? 2 : n <= 8 ? 8 : kMaxStreams;
    plan.channels = 1;
    plan.access_bytes = esize;
    return plan;
  }
  plan.streams = n;
  plan.staged = plan.access == RA::kStrided &&
                spec.layout == Layout::kStreamMajor && alignment >= 16 &&
                esize == 2 && StagesRows(kernel);
  const bool wide = plan.access == RA::kVector && Wide(c);
  plan.channels =
      n == 2 || n == 4 || wide ? VectorWidth(dtype) : VectorWidth(dtype) / 2;
  plan.access_bytes =
      plan.access == RA::kVector ? plan.channels * esize : esize;
  return plan;
}

const std::vector<RowAccessRow>& RowAccessRows() {
  static const auto* rows = new std::vector<RowAccessRow>(RowsOf(Rules()));
  return *rows;
}

}  // namespace mhc::cuda
