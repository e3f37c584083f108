// What the wide projection forwards (mma_wide.cu and its wgmma
// form) share: a unit's bounds, stages of kWideStageK k whose x rows are
// 16-byte chunks swizzled so that fragment loads of consecutive rows cover
// all 32 banks, the TF32 rounding both apply to phi' (and to fp32 x), and the
// store of a row's sum of squares. (Their copy plans look alike but stay
// apart: the wgmma form through a shared copy helper measured slower,
// docs/decisions.md.)
#ifndef MHC_KERNELS_CUDA_PROJECTION_FORWARD_WIDE_STAGE_CUH_
#define MHC_KERNELS_CUDA_PROJECTION_FORWARD_WIDE_STAGE_CUH_

#include <cstdint>

#include "projection/forward/mma.cuh"

namespace mhc::cuda {

inline constexpr int kWideStageK = 32;  // k per pipeline stage
static_assert(kMmaBk % kWideStageK == 0, "stages tile a chunk");

// Where 16-byte chunk c of staged row r lives. The fragment loads read,
// per 8 lanes (16-byte loads) or 16 lanes (8-byte loads), the same chunks
// of consecutive rows; 128-byte rows (fp32 x, phi) swap halves on odd rows,
// 64-byte rows (16-bit x) swap pairs of chunks on every other row pair, so
// those reads cover all 32 banks once.
template <int kRowBytes>
__device__ __forceinline__ int SwizzledChunk(int r, int c) {
  if constexpr (kRowBytes == 128) {
    return c ^ ((r & 1) << 2);
  } else {
    static_assert(kRowBytes == 64, "16-bit or fp32 rows of kWideStageK");
    return c ^ (((r >> 1) & 1) << 1);
  }
}
template <typename E>
__device__ __forceinline__ int StagedIndex(int r, int k) {
  constexpr int kRowBytes = kWideStageK * sizeof(E);
  constexpr int kPer = 16 / sizeof(E);
  return r * kWideStageK + SwizzledChunk<kRowBytes>(r, k / kPer) * kPer +
         k % kPer;
}

// A persistent unit's tokens m0 .. m0 + rows - 1, its K chunk [kbeg, kend)
// (span k) in stages of kWideStageK, and its logits g0 .. g0 + logits - 1.
struct WideUnit {
  int64_t m0, kbeg, kend;
  int g0, rows, logits, span, stages;
};
template <int kLogits>
__device__ __forceinline__ WideUnit WideUnitOf(const DevSpec& s, int64_t tokens,
                                               const ChunkPlan& plan,
                                               const MmaUnit& unit) {
  WideUnit u;
  u.m0 = unit.tile * kMmaTokens;
  u.kbeg = unit.chunk * plan.chunk;
  u.kend = min(s.K, u.kbeg + plan.chunk);
  u.g0 = unit.group * kLogits;
  u.rows =
      static_cast<int>(min(static_cast<int64_t>(kMmaTokens), tokens - u.m0));
  u.logits = min(kLogits, s.N - u.g0);
  u.span = static_cast<int>(u.kend - u.kbeg);
  u.stages = (u.span + kWideStageK - 1) / kWideStageK;
  return u;
}

// v rounded to tf32, to nearest with ties away from zero (cvt.rna's
// rounding, which sm_90 runs as a compare and several integer steps): add
// half a tf32 ulp to the magnitude's bits and drop the 13 low bits. An
// overflow carries into Inf, as cvt.rna does; NaN stays as it is.
__device__ __forceinline__ float RoundTf32Bits(float v) {
  const uint32_t bits = __float_as_uint(v);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return v;
  return __uint_as_float((bits + 0x1000u) & 0xffffe000u);
}

// A tile row's sum of squares into column N of its partial row: thread
// pairs (2 r, 2 r + 1) hold the sums of row r's two halves of every stage,
// added the first half first; only the first logit group writes it.
__device__ __forceinline__ void StoreRowSquares(float* out, int width, int N,
                                                float half_sum,
                                                bool first_group, int rows) {
  const float other = __shfl_xor_sync(0xffffffffu, half_sum, 1);
  const int row = threadIdx.x >> 1;
  if ((threadIdx.x & 1) == 0 && first_group && row < rows) {
    out[row * width + N] = half_sum + other;
  }
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_FORWARD_WIDE_STAGE_CUH_
