// Per-stage steps of the tensor-core dx / dphi kernel
// (projection/backward/mma.cuh) that read and write only what they are
// handed: a stage's runs of per-token floats, its dh rounded into the
// fragment layouts, the dphi products over its staged x, the generic
// layout's terms of an output pair, and the CTA's dphi partials at the end.
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MMA_STAGE_CUH_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MMA_STAGE_CUH_

#include <cstdint>

#include "common.cuh"
#include "projection/backward/mma_tiles.cuh"
#include "projection/forward/mma.cuh"

namespace mhc::cuda::dx_mma {

// A stage's run of `width` floats per token (dh, dms, H_pre, R rows) into
// dst: the rows of its tokens from m0, zero past them; thread `first`
// takes the first copy. runs16: base and its rows sit on 16 bytes.
__device__ __forceinline__ void LoadStageRun(float* dst, const float* base,
                                             int width, int64_t m0, int rows,
                                             int tid, int first, bool runs16) {
  const float* src = base + m0 * width;
  const int total = kStageTokens * width;  // a multiple of 4
  const int valid = rows * width;
  const int run_tid = (tid - first) & (kThreads - 1);
  if (runs16) {
    for (int v = 4 * run_tid; v < total; v += 4 * kThreads) {
      const int left = valid - v;
      if (left >= 4 || left <= 0) {
        CpAsync<16>(dst + v, left > 0 ? src + v : base, left > 0);
      } else {
        // The tensor may end inside this vector: no read past it.
        for (int e = 0; e < 4; ++e) {
          CpAsync<4>(dst + v + e, e < left ? src + v + e : base, e < left);
        }
      }
    }
  } else {
    for (int v = run_tid; v < total; v += kThreads) {
      CpAsync<4>(dst + v, v < valid ? src + v : base, v < valid);
    }
  }
}

// Rounds a landed stage's dh rows (raw, `logits` floats per token) into the
// fragments of dh_a (the dx product's A, with_dx) and dh_b (the dphi
// product's B, with_dphi), zero past the logits up to NT tiles, one
// fragment per thread; under IEEE each array's low parts follow its high
// parts.
template <int NT, bool kIeee>
__device__ __forceinline__ void ConvertDhFragments(const float* raw, int logits,
                                                   float* dh_a, float* dh_b,
                                                   int tid, bool with_dx,
                                                   bool with_dphi) {
  constexpr int kDhAFloats = DhAFloats(NT), kDhBFloats = DhBFloats(NT);
  auto at = [&](int t, int g) {
    return g < logits ? raw[t * logits + g] : 0.0f;
  };
  auto put = [&](float* dst, int floats, int f, const auto& v) {
    constexpr int V = sizeof(v) / sizeof(float);
    float hi[V];
    [[maybe_unused]] float lo[V];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      uint32_t h, l;
      SplitTf32<kIeee>(v[e], h, l);
      hi[e] = __uint_as_float(h);
      if constexpr (kIeee) lo[e] = __uint_as_float(l);
    }
    StoreVec<float, V>(dst + f * V, hi);
    if constexpr (kIeee) StoreVec<float, V>(dst + floats + f * V, lo);
  };
  constexpr int kAFrags = kDhAFloats / 4, kBFrags = kDhBFloats / 2;
#pragma unroll
  for (int f0 = 0; f0 < kAFrags; f0 += kThreads) {
    const int f = f0 + tid;
    if (f >= kAFrags || !with_dx) break;
    const int fl = f & 31, tile = f >> 5;  // tile = NT mt + kt
    const int t = tile / NT * 16 + (fl >> 2);
    const int g = tile % NT * 8 + (fl & 3);
    const float v[4] = {at(t, g), at(t + 8, g), at(t, g + 4), at(t + 8, g + 4)};
    put(dh_a, kDhAFloats, f, v);
  }
  const int b_tid = (tid - FirstThread::kDhB) & (kThreads - 1);
#pragma unroll
  for (int f0 = 0; f0 < kBFrags; f0 += kThreads) {
    const int f = f0 + b_tid;
    if (f >= kBFrags || !with_dphi) break;
    const int fl = f & 31, tile = f >> 5;  // tile = NT (2 half + step) + nt
    const int t = tile / NT * 8 + 2 * (fl & 3);
    const int g = tile % NT * 8 + (fl >> 2);
    const float v[2] = {at(t, g), at(t + 1, g)};
    put(dh_b, kDhBFloats, f, v);
  }
}

// dphi^T += x^T dh over one stage for the warp's columns j0 .. j0 + 15 of
// the staged x tile xt (swizzled with kTma, else rows of RS elements), the
// logit tiles in passes of up to kDphiGroupTiles (one pass up to 24
// logits), each in fresh registers added into dphi; the first pass loads
// the x fragments of each 16-token half just before its products, later
// passes reuse them.
template <typename T, int NT, bool kIeee, bool kTma, int RS>
__device__ __forceinline__ void StageDphiProducts(const T* xt,
                                                  const float* dh_b, int lane,
                                                  int j0,
                                                  float (&dphi)[NT][4]) {
  // dphi tiles per pass: all of them up to 24 logits.
  constexpr int kAccTiles = NT <= 3 ? NT : kDphiGroupTiles;
  static_assert(NT % kAccTiles == 0, "passes cover the tiles");
  constexpr bool kSplitX = kIeee && sizeof(T) == 4;
  constexpr int kRowElems = kTma ? kCols / 4 : RS;
  constexpr int kDhBFloats = DhBFloats(NT);
  // A fragments per 16-token half and k step: [half][step][slot].
  uint32_t xa[2][2][4];
  [[maybe_unused]] uint32_t xl[2][2][4];
  auto load_x = [&](int half) {
    if constexpr (kTma) {
      const int mat = lane >> 3;
      LoadXTransposedAt(xt +
                            TileOffset<kTma, RS>((mat >> 1) * 8 + (lane & 7),
                                                 j0 + (mat & 1) * 8) +
                            half * 16 * kRowElems,
                        xa[half]);
    } else {
      LoadXTransposed<kSplitX>(lane, xt, RS, half * 16, j0, xa[half], xl[half]);
    }
  };
#pragma unroll
  for (int t0 = 0; t0 < NT; t0 += kAccTiles) {
    float acc[kAccTiles][4];
#pragma unroll
    for (int nt = 0; nt < kAccTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
    }
#pragma unroll
    for (int half = 0; half < kStageTokens / 16; ++half) {
      if (t0 == 0) load_x(half);
#pragma unroll
      for (int step = 0; step < 2; ++step) {
        // Tokens 2 quad and 2 quad + 1 of this k step, logit 8 nt + grp.
        const float* d = dh_b + ((half * 2 + step) * NT + t0) * 64 + 2 * lane;
#pragma unroll
        for (int nt = 0; nt < kAccTiles; ++nt) {
          const float2 b = *reinterpret_cast<const float2*>(d + 64 * nt);
          Mma1688(acc[nt], xa[half][step], b.x, b.y);
          if constexpr (kIeee) {
            const float2 bl =
                *reinterpret_cast<const float2*>(d + kDhBFloats + 64 * nt);
            Mma1688(acc[nt], xa[half][step], bl.x, bl.y);
          }
          if constexpr (kSplitX) Mma1688(acc[nt], xl[half][step], b.x, b.y);
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < kAccTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dphi[t0 + nt][e] += acc[nt][e];
    }
  }
}

// The terms of output pair j, j + 1 of one staged row in any layout, the
// flags read at run time: H_pre dy, then R dx_next over the source streams
// in order (the per-layout AddTerms' sums). dxn_row, dy_row, hp_row and
// r_rows (the row's n x n R) are its staged rows.
template <typename T>
__device__ __forceinline__ void AddGenericTerms(
    const DevSpec& s, int log_n, int64_t c0, int j, const T* dxn_row,
    const T* dy_row, const float* hp_row, const float* r_rows, bool residual,
    float (&out)[2]) {
  const int n = s.n;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const Column col = ColumnOf(s, log_n, c0, j + e);
    float acc = hp_row[col.stream] * ToFloat(dy_row[col.chan]);
    if (residual) {
      const float* r_row = r_rows + col.stream * n;
      for (int i = 0; i < n; ++i) {
        acc = fmaf(r_row[i],
                   ToFloat(dxn_row[TileColumn(s, log_n, i, col.chan)]), acc);
      }
    }
    out[e] += acc;
  }
}

// The warp's dphi^T fragments into the CTA's partial rows: columns j0 +
// grp (+8) of K, logits 8 nt + 2 quad (+1); columns past K and logits past
// N are left out.
template <int NT>
__device__ __forceinline__ void StoreDphiPartial(const DevSpec& s, int log_n,
                                                 int64_t c0, int j0, int lane,
                                                 const float (&dphi)[NT][4],
                                                 float* partial) {
  const int grp = lane >> 2, quad = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const Column col = ColumnOf(s, log_n, c0, j0 + grp + 8 * h);
    if (col.k < 0) continue;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int g = 8 * nt + 2 * quad + e;
        if (g < s.N) partial[g * s.K + col.k] = dphi[nt][2 * h + e];
      }
    }
  }
}

}  // namespace mhc::cuda::dx_mma

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MMA_STAGE_CUH_
