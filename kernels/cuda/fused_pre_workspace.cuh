// The fused pre / head ops' workspace layout (fused_pre.cu): the slices of
// the forward's and the backward's workspace, which depend on the fused
// plan's mixing variant (SplitMix). Host code, included by fused_pre.cu
// alone.
#ifndef MHC_KERNELS_CUDA_FUSED_PRE_WORKSPACE_CUH_
#define MHC_KERNELS_CUDA_FUSED_PRE_WORKSPACE_CUH_

#include <cstddef>
#include <cstdint>

#include "common.cuh"
#include "launch.h"
#include "mhc/dtype.h"
#include "mhc/types.h"
#include "plans/fused.h"
#include "projection/backward/wide.h"

namespace mhc::cuda::fused_pre {

// The layers whose mixing runs as the scale and Sinkhorn op kernels, in both
// directions: the fused plan's split_mix rows (plans/fused.h).
using ::mhc::cuda::SplitMix;

// The fused backward's arrival counters (BackwardSlices::arrivals).
inline constexpr int kBackwardArrivals = 1 + proj::kSplitArrivals;

// Workspace slices of the fused backward, in order (h_post, logits and
// dlogits only for SplitMix layers).
struct BackwardSlices {
  size_t dh, dms, h_pre, dh_pre, r, contrib, col_partial, dphi, split_dphi,
      wide, h_fwd, ms_fwd, h_post, logits, dlogits, repair_scaled, repair_flag,
      repair_count, arrivals, proj_partial, total;
};

// Byte offsets of consecutive 256-B aligned float slices.
struct SliceCursor {
  size_t offset = 0;
  size_t operator()(size_t floats) {
    const size_t at = offset;
    offset += AlignBytes(sizeof(float) * floats);
    return at;
  }
};

inline BackwardSlices Slices(const LayerSpec& spec, int64_t tokens,
                             DType dtype) {
  const int64_t n = spec.n;
  const int64_t rows = spec.NumLogits();
  const int64_t width = rows + spec.NumAlpha();
  BackwardSlices b;
  SliceCursor take;
  b.dh = take(tokens * rows);
  b.dms = take(tokens);
  b.h_pre = take(tokens * n);
  b.dh_pre = take(tokens * n);
  b.r = take(tokens * n * n);
  // The per-token dalpha / dbeta contributions and their chunk sums; a
  // SplitMix layer's scale backward takes the two slices as its workspace.
  const bool split = SplitMix(spec);
  b.contrib = take(split ? ScaleBackwardWorkspace(spec, tokens) / sizeof(float)
                         : tokens * width);
  b.col_partial = take(split ? 0 : NumChunks(tokens) * width);
  b.dphi =
      take(spec.dynamic ? NumPhiChunks(spec, tokens) * rows * spec.K() : 0);
  b.split_dphi = take(SplitPartialBytes(spec, tokens) / sizeof(float));
  b.wide = take(WideDxScratchBytes(spec, tokens, dtype, /*terms=*/true) /
                sizeof(float));
  b.h_fwd = take(spec.dynamic ? tokens * rows : 0);
  b.ms_fwd = take(spec.dynamic ? tokens : 0);
  b.h_post = take(split ? tokens * n : 0);
  b.logits = take(split ? tokens * n * n : 0);
  b.dlogits = take(split ? tokens * n * n : 0);
  // The overflow repair's rows (overflow_repair.h); ints as floats.
  const bool repair = spec.dynamic;
  b.repair_scaled = take(repair ? tokens * (rows + 1) : 0);
  b.repair_flag = take(repair ? tokens : 0);
  b.repair_count = take(repair ? 1 : 0);
  // The counters of the single-launch column sums (LaunchColumnSum) and of
  // the dx kernels' split chunks (DxArgs::split_arrivals), which the dh_pre
  // kernel zeroes.
  b.arrivals = take(kBackwardArrivals);
  b.proj_partial = take.offset;
  b.total = take.offset + MmaProjectionWorkspace(spec, tokens, dtype);
  return b;
}

// Workspace slices of the fused forward of a dynamic layer, after the
// tensor-core projection's partials: H_pre for the aggregate kernel, then
// for SplitMix layers h, the mean square and the logits.
struct ForwardSlices {
  size_t h_pre, h, ms, logits, total;
};

inline ForwardSlices ForwardSlicesOf(const LayerSpec& spec, int64_t tokens,
                                     DType dtype) {
  const int64_t n = spec.n;
  const bool split = SplitMix(spec);
  ForwardSlices f;
  SliceCursor take{MmaProjectionWorkspace(spec, tokens, dtype)};
  f.h_pre = take(tokens * n);
  f.h = take(split ? tokens * spec.NumLogits() : 0);
  f.ms = take(split ? tokens : 0);
  f.logits = take(split ? tokens * n * n : 0);
  f.total = take.offset;
  return f;
}

}  // namespace mhc::cuda::fused_pre

#endif  // MHC_KERNELS_CUDA_FUSED_PRE_WORKSPACE_CUH_
