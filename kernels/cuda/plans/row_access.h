// The kernel plan of the row kernels (aggregate.cu, expand.cu, the FFMA
// post of post.cu, the fused pre / head ops' static forward and dh_pre):
// for a layer, the dtype and where the activation tensors start, how a
// thread touches its rows (primitives/row_access.cuh) and the stream
// count and channels per thread its kernel is built for. One table, first
// row that holds wins; each kernel's register budget decides which stream
// counts get vector paths and how wide their accesses are. Nothing depends
// on M.
#ifndef MHC_KERNELS_CUDA_PLANS_ROW_ACCESS_H_
#define MHC_KERNELS_CUDA_PLANS_ROW_ACCESS_H_

#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "mhc/types.h"
#include "plans/table.h"

namespace mhc::cuda {

// Threads of a row kernel's CTA (common.cuh's kRowThreads, checked there):
// the channel passes that WideAccesses counts.
inline constexpr int kRowPlanThreads = 128;

enum class RowAccess : uint8_t {
  kVector,   // V channels by one 8- or 16-byte access per stream
  kStrided,  // V channels 32 apart, element accesses: rows anywhere
  kElement,  // one channel per thread per step
};
inline constexpr int kNumRowAccesses = 3;

// "vector", "strided", "element", as the metrics label and the docs spell
// them.
absl::string_view ToString(RowAccess access);

// What a row kernel's thread holds per stream, which bounds the stream
// counts its vector paths are built for: kQuadratic (n^2 sums, the FFMA
// post) not n = 16, where V channels of 16 streams would spill; kLinear
// and kLinearWide every n in {2, 4, 8, 16}. kLinearWide: light enough for
// 16-byte accesses at n = 8 and 16 too, where the others take 8-byte ones.
enum class StreamState : uint8_t { kQuadratic, kLinear, kLinearWide };

enum class RowKernel : uint8_t {
  kAggregateForward,   // linear; 16-byte at n = 8, 16 on full passes
  kAggregateBackward,  // linear
  kExpandForward,      // linear
  kExpandBackward,     // linear; 16-byte at n = 16 on full passes
  kPost,               // quadratic: the FFMA post, both directions
  kPre,                // linear: the fused ops' static forward and dh_pre
};

constexpr StreamState StateOf(RowKernel kernel) {
  switch (kernel) {
    case RowKernel::kAggregateForward:
    case RowKernel::kExpandBackward:
      return StreamState::kLinearWide;
    case RowKernel::kPost:
      return StreamState::kQuadratic;
    case RowKernel::kAggregateBackward:
    case RowKernel::kExpandForward:
    case RowKernel::kPre:
      return StreamState::kLinear;
  }
  return StreamState::kLinear;
}

// Whether a kernel's strided rows may be staged: its loads are most of its
// bytes (not the expand forward, which reads one row and writes n).
constexpr bool StagesRows(RowKernel kernel) {
  return kernel != RowKernel::kExpandForward;
}

struct RowAccessPlan {
  RowAccess access = RowAccess::kElement;
  int row = -1;  // of RowAccessRows()
  // The stream count the kernel is built for (NT): n itself on the vector
  // and strided paths; on the element path the smallest of 2, 4, 8, 16
  // holding n (4 for n = 4 exactly).
  int streams = 0;
  int channels = 1;  // V: per thread and stream, per step
  // Bytes per access: V elements on the vector path, one element otherwise.
  int access_bytes = 0;
  // Strided rows read through shared memory (primitives/staged_windows.cuh):
  // 16-bit, stream-major, every tensor on 16 bytes, a kernel that
  // StagesRows; the post backward sets it false (kernels/cuda/post.cu).
  // 4-byte element loads hold no more registers than the vector path's, so
  // staging them only adds the copy. The slots, and so every result, are
  // the element loads'.
  bool staged = false;
};

// `alignment`: the least of the kernel's activation tensors.
RowAccessPlan PlanRowAccess(RowKernel kernel, const LayerSpec& spec,
                            DType dtype, int alignment);

// Whether 16-byte accesses keep a row kernel's passes over the C channels
// full: at most a tenth of the thread slots idle in them. Where they do,
// the wider accesses measured faster; at a sixth idle (C = 2560) slower
// (docs/decisions.md).
bool WideAccesses(int64_t hidden, DType dtype);

using RowAccessRow = PlanRow<RowAccess>;
const std::vector<RowAccessRow>& RowAccessRows();

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PLANS_ROW_ACCESS_H_
