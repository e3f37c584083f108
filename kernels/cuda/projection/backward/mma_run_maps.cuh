// The run-map build of the dx / dphi kernel (mma.cuh, DxRowCopy::kRunMaps):
// how its threads read the rows that its tensor copies landed a few
// elements past 16 bytes (projection/run_maps.h). x is shifted into the
// dense swizzled tile the aligned build uses, so its mma reads and dx
// epilogue are that build's; the terms read dx_next and dy where they
// landed.
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MMA_RUN_MAPS_CUH_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MMA_RUN_MAPS_CUH_

#include <cstddef>
#include <cstdint>

#include "dispatch.cuh"
#include "primitives/tma.cuh"
#include "projection/backward/mma_tiles.cuh"
#include "projection/run_maps.h"

namespace mhc::cuda::dx_mma {

// One tensor copy of a stage: where it lands (bytes from the stage's landed
// rows), its map (bytes from the start of DxRunMaps), the inner coordinate
// of its box and log2 of its map's row group (the box's map row is the
// stage's first token shifted right by it). Each CTA's boxes are the same
// at every stage, so its threads work them out once into a table, from
// which each lane of the issuing warp reads one.
struct RunBox {
  int dst, map, inner, row_shift;
};
inline constexpr int kMaxRunBoxes = 4 * kMaxActGroup * 2 + kMaxDyGroup;
__device__ __forceinline__ int RunBoxCount(int gx, int gy) {
  return 8 * gx + gy;
}
// Box k (< RunBoxCount): x and dx_next of each (stream, residue) pair, then
// dy of each residue. The box starts on the 16 bytes at or before its run.
__device__ __forceinline__ RunBox RunBoxOf(int k, int gx, int gy, int64_t K,
                                           int64_t C, int64_t c0) {
  constexpr int kMap = sizeof(CUtensorMap);
  const bool act = k < 8 * gx;
  const int tensor = act ? k % 2 : 2;  // x, dx_next, dy
  const int group = act ? gx : gy;
  const int stream = act ? k / 2 / gx : 0;
  const int r = act ? k / 2 % gx : k - 8 * gx;
  const int64_t coordinate =
      proj::DxRunCoordinate(group, r, act ? K : C, stream * C + c0);
  RunBox b;
  b.dst =
      tensor * proj::kDxLandTileBytes + proj::DxLandRow(group, stream, r) * 2;
  b.map = (tensor == 0   ? offsetof(DxRunMaps, x)
           : tensor == 1 ? offsetof(DxRunMaps, dx_next)
                         : offsetof(DxRunMaps, dy)) +
          r * kMap;
  b.inner = static_cast<int>(coordinate - proj::DxRunOffset(coordinate));
  b.row_shift = __ffs(group) - 1;
  return b;
}

// Box b of the stage whose first token is m0, into `landed` (the stage's
// landed rows), its bytes completing on bar.
__device__ __forceinline__ void IssueRunBox(const RunBox& b,
                                            const DxRunMaps& maps, char* landed,
                                            int m0, uint64_t* bar) {
  TmaLoadTile2d(landed + b.dst,
                reinterpret_cast<const CUtensorMap*>(
                    reinterpret_cast<const char*>(&maps) + b.map),
                b.inner, m0 >> b.row_shift, bar);
}

// v[0 .. kCount) = w[kFirst .. kFirst + kCount), in the widest loads the
// words' alignment allows (w on 16 bytes).
template <int kFirst, int kCount>
__device__ __forceinline__ void LoadWords(const uint32_t* w, uint32_t* v) {
  if constexpr (kCount > 0) {
    if constexpr (kFirst % 4 == 0 && kCount >= 4) {
      const uint4 u = *reinterpret_cast<const uint4*>(w + kFirst);
      v[0] = u.x;
      v[1] = u.y;
      v[2] = u.z;
      v[3] = u.w;
      LoadWords<kFirst + 4, kCount - 4>(w, v + 4);
    } else if constexpr (kFirst % 2 == 0 && kCount >= 2) {
      const uint2 u = *reinterpret_cast<const uint2*>(w + kFirst);
      v[0] = u.x;
      v[1] = u.y;
      LoadWords<kFirst + 2, kCount - 2>(w, v + 2);
    } else {
      v[0] = w[kFirst];
      LoadWords<kFirst + 1, kCount - 1>(w, v + 1);
    }
  }
}

// The 16-bit elements [kShift, kShift + 8) from `chunk` (on 16 bytes) as
// one aligned 16-byte chunk.
template <int kShift>
__device__ __forceinline__ uint4 ShiftedChunk(const void* chunk) {
  constexpr int kOdd = kShift % 2;
  uint32_t v[5] = {};
  LoadWords<kShift / 2, 4 + kOdd>(static_cast<const uint32_t*>(chunk), v);
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    o[i] = kOdd ? __funnelshift_r(v[i], v[i + 1], 16) : v[i];
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// This thread's share of shifting a stage's landed x into the dense tile:
// two 16-byte chunks of one (stream, residue) pair per warp, whose runs all
// sit `shift` elements past 16 bytes, so each warp takes one branch of
// ShiftRuns and the loads its shift allows.
struct XShift {
  int src[2];  // landed chunk (elements from the landed tile, on 16 bytes)
  int dst[2];  // chunk in the dense tile
  int shift;
};
__device__ __forceinline__ XShift XShiftOf(int warp, int lane, int group,
                                           int64_t K, int64_t C, int64_t c0) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kWc = kCols / 4;
  const int warps_per_pair = kWarps / (4 * group);
  const int pair = warp / warps_per_pair;
  const int stream = pair % 4, residue = pair / 4;
  XShift p;
  p.shift = proj::DxRunOffset(
      proj::DxRunCoordinate(group, residue, K, stream * C + c0));
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    // kStageTokens / group rows of four chunks per pair.
    const int chunk = warp % warps_per_pair * 64 + lane + 32 * k;
    const int token = chunk / 4 * group + residue;
    const int q = chunk % 4;
    p.src[k] = proj::DxLandRow(group, stream, token) + 8 * q;
    p.dst[k] = TileOffset<true, 0>(token, stream * kWc + 8 * q);
  }
  return p;
}

// f(IntTag<v>) for v in [kFirst, 8): a warp-uniform v picks one branch.
template <int kFirst = 0, typename F>
__device__ __forceinline__ void WithShift(int v, F&& f) {
  if constexpr (kFirst < 7) {
    if (v != kFirst) return WithShift<kFirst + 1>(v, f);
  }
  f(IntTag<kFirst>{});
}

template <typename T>
__device__ __forceinline__ void ShiftRuns(const XShift& p, const T* landed,
                                          T* tile) {
  WithShift(p.shift, [&](auto shift_tag) {
    constexpr int kShift = decltype(shift_tag)::value;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      *reinterpret_cast<uint4*>(tile + p.dst[k]) =
          ShiftedChunk<kShift>(landed + p.src[k]);
    }
  });
}

// A warp's dx column j of a stage from the dense tile to rows off 16 bytes,
// by elements: the lane takes its half's rows of every even pair b, b + 1
// (`staged` and `out` at the lane's first row). Rows b and b + 1 share their
// swizzle and sit in opposite halves of the banks, so every row is the
// first plus fixed offsets and no two lanes' reads conflict. rows: the
// stage's tokens from the lane's first row; valid: column j is in C.
template <typename T>
__device__ __forceinline__ void StoreDxElements(const T* staged, int j, T* out,
                                                int64_t K, int rows,
                                                bool valid) {
  constexpr int kWc = kCols / 4;
  const int chunk = j % kWc / 8;
#pragma unroll
  for (int b = 0; b < kStageTokens; b += 2) {
    const int swizzled = ((chunk ^ (b / 2 % 4)) - chunk) * 8;
    if (b < rows && valid) out[b * K] = staged[b * kWc + swizzled];
  }
}

// Four 16-bit elements from element e of a landed tile (on 16 bytes), e
// anywhere: the two or three words around them, shifted by one element
// when e is odd. Never reads past the landed row of element e + 3.
template <typename T>
__device__ __forceinline__ void LoadLandedFour(const T* tile, int e,
                                               float (&v)[4]) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(tile) + (e >> 1);
  const int odd = e & 1;
  const uint32_t a = w[0], b = w[1], c = w[1 + odd];
  const uint32_t lo = __funnelshift_r(a, b, 16 * odd);
  const uint32_t hi = __funnelshift_r(b, c, 16 * odd);
  const float2 l = Unpack(lo, T{}), h = Unpack(hi, T{});
  v[0] = l.x;
  v[1] = l.y;
  v[2] = h.x;
  v[3] = h.y;
}

// Where this thread's run of summed terms (token `row`, channels c .. c + 3)
// landed: in each stream's dx_next rows and in dy's.
struct TermsLanding {
  int dxn[4];
  int dy;
};
__device__ __forceinline__ TermsLanding TermsLandingOf(int row, int c,
                                                       int64_t K, int64_t C,
                                                       int64_t c0) {
  const int gx = proj::DxRowGroup(K), gy = proj::DxRowGroup(C);
  TermsLanding l;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    l.dxn[q] = proj::DxLandRow(gx, q, row) + c +
               proj::DxRunOffset(proj::DxRunCoordinate(gx, row, K, q * C + c0));
  }
  l.dy = proj::DxLandRow(gy, 0, row) + c +
         proj::DxRunOffset(proj::DxRunCoordinate(gy, row, C, c0));
  return l;
}

// SumTokenTerms of stage token `row` from the landed dx_next and dy tiles
// and the stage's runs (hps, rs).
template <typename T>
__device__ __forceinline__ void SumLandedTerms(const TermsLanding& l, int row,
                                               int c, const T* dxn_landed,
                                               const T* dy_landed,
                                               const float* hps,
                                               const float* rs, float* terms) {
  float d[4], g[4][4];
  LoadLandedFour(dy_landed, l.dy, d);
#pragma unroll
  for (int q = 0; q < 4; ++q) LoadLandedFour(dxn_landed, l.dxn[q], g[q]);
  SumTokenTerms(c, d, g, hps + row * 4, rs + row * 16, terms);
}

}  // namespace mhc::cuda::dx_mma

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MMA_RUN_MAPS_CUH_
