// What the bf16 warpgroup-mma projection units share
// (projection/forward/wgmma_bf16.cu: one logit group;
// projection/forward/wgmma_bf16_wide.cu: 80 logits): the stage geometry, phi'
// split into bf16 B tiles, x rows copied into wgmma's A layout, the sum of
// squares on mma.sync, and the accumulators' flush and store.
//
// Numerics: phi' = phi * gamma (one rounded multiply, as docs/SPEC.md defines
// it) split into bf16 terms hi + mid (TF32 precision: 16 significant bits)
// or hi + mid + lo (IEEE); products of bf16 x and a term are exact in fp32.
// The tensor cores accumulate a few stages (they truncate against a long
// running sum), then Flush adds them to fp32 sums with rounded adds.
#ifndef MHC_KERNELS_CUDA_PROJECTION_FORWARD_BF16_UNIT_CUH_
#define MHC_KERNELS_CUDA_PROJECTION_FORWARD_BF16_UNIT_CUH_

#include <cuda_bf16.h>

#include <cstdint>

#include "common.cuh"
#include "dispatch.cuh"
#include "mhc/types.h"
#include "primitives/cluster.cuh"
#include "primitives/wgmma.cuh"
#include "projection/forward/mma.cuh"

namespace mhc::cuda::bf16_unit {

inline constexpr int kStageK = kMmaBk;         // 64 bf16: one 128-byte row
inline constexpr int kRowBytes = kStageK * 2;  // of a token or of a logit
inline constexpr int kRowChunks = kRowBytes / 16;
static_assert(kRowBytes == 128,
              "rows of primitives/wgmma.cuh's swizzled layout");

__host__ __device__ constexpr int Terms(bool ieee) { return ieee ? 3 : 2; }

// The bf16 terms of one phi' chunk (logit row g, 16-byte chunk c) into the
// term tiles at `tiles`, kTileBytes apart, consumed from v.
template <int kTileBytes, int kTerms>
__device__ __forceinline__ void StorePhiChunk(float (&v)[8], char* tiles, int g,
                                              int c) {
  const int at = SwizzledChunkAt(g, c);
#pragma unroll
  for (int t = 0; t < kTerms; ++t) {
    uint4 w;
    w.x = SplitPair(v[0], v[1]);
    w.y = SplitPair(v[2], v[3]);
    w.z = SplitPair(v[4], v[5]);
    w.w = SplitPair(v[6], v[7]);
    *reinterpret_cast<uint4*>(tiles + t * kTileBytes + at) = w;
  }
}

// Pair rows: bf16 rows of K elements 8 bytes off 16 (K = 4 mod 8), at least
// two tokens. Every even token's row starts on 16 bytes and two rows span a
// multiple of 16 bytes, so a tensor map of the even tokens' rows reaches
// their stage as one 64 x 32-row box in wgmma's swizzle (rows 0-31 of a
// unit), and a map over whole token pairs (rows of 2K elements) the odd
// tokens' in unswizzled boxes that start kPairShift elements early, on 16
// bytes (rows 32-63). The warps read their rows' A fragments into registers
// from either box; the products and their order are those of the other
// copies: the same bits.
inline constexpr int kPairHalfRows = 32;  // tokens of each parity
inline constexpr int kPairShift = 4;      // elements off 16 bytes
// The odd box's columns: the stage and the shift, rounded to 16 bytes.
inline constexpr int kPairOddCols = kStageK + 8;
inline constexpr int kPairOddBoxBytes = kPairHalfRows * kPairOddCols * 2;
// The unit token (from its first) in staged row `row`.
template <bool kPairRows>
__host__ __device__ constexpr int TokenOfRow(int row) {
  if (!kPairRows) return row;
  return row < kPairHalfRows ? 2 * row : 2 * (row - kPairHalfRows) + 1;
}

// Token tiles of kTokens (a unit each per K chunk).
template <int kTokens>
__host__ __device__ inline int64_t UnitTiles(int64_t tokens) {
  return (tokens + kTokens - 1) / kTokens;
}

// A unit of kTokens tokens: tokens m0 .. m0 + rows - 1 over its K chunk
// [kbeg, kend) (span k, in `stages` stages of kStageK).
struct UnitSpan {
  int64_t m0, kbeg, kend;
  int rows, span, stages;
};
template <int kTokens>
__device__ __forceinline__ UnitSpan UnitSpanOf(const DevSpec& s, int64_t tokens,
                                               const ChunkPlan& plan,
                                               const MmaUnit& unit) {
  UnitSpan u;
  u.m0 = unit.tile * kTokens;
  u.kbeg = static_cast<int64_t>(unit.chunk) * plan.chunk;
  u.kend = min(s.K, u.kbeg + plan.chunk);
  u.rows = static_cast<int>(min(static_cast<int64_t>(kTokens), tokens - u.m0));
  u.span = static_cast<int>(u.kend - u.kbeg);
  u.stages = (u.span + kStageK - 1) / kStageK;
  return u;
}

// One thread's share of a unit's x tile (kTokens rows by kThreads threads):
// piece xc of rows xr + i kRowsPerPass. Rows go in copies of kCopyBytes
// (the plan's x_copy_bytes: 16, or 8 / 4 where an odd C leaves rows of 4 C / 2
// C elements on 8 / 4 bytes); the pieces keep their place in the swizzled row,
// so the width never changes the bits. (16-byte copies from the boundaries
// around such rows, shifted into place through a raw ring, measured slower than
// the narrow copies: docs/decisions.md.)
template <int kThreads, int kTokens, int kCopyBytes>
class XCopies {
 public:
  __device__ explicit XCopies(int tid)
      : xc_(tid % kRowPieces), xr_(tid / kRowPieces) {}

  // The copies of unit u (kTokens tokens).
  __device__ void Begin(const __nv_bfloat16* x, int64_t K, const UnitSpan& u) {
    src_ = x + (u.m0 + xr_) * K + u.kbeg + xc_ * kPieceElems;
    rows_ = 0;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      if (xr_ + i * kRowsPerPass < u.rows) rows_ |= 1u << i;
    }
    // A piece holds k below the chunk's end (K is a multiple of the piece)
    // when its stage offset is below:
    klimit_ = u.span - xc_ * kPieceElems;
  }

  // The copies of the stage at k offset kst into `tile`; `any` is a valid
  // address for the zero-filled ones.
  __device__ void Load(char* tile, int64_t K, int kst,
                       const __nv_bfloat16* any) const {
    const bool k_ok = kst < klimit_;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const bool ok = k_ok && ((rows_ >> i) & 1u);
      const int at =
          SwizzledChunkAt(xr_ + i * kRowsPerPass, xc_ * kCopyBytes / 16) +
          xc_ * kCopyBytes % 16;
      CpAsync<kCopyBytes>(tile + at,
                          ok ? src_ + kst + i * kRowsPerPass * K : any, ok);
    }
  }

 private:
  static constexpr int kPieceElems = kCopyBytes / 2;
  static constexpr int kRowPieces = kRowBytes / kCopyBytes;
  static constexpr int kRowsPerPass = kThreads / kRowPieces;
  static constexpr int kPasses = kTokens / kRowsPerPass;
  static_assert(kPasses <= 32, "a mask bit per pass");
  int xc_, xr_;
  const __nv_bfloat16* src_ = nullptr;
  unsigned rows_ = 0;
  int klimit_ = 0;
};

// A warp's kW logits of its 16 token rows (slab .. slab + 15 of the unit,
// the wgmma accumulator layout) into rows of `width` floats at out, a token's
// row at TokenOfRow; tokens at or past `rows` are none.
template <int kW, bool kPairRows = false>
__device__ __forceinline__ void StoreLogits(const float (&acc)[kW / 2],
                                            float* out, int width, int N,
                                            int slab, int rows, int grp,
                                            int quad) {
#pragma unroll
  for (int i = 0; i < kW / 2; ++i) {
    const int t = TokenOfRow<kPairRows>(slab + grp + 8 * ((i >> 1) & 1));
    const int col = 8 * (i >> 2) + 2 * quad + (i & 1);
    if (t < rows && col < N) out[t * width + col] = acc[i];
  }
}

// A warp's kW logits and sums of squares of its 16 token rows (slab ..
// slab + 15 of the unit), in the wgmma accumulator layout
// (primitives/wgmma.cuh).
template <int kW>
struct WarpSums {
  float acc[kW / 2], fresh[kW / 2], gram[2][4];
  float ss[2];

  __device__ void Zero() {
    ZeroFill(acc);
    ZeroFill(fresh);
    ZeroFill(gram);
    ss[0] = ss[1] = 0.0f;
  }

  // The warpgroup's wgmmas of one staged 64-k tile into fresh: per 16 k,
  // one per term (B tiles kTileBytes apart).
  template <int kTerms, int kTileBytes>
  __device__ void IssueStage(uint64_t a_desc, uint64_t b_desc) {
    WgmmaFence();
#pragma unroll
    for (int j = 0; j < kStageK / 16; ++j) {
#pragma unroll
      for (int t = 0; t < kTerms; ++t) {
        WgmmaBf16<kW>(fresh, DescriptorPlus(a_desc, 32 * j),
                      DescriptorPlus(b_desc, t * kTileBytes + 32 * j));
      }
    }
    WgmmaCommit();
  }

  // The same from A fragments (the m16n8k16 layout of the warp's rows),
  // one per 16 k, in registers (pair rows).
  template <int kTerms, int kTileBytes>
  __device__ void IssueStage(const uint32_t (&a)[kStageK / 16][4],
                             uint64_t b_desc) {
    WgmmaFence();
#pragma unroll
    for (int j = 0; j < kStageK / 16; ++j) {
#pragma unroll
      for (int t = 0; t < kTerms; ++t) {
        WgmmaBf16RegA<kW>(fresh, a[j],
                          DescriptorPlus(b_desc, t * kTileBytes + 32 * j));
      }
    }
    WgmmaCommit();
  }

  // x x^T of one 16-k step's A fragment: each token's x.x lands on the
  // diagonal, exact products added in fp32. As B operands the same
  // registers are x^T: tokens 0-7 in a[0], a[2], tokens 8-15 in a[1], a[3].
  __device__ void AddSquares(const uint32_t (&a)[4]) {
    Mma16816(gram[0], a, a[0], a[2]);
    Mma16816(gram[1], a, a[1], a[3]);
  }

  // The same over the warp's rows of one staged 64-k tile.
  __device__ void AddSquares(const char* tile, int slab, int lane) {
    // ldmatrix rows: lanes 0-15 rows 0-15 at k 0, lanes 16-31 the same rows
    // at k 8 of each 16-k step.
    const int row = slab + (lane & 15);
#pragma unroll
    for (int j = 0; j < kStageK / 16; ++j) {
      uint32_t a[4];
      LdMatrixX4(a, tile + SwizzledChunkAt(row, 2 * j + (lane >> 4)));
      AddSquares(a);
    }
  }

  // The lane with quad == grp / 2 holds token grp's x.x (gram[0]) and token
  // grp + 8's (gram[1]).
  __device__ void Flush(int grp) {
#pragma unroll
    for (int i = 0; i < kW / 2; ++i) {
      acc[i] += fresh[i];
      fresh[i] = 0.0f;
    }
    const bool odd = grp & 1;
    ss[0] += odd ? gram[0][1] : gram[0][0];
    ss[1] += odd ? gram[1][3] : gram[1][2];
    ZeroFill(gram);
  }

  // Rows of `width` floats at out: the N logits, then the sum of squares;
  // tokens (TokenOfRow) at or past `rows` are none.
  template <bool kPairRows = false>
  __device__ void Store(float* out, int width, int N, int slab, int rows,
                        int grp, int quad) const {
    StoreLogits<kW, kPairRows>(acc, out, width, N, slab, rows, grp, quad);
    if (quad == grp >> 1) {
      const int t = TokenOfRow<kPairRows>(slab + grp);
      const int t8 = TokenOfRow<kPairRows>(slab + grp + 8);
      if (t < rows) out[t * width + N] = ss[0];
      if (t8 < rows) out[t8 * width + N] = ss[1];
    }
  }
};

// A unit's flush groups split over its cluster (geometry.h, the plan's
// unit_ctas): this CTA runs groups [first_group, first_group + per_cta) of
// them, leaves each group's sums (WarpSums::Store after its flush, from zero)
// in a slot of its shared memory, and after a cluster barrier every CTA adds
// a share of the unit's partial rows group by group, in group order, from
// the slots of the CTAs that ran them.
class GroupSlots {
 public:
  // slots: per_cta slots of unit_tokens rows of width floats in this CTA's
  // shared memory.
  __device__ GroupSlots(float* slots, int unit_tokens, int width, int64_t chunk,
                        int unit_ctas)
      : slots_(slots),
        slot_floats_(unit_tokens * width),
        per_cta_(proj::GroupsPerCta(chunk, unit_ctas)),
        ctas_(unit_ctas),
        rank_(static_cast<int>(ClusterCtaRank())) {}

  // This CTA's stages of a unit of `stages` stages, from its first.
  __device__ int FirstStage() const {
    return rank_ * per_cta_ * proj::kFlushStages;
  }
  __device__ int Stages(int stages) const {
    return max(0, min(per_cta_ * proj::kFlushStages, stages - FirstStage()));
  }
  // The slot of this CTA's stage st (counted from FirstStage).
  __device__ float* Slot(int st) const {
    return slots_ + st / proj::kFlushStages * slot_floats_;
  }

  // The unit's rows (`elems` floats at out) from every CTA's slots; every
  // thread of every CTA of the cluster calls it.
  __device__ void AddInOrder(int stages, int elems, float* out) const {
    const int groups = (stages + proj::kFlushStages - 1) / proj::kFlushStages;
    ClusterSync();             // every group's slot written
    constexpr int kBatch = 8;  // peer loads in flight per thread
    const int threads = static_cast<int>(blockDim.x);
    for (int e = rank_ * threads + static_cast<int>(threadIdx.x); e < elems;
         e += ctas_ * threads) {
      float sum = 0.0f;
      // Group g sits in slot g % per_cta_ of rank g / per_cta_: both
      // stepped along with g rather than divided for every load.
      unsigned rank = 0;
      int slot = 0;
      for (int g0 = 0; g0 < groups; g0 += kBatch) {
        float part[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          part[i] = g0 + i < groups
                        ? LoadPeerShared(PeerSharedAddress(
                              slots_ + slot * slot_floats_ + e, rank))
                        : 0.0f;
          if (++slot == per_cta_) {
            slot = 0;
            ++rank;
          }
        }
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          if (g0 + i < groups) sum += part[i];
        }
      }
      out[e] = sum;
    }
    // No CTA leaves while a peer reads its slots; each thread's loads have
    // returned, their sums stored, before it arrives.
    ClusterSyncRelaxed();
  }

 private:
  float* slots_;
  int slot_floats_, per_cta_, ctas_, rank_;
};

// f(terms tag, copy bytes tag) for the layer's precision and the copies x's
// rows take (the plan's x_copy_bytes, not 0).
template <typename F>
cudaError_t ForTermsAndCopies(const LayerSpec& spec, int copy_bytes, F&& f) {
  auto for_copies = [&](auto terms) {
    switch (copy_bytes) {
      case 16:
        return f(terms, IntTag<16>{});
      case 8:
        return f(terms, IntTag<8>{});
      default:
        return f(terms, IntTag<4>{});
    }
  };
  return spec.matmul_precision == MatmulPrecision::kIeee
             ? for_copies(IntTag<Terms(true)>{})
             : for_copies(IntTag<Terms(false)>{});
}

}  // namespace mhc::cuda::bf16_unit

#endif  // MHC_KERNELS_CUDA_PROJECTION_FORWARD_BF16_UNIT_CUH_
