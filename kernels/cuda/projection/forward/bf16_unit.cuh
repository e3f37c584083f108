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

#include <algorithm>
#include <cstdint>

#include "common.cuh"
#include "dispatch.cuh"
#include "mhc/types.h"
#include "primitives/cluster.cuh"
#include "primitives/tma.cuh"
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

// How a launch splits each unit's flush groups over a cluster (geometry.h,
// the plan's unit_ctas): worked out on the host, so that no CTA divides by a
// run-time value between its wait and its first copy.
struct GroupSplit {
  int ctas;        // a cluster's CTAs
  int per_cta;     // proj::GroupsPerCta of the chunk
  int owner_rows;  // unit rows each CTA adds up: a multiple of 4, so that a
                   // CTA's rows span a multiple of 16 bytes (bulk copies)

  static GroupSplit Of(const ChunkPlan& plan, int unit_ctas) {
    const int rows = (proj::kBf16UnitTokens + unit_ctas - 1) / unit_ctas;
    return GroupSplit{unit_ctas, proj::GroupsPerCta(plan.chunk, unit_ctas),
                      (rows + 3) / 4 * 4};
  }
  // Shared memory past the ring, in rows of `width` floats: per_cta - 1
  // slots of a whole unit's rows (a CTA's last group's sums sit in the
  // ring), then the inbox, owner_rows rows for each group that the CTA with
  // the fewest groups of a unit of K's chunks (the last one shorter) did not
  // run.
  static size_t Bytes(const ChunkPlan& plan, int64_t K, int unit_ctas,
                      int width) {
    const GroupSplit split = Of(plan, unit_ctas);
    const int full = proj::FlushGroups(plan.chunk);
    const int last = proj::FlushGroups(K - (plan.chunks - 1) * plan.chunk);
    const int inbox =
        std::max(full - split.FewestOwn(full), last - split.FewestOwn(last));
    return sizeof(float) * width *
           ((split.per_cta - 1) * proj::kBf16UnitTokens +
            inbox * split.owner_rows);
  }
  // The groups the last CTA of a unit of `groups` groups runs.
  int FewestOwn(int groups) const {
    return std::min(per_cta, std::max(0, groups - (ctas - 1) * per_cta));
  }
};

// A unit's flush groups split over its cluster: CTA r runs groups
// [r per_cta, (r + 1) per_cta) and owns unit rows [r owner_rows, (r + 1)
// owner_rows). After each group's flush the CTA stores the group's sums
// (from zero) of every row in a slot of its own, and one thread sends every
// other CTA its rows of the slot by a bulk copy into that CTA's inbox,
// counted in bytes on its mbarrier. Each CTA then waits for its inbox to
// hold every group it did not run, adds the groups of its rows in group
// order (its own from its slots) and writes them to the partial. A CTA
// waits only for the groups of its own rows, and the cluster barrier at the
// end only keeps every CTA's slots alive until their copies have landed.
// The adds and their order are those of one CTA per unit: the same bits.
class GroupInbox {
 public:
  // extra: GroupSplit::Bytes of shared memory; bar: this CTA's inbox
  // mbarrier.
  __device__ GroupInbox(float* extra, uint64_t* bar, int width,
                        GroupSplit split)
      : slots_(extra),
        inbox_(extra + (split.per_cta - 1) * proj::kBf16UnitTokens * width),
        bar_(bar),
        width_(width),
        split_(split),
        rank_(static_cast<int>(ClusterCtaRank())) {}

  // By one thread, before the CTA barrier after which Start runs.
  __device__ void Init() const {
    MbarrierInit(bar_, 1);
    FenceMbarrierInit();
  }
  // Every thread, once the CTA barrier after Init has passed. Peers copy
  // into this CTA only after the whole cluster has started.
  __device__ void Start() const { ClusterArriveRelaxed(); }
  // One thread: the bytes this CTA's rows receive from a unit of `stages`
  // stages.
  __device__ void Expect(int stages) const {
    const int others = Groups(stages) - Groups(Stages(stages));
    MbarrierArriveExpectBytes(
        bar_,
        static_cast<uint32_t>(others * RowsOf(rank_) * width_ * sizeof(float)));
  }
  // Every thread, after Start and before the first Send: the cluster's
  // CTAs have started.
  __device__ void Open() const { ClusterWait(); }

  // This CTA's stages of a unit of `stages` stages, from its first.
  __device__ int FirstStage() const {
    return rank_ * split_.per_cta * proj::kFlushStages;
  }
  __device__ int Stages(int stages) const {
    return max(0,
               min(split_.per_cta * proj::kFlushStages, stages - FirstStage()));
  }

  // Every thread, after its flush of this CTA's stage st (counted from
  // FirstStage): the group's sums of every row of the unit (rows past the
  // tokens hold zeros) to the CTA's slot, then their owners' rows to them.
  // The last group's slot is ring_slot, a slot of the ring that no warp
  // reads once the last stage has begun: the previous stage's, which the
  // barrier at the start of the last stage freed; with one stage, none, so
  // the sums wait for every warp to finish it.
  template <int kW>
  __device__ void Send(const WarpSums<kW>& sums, int st, bool last,
                       float* ring_slot, int N, int slab, int grp,
                       int quad) const {
    const int local = st / proj::kFlushStages;  // of this CTA's groups
    if (last && st == 0) __syncthreads();
    float* slot = last ? ring_slot : Slot(local);
    sums.Store(slot, width_, N, slab, proj::kBf16UnitTokens, grp, quad);
    FenceProxyAsyncShared();  // the slot, for the copies' proxy
    __syncthreads();
    if (threadIdx.x != 0) return;
    const int group = FirstGroup() + local;
    for (int r = 0; r < split_.ctas; ++r) {
      const int rows = RowsOf(r);
      if (r == rank_ || rows <= 0) continue;
      // Peer r's inbox leaves out its own groups: per_cta of them where a
      // group follows them.
      const int at =
          group < r * split_.per_cta ? group : group - split_.per_cta;
      CopyToPeerShared(
          PeerSharedAddress(inbox_ + at * split_.owner_rows * width_, r),
          slot + r * split_.owner_rows * width_,
          static_cast<uint32_t>(rows * width_ * sizeof(float)),
          PeerSharedAddress(bar_, r));
    }
  }

  // Every thread: once every other group's rows have landed here, this
  // CTA's rows that are tokens (of the unit's `rows`) added in group order
  // into out, the unit's partial rows (ring_slot: Send's).
  __device__ void AddInOrder(int stages, int rows, const float* ring_slot,
                             float* out) const {
    MbarrierWait(bar_, 0);
    // Every copy into this CTA has landed; it may leave once every peer's
    // has, which the wait below learns.
    ClusterArriveRelaxed();
    const int groups = Groups(stages);
    const int own = Groups(Stages(stages));
    const int first_own = FirstGroup();
    const int first = rank_ * split_.owner_rows;
    const int elems = min(RowsOf(rank_), rows - first) * width_;
    const int inbox_slot = split_.owner_rows * width_;
    const float* mine = slots_ + first * width_;
    const float* mine_last = ring_slot + first * width_;
    const int mine_stride = proj::kBf16UnitTokens * width_;
    for (int e = static_cast<int>(threadIdx.x); e < elems;
         e += static_cast<int>(blockDim.x)) {
      // Three runs of groups in group order: those before this CTA's, its
      // own, those after; each a loop of independent loads.
      float sum = 0.0f;
      for (int g = 0; g < min(first_own, groups); ++g) {
        sum += inbox_[g * inbox_slot + e];
      }
      for (int j = 0; j + 1 < own; ++j) sum += mine[j * mine_stride + e];
      if (own > 0) sum += mine_last[e];
      for (int g = first_own + own; g < groups; ++g) {
        sum += inbox_[(g - own) * inbox_slot + e];
      }
      out[first * width_ + e] = sum;
    }
    // No CTA leaves while a copy out of its slots is in flight.
    ClusterWait();
  }

 private:
  __device__ static int Groups(int stages) {
    return (stages + proj::kFlushStages - 1) / proj::kFlushStages;
  }
  __device__ int FirstGroup() const { return rank_ * split_.per_cta; }
  // The unit rows CTA r owns (none past the unit).
  __device__ int RowsOf(int r) const {
    return max(0, min(split_.owner_rows,
                      proj::kBf16UnitTokens - r * split_.owner_rows));
  }
  // The slot of this CTA's group `local` (counted from its first) but its
  // last.
  __device__ float* Slot(int local) const {
    return slots_ + local * proj::kBf16UnitTokens * width_;
  }

  float* slots_;
  float* inbox_;
  uint64_t* bar_;
  int width_;
  GroupSplit split_;
  int rank_;
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
