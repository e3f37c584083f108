// Tensor-core projection h = phi' v with the sum of squares. The work is
// split into units: a tile of kMmaTokens tokens times one chunk of K
// (PlanChunks: a function of K and N only) times one group of up to
// kLogitGroup logits. Persistent CTAs take the units in turn (ProjectUnit;
// from an integer counter when there is more than one wave) and write each
// unit's partial sums to workspace; the chunks of a token are then added in
// chunk order by one thread. No floating-point atomics, and a token's h
// depends only on K and N (never on M, the grid, which CTA ran a unit or the
// token's slot in the tile: mma rows are independent dot products). Small units
// keep the GPU evenly loaded at any M (a tile-per-cluster split lost up to half
// a wave to cluster placement).
//
// bf16 layers of one logit group whose rows take 16-, 8- or 4-byte copies
// run projection/forward/wgmma_bf16.cu's warpgroup-mma units (half a tile each)
// over the same chunks and partial layout instead.
//
// Numerics: bf16 x goes to bf16 mmas against a bf16 split of phi'
// (projection/forward/mma_bf16.cuh). fp16 x converts to tf32 exactly. phi' is
// split into a tf32 high part and a tf32 low part; MATMUL_PRECISION_IEEE issues
// both MMAs (error ~2^-21 relative), tf32 only the high one. fp32 x under IEEE
// is split too (hi*hi + lo*hi + hi*lo), under tf32 it is rounded to tf32.
#ifndef MHC_KERNELS_CUDA_PROJECTION_FORWARD_MMA_CUH_
#define MHC_KERNELS_CUDA_PROJECTION_FORWARD_MMA_CUH_

#include <type_traits>
#include <utility>

#include "common.cuh"
#include "mhc/types.h"
#include "primitives/kernel_fit.h"
#include "projection/forward/mma_bf16.cuh"
#include "projection/geometry.h"

namespace mhc::cuda {

inline constexpr int kMmaTokens = proj::kMmaTileTokens;  // tokens per unit
inline constexpr int kMmaThreads = 256;  // fixed: the reduction trees use it
inline constexpr int kMmaBk = 64;        // k per pipeline stage
inline constexpr int kMmaCols = 32;      // logits per tile
inline constexpr int kMmaRow = kMmaBk + 16;    // padded smem row (no conflicts)
inline constexpr int kPartRow = kMmaCols + 1;  // + sum of squares
// The K chunks of a layer (a function of K and N alone, so every token of a
// layer sees the same chunks): the plan's geometry, which sizes the
// workspace from them.
using proj::ChunkPlan;
using proj::kMaxChunks;
using proj::PlanChunks;
static_assert(proj::kMmaBk == kMmaBk, "the plan's stage is the kernels'");

template <typename T>
inline constexpr bool kBf16Mma = std::is_same<T, __nv_bfloat16>::value;

// Pipeline depth. Three stages at two CTAs per SM (16-bit x) measured faster
// than six stages at one CTA per SM: the second CTA hides the per-stage
// barrier and mma latency. The bf16 tiles are small enough for four.
template <typename T>
__host__ __device__ constexpr int MmaStages() {
  return kBf16Mma<T> ? 4 : 3;
}
// Elements per staged x row.
template <typename T>
__host__ __device__ constexpr int MmaRow() {
  return kBf16Mma<T> ? kBf16Row : kMmaRow;
}
template <typename T>
__host__ __device__ constexpr size_t MmaXBytes() {
  return size_t{MmaStages<T>()} * kMmaTokens * MmaRow<T>() * sizeof(T);
}
inline constexpr size_t kMmaPhiBytes = size_t{2} * kMmaCols * kMmaRow * 4;
// phi' stages: tf32 hi and lo rows, or the bf16 fragment planes.
template <typename T>
__host__ __device__ constexpr size_t MmaPhiRegionBytes() {
  return kBf16Mma<T> ? kBf16PhiBytes : 2 * kMmaPhiBytes;
}
template <typename T>
__host__ __device__ constexpr size_t MmaSmemBytes() {
  return MmaXBytes<T>() + MmaPhiRegionBytes<T>();
}
static_assert(size_t{kMmaTokens} * kPartRow * 4 <= MmaXBytes<__nv_bfloat16>(),
              "partials alias the x stages");

__device__ __forceinline__ float RoundTf32(float v) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return __uint_as_float(r);
}

__device__ __forceinline__ void Mma1688(float (&c)[4], const uint32_t (&a)[4],
                                        float b0, float b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, "
      "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(__float_as_uint(b0)),
        "r"(__float_as_uint(b1)));
}

// Asynchronous copy of kBytes (4, 8 or 16; 16 bypasses L1) from global
// into shared memory; !valid zero fills the destination without a read.
template <int kBytes>
__device__ __forceinline__ void CpAsync(void* dst, const void* src,
                                        bool valid) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async sizes");
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const int bytes = valid ? kBytes : 0;
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s),
                 "l"(src), "r"(bytes));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(s),
                 "l"(src), "n"(kBytes), "r"(bytes));
  }
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four consecutive x values of one staged row as floats.
__device__ __forceinline__ void LoadX4(const __nv_bfloat16* p, float (&v)[4]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  v[0] = __uint_as_float(u.x << 16);
  v[1] = __uint_as_float(u.x & 0xffff0000u);
  v[2] = __uint_as_float(u.y << 16);
  v[3] = __uint_as_float(u.y & 0xffff0000u);
}
__device__ __forceinline__ void LoadX4(const __half* p, float (&v)[4]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  v[0] = a.x;
  v[1] = a.y;
  v[2] = b.x;
  v[3] = b.y;
}
__device__ __forceinline__ void LoadX4(const float* p, float (&v)[4]) {
  const float4 u = *reinterpret_cast<const float4*>(p);
  v[0] = u.x;
  v[1] = u.y;
  v[2] = u.z;
  v[3] = u.w;
}

// phi' = phi * gamma (one rounded multiply, as docs/SPEC.md defines it) at k0
// .. k0 + 7 of logit row g; zero past N or kend. vec: 16-byte loads allowed (K
// % 4 == 0, phi and gamma 16-byte aligned).
__device__ __forceinline__ void FetchPhiChunk(const DevSpec& s,
                                              const float* phi,
                                              const float* gamma, int g,
                                              int64_t k0, int64_t kend,
                                              bool vec, float (&v)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = 0.0f;
  if (g >= s.N) return;
  const float* src = phi + g * s.K + k0;
  if (vec && k0 + 8 <= kend) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(src));
    const float4 b = __ldg(reinterpret_cast<const float4*>(src) + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    if (gamma != nullptr) {
      const float4 c = __ldg(reinterpret_cast<const float4*>(gamma + k0));
      const float4 d = __ldg(reinterpret_cast<const float4*>(gamma + k0) + 1);
      const float g8[8] = {c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = __fmul_rn(v[e], g8[e]);
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    if (k0 + e < kend) {
      v[e] = __fmul_rn(src[e], gamma != nullptr ? gamma[k0 + e] : 1.0f);
    }
  }
}

// The partial sums of one unit: tokens m0 .. m0 + kMmaTokens - 1 over k in
// [kbeg, kend). Returns part (in smem) with part[t * kPartRow + g] = h_g (g <
// N) and part[t * kPartRow + kMmaCols] = the sum of squares of token t; the
// caller must __syncthreads() after reading it and before the next unit.
// bf16 x only: phi_split, when given, is phi' already split for every stage
// of K (phi_split_kernel), copied in with x instead of split per tile.
template <typename T, bool kIeee, int kXBytes>
__device__ __forceinline__ const float* ProjectUnit(
    const DevSpec& s, const T* __restrict__ x, const float* __restrict__ phi,
    const float* __restrict__ gamma, const uint32_t* __restrict__ phi_split,
    int64_t tokens, int64_t m0, int64_t kbeg, int64_t kend, bool vec_phi,
    char* smem) {
  constexpr bool ieee = kIeee;
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int t4 = lane & 3;
  const int nkb = static_cast<int>((kend - kbeg + kMmaBk - 1) / kMmaBk);
  const int nj = (s.N + 7) / 8;
  constexpr bool kSplitX = std::is_same<T, float>::value;
  constexpr int kMmaStages = MmaStages<T>();
  constexpr int kPitch = MmaRow<T>();

  T* xs = reinterpret_cast<T*>(smem);
  float* phi_hi = reinterpret_cast<float*>(smem + MmaXBytes<T>());
  float* phi_lo = phi_hi + 2 * kMmaCols * kMmaRow;
  uint32_t* planes = reinterpret_cast<uint32_t*>(phi_hi);
  static_assert(!kBf16Mma<T> || kMmaStages <= kBf16PhiBuffers,
                "a phi' block per x stage");

  // Rows of the unit that hold tokens (the rest are zero filled).
  const int live_rows =
      static_cast<int>(min(static_cast<int64_t>(kMmaTokens), tokens - m0));
  const int span = static_cast<int>(kend - kbeg);
  // The vector copies (kXBytes wide): this thread always takes column vcol
  // of rows vrow + r * kRowStep, so its addresses are set once per unit and
  // a stage only adds its k offset.
  constexpr int kPer = kXBytes > 0 ? kXBytes / static_cast<int>(sizeof(T)) : 1;
  constexpr int kPerRow = kMmaBk / kPer;
  constexpr int kRowStep = kMmaThreads / kPerRow;
  constexpr int kVecRows = kMmaTokens / kRowStep;
  const int vrow = tid / kPerRow;
  const int vcol = (tid % kPerRow) * kPer;
  const T* vsrc = x + (m0 + vrow) * s.K + kbeg + vcol;
  const int64_t row_step = kRowStep * s.K;
  T* const vdst = xs + vrow * kPitch + vcol;
  unsigned live_mask = 0;
#pragma unroll
  for (int r = 0; r < kVecRows; ++r) {
    if (vrow + r * kRowStep < live_rows) live_mask |= 1u << r;
  }
  // phi' pre-split: each stage block is kSplitWords words, 16 bytes a copy.
  constexpr int kSplitWords = kIeee ? kBf16StageWords : kBf16HiMidWords;
  static_assert(kSplitWords % 4 == 0, "16-byte copies");
  const uint32_t* split_src =
      phi_split != nullptr ? phi_split + (kbeg / kMmaBk) * int64_t{kSplitWords}
                           : nullptr;
  auto load_x = [&](int kb) {
    if (kb >= nkb) return;
    const int buf = kb % kMmaStages;
    if (kBf16Mma<T> && phi_split != nullptr) {
      const uint32_t* src = split_src + kb * kSplitWords;
      uint32_t* dst = planes + buf * kBf16StageWords;
#pragma unroll
      for (int w = 0; w < kSplitWords; w += kMmaThreads * 4) {
        if (w + tid * 4 < kSplitWords) {
          CpAsync<16>(dst + w + tid * 4, src + w + tid * 4, true);
        }
      }
    }
    if constexpr (kXBytes > 0) {
      const bool k_ok = kb * kMmaBk + vcol < span;
      const T* src = vsrc + kb * kMmaBk;
      T* d = vdst + buf * kMmaTokens * kPitch;
#pragma unroll
      for (int r = 0; r < kVecRows; ++r) {
        const bool ok = k_ok && ((live_mask >> r) & 1u);
        CpAsync<kXBytes>(d + r * kRowStep * kPitch, ok ? src : x, ok);
        src += row_step;
      }
    } else {
      T* dst = xs + buf * kMmaTokens * kPitch;
      const int64_t k0 = kbeg + static_cast<int64_t>(kb) * kMmaBk;
      for (int c = tid; c < kMmaTokens * kMmaBk; c += kMmaThreads) {
        const int row = c / kMmaBk;
        const int col = c % kMmaBk;
        const int64_t m = m0 + row;
        const int64_t k = k0 + col;
        dst[row * kPitch + col] =
            m < tokens && k < kend ? x[m * s.K + k] : FromFloat<T>(0.0f);
      }
    }
  };

  // phi' for the next stage travels through registers: 8 k of one row per
  // thread, scaled by gamma and split into tf32 hi / lo once per CTA.
  const int prow = tid >> 3;
  const int pk = (tid & 7) * 8;
  float pv[8];
  auto fetch_phi = [&](int kb) {
    if (kb >= nkb) {
      ZeroFill(pv);
      return;
    }
    FetchPhiChunk(s, phi, gamma, prow, kbeg + int64_t{kb} * kMmaBk + pk, kend,
                  vec_phi, pv);
  };
  auto store_phi = [&](int buf) {
    if constexpr (kBf16Mma<T>) {
      Bf16TileMath::StorePhi(pv, prow, pk, ieee,
                             planes + buf * kBf16StageWords);
    } else {
      float* hi = phi_hi + buf * kMmaCols * kMmaRow + prow * kMmaRow + pk;
      float* lo = phi_lo + buf * kMmaCols * kMmaRow + prow * kMmaRow + pk;
#pragma unroll
      for (int e = 0; e < 8; e += 4) {
        float h4[4], l4[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          h4[q] = RoundTf32(pv[e + q]);
          l4[q] = RoundTf32(pv[e + q] - h4[q]);
        }
        *reinterpret_cast<float4*>(hi + e) =
            make_float4(h4[0], h4[1], h4[2], h4[3]);
        *reinterpret_cast<float4*>(lo + e) =
            make_float4(l4[0], l4[1], l4[2], l4[3]);
      }
    }
  };

  float acc[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[j][q] = 0.0f;
  }
  float ss0 = 0.0f, ss1 = 0.0f;

  // The mma's k slots t and t + 4 take physical k 4t + 2u and 4t + 2u + 1
  // (u = 0, 1) for both operands: the same products, one 8-byte load each.
  // Each stage starts the mma accumulators at zero and adds them to acc with
  // a rounded fp32 add: the tensor cores' accumulation truncates against the
  // running sum, which over long K costs more than the 1e-5 IEEE budget.
  Bf16TileMath bf16_math;
  if constexpr (kBf16Mma<T>) bf16_math.Init();
  auto compute = [&](int kb) {
    if constexpr (kBf16Mma<T>) {
      if (bf16_math.token_group * 32 >= live_rows) return;
      const auto* tile = reinterpret_cast<const __nv_bfloat16*>(xs) +
                         (kb % kMmaStages) * kMmaTokens * kPitch;
      const uint32_t* block =
          planes +
          (phi_split != nullptr ? kb % kMmaStages : kb & 1) * kBf16StageWords;
      // Every n = 4 mHC layer has all kBf16Tiles column tiles.
      if (nj == kBf16Tiles) {
        bf16_math.Compute<kBf16Tiles>(tile, block, nj, ieee);
      } else {
        bf16_math.Compute<0>(tile, block, nj, ieee);
      }
      if ((kb & 3) == 3) bf16_math.Flush();
    } else {
      if (warp * 16 >= live_rows) return;
      float st[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int q = 0; q < 4; ++q) st[j][q] = 0.0f;
      }
      const T* xa = xs + (kb % kMmaStages) * kMmaTokens * kMmaRow +
                    (warp * 16 + g) * kMmaRow + 4 * t4;
      const T* xb = xa + 8 * kMmaRow;
      const int buf = kb & 1;
      const float* ph =
          phi_hi + buf * kMmaCols * kMmaRow + g * kMmaRow + 4 * t4;
      const float* pl =
          phi_lo + buf * kMmaCols * kMmaRow + g * kMmaRow + 4 * t4;
#pragma unroll
      for (int kk = 0; kk < kMmaBk; kk += 16) {
        float a[4], b[4];
        LoadX4(xa + kk, a);
        LoadX4(xb + kk, b);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          ss0 = fmaf(a[q], a[q], ss0);
          ss1 = fmaf(b[q], b[q], ss1);
        }
        uint32_t ah[2][4], al[2][4];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const float v[4] = {a[2 * u], b[2 * u], a[2 * u + 1], b[2 * u + 1]};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            if (kSplitX) {
              const float h = RoundTf32(v[q]);
              ah[u][q] = __float_as_uint(h);
              al[u][q] = __float_as_uint(RoundTf32(v[q] - h));
            } else {
              ah[u][q] = __float_as_uint(v[q]);
              al[u][q] = 0u;
            }
          }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (j >= nj) break;
          const float4 bh =
              *reinterpret_cast<const float4*>(ph + j * 8 * kMmaRow + kk);
          Mma1688(st[j], ah[0], bh.x, bh.y);
          Mma1688(st[j], ah[1], bh.z, bh.w);
          if (ieee) {
            const float4 bl =
                *reinterpret_cast<const float4*>(pl + j * 8 * kMmaRow + kk);
            Mma1688(st[j], ah[0], bl.x, bl.y);
            Mma1688(st[j], ah[1], bl.z, bl.w);
            if (kSplitX) {
              Mma1688(st[j], al[0], bh.x, bh.y);
              Mma1688(st[j], al[1], bh.z, bh.w);
            }
          }
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[j][q] += st[j][q];
      }
    }
  };

  // phi' is split here (two buffers, one stage ahead, through registers)
  // unless it arrives pre-split with x.
  const bool split_here = !(kBf16Mma<T> && phi_split != nullptr);
  if (split_here) {
    fetch_phi(0);
    store_phi(0);
  }
#pragma unroll
  for (int st = 0; st < kMmaStages - 1; ++st) {
    load_x(st);
    CpAsyncCommit();
  }
  for (int kb = 0; kb < nkb; ++kb) {
    if (split_here) fetch_phi(kb + 1);
    CpAsyncWait<kMmaStages - 2>();
    __syncthreads();
    load_x(kb + kMmaStages - 1);
    CpAsyncCommit();
    compute(kb);
    if (split_here) store_phi((kb + 1) & 1);
  }
  CpAsyncWait<0>();
  ss0 += __shfl_xor_sync(0xffffffffu, ss0, 1);
  ss0 += __shfl_xor_sync(0xffffffffu, ss0, 2);
  ss1 += __shfl_xor_sync(0xffffffffu, ss1, 1);
  ss1 += __shfl_xor_sync(0xffffffffu, ss1, 2);
  __syncthreads();

  float* part = reinterpret_cast<float*>(smem);
  if constexpr (kBf16Mma<T>) {
    bf16_math.WritePartials(part, kPartRow, kMmaCols, nj);
  } else {
    const int r0 = (warp * 16 + g) * kPartRow;
    const int r1 = r0 + 8 * kPartRow;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j >= nj) break;
      const int col = j * 8 + 2 * t4;
      part[r0 + col] = acc[j][0];
      part[r0 + col + 1] = acc[j][1];
      part[r1 + col] = acc[j][2];
      part[r1 + col + 1] = acc[j][3];
    }
    if (t4 == 0) {
      part[r0 + kMmaCols] = ss0;
      part[r1 + kMmaCols] = ss1;
    }
  }
  __syncthreads();
  return part;
}

__host__ __device__ inline int64_t MmaTiles(int64_t tokens) {
  return (tokens + kMmaTokens - 1) / kMmaTokens;
}

// Chunk partials in workspace: per tile, per chunk, one row of width = N + 1
// floats (h, then the sum of squares) for each of the tile's tokens, so the
// whole is tokens * chunks * width floats. The offset of (tile, chunk):
__host__ __device__ inline int64_t PartialOffset(int64_t tokens, int chunks,
                                                 int width, int64_t tile,
                                                 int chunk) {
  const int64_t m0 = tile * kMmaTokens;
  const int64_t rows = tokens - m0 < kMmaTokens ? tokens - m0 : kMmaTokens;
  return (m0 * chunks + chunk * rows) * width;
}

// Where token m's chunk partials start (chunk 0, column 0) and the distance
// between its chunks; the tokens of one tile are consecutive rows.
struct TokenChunks {
  const float* first;
  int64_t step;
};
__host__ __device__ inline TokenChunks ChunksOf(const float* partial,
                                                int64_t tokens, int chunks,
                                                int width, int64_t m) {
  const int64_t tile = m / kMmaTokens;
  const int64_t at0 = PartialOffset(tokens, chunks, width, tile, 0);
  return TokenChunks{partial + at0 + (m % kMmaTokens) * width,
                     PartialOffset(tokens, chunks, width, tile, 1) - at0};
}

// Element e of a token's row (or of the consecutive rows after it) from its
// ChunksOf, the chunks added in chunk order (at most kLoads <= kMaxChunks:
// one group of loads, every one issued, most predicated off where the chunks
// are fewer).
template <int kLoads = kMaxChunks>
__device__ __forceinline__ float SumChunks(const TokenChunks& rows, int chunks,
                                           int64_t e) {
  static_assert(kLoads <= kMaxChunks, "one group of loads");
  return AddGroup<kLoads>(rows.first + e, rows.step, chunks, 0.0f);
}
// A layer's chunk sums take the fewest SumChunks loads of kFewChunks,
// kHalfChunks or kMaxChunks that cover its chunks: the same adds, fewer
// loads predicated off. f(std::integral_constant<int, kLoads>).
inline constexpr int kFewChunks = 4;
inline constexpr int kHalfChunks = 8;
template <typename F>
decltype(auto) WithChunkLoads(int chunks, F&& f) {
  if (chunks <= kFewChunks) {
    return f(std::integral_constant<int, kFewChunks>{});
  }
  if (chunks <= kHalfChunks) {
    return f(std::integral_constant<int, kHalfChunks>{});
  }
  return f(std::integral_constant<int, kMaxChunks>{});
}

// LaunchPersistentBlocksAfter's `first` when nothing precedes the launch.
struct NoFirstKernel {
  cudaError_t operator()(unsigned long long*) const { return cudaSuccess; }
};

// In a `first` kernel (an ordinary launch, so every earlier kernel is done):
// zeroes the units' counter (null: none) for the units launched after it.
__device__ __forceinline__ void ZeroUnitCounter(unsigned long long* counter) {
  if (counter != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *counter = 0;
}

// Launches CTAs of `threads` that take the units in turn: the co-resident
// count, or with `equal_shares` as many as divide the units into equal
// shares within it, so that no slot idles while others run a last unit (832
// units on 528 slots: 416 CTAs of two, where a full grid leaves most slots
// idle for the second). Equal shares measured faster for the memory-bound
// bf16 warpgroup-mma forward and slower for the compute-bound wide wgmma
// forward at n = 16, which they leave on fewer slots (docs/decisions.md).
// The kernel's last parameter receives
// next_unit when there is more than one wave (zeroed first; the CTAs take
// units from it) and null otherwise (each CTA strides by gridDim.x).
//
// With `first` (a callable that enqueues, as an ordinary launch, the kernel
// this one reads from, given the counter to zero with ZeroUnitCounter or
// null) the counter needs no memset node of its own; without it a memset
// zeroes the counter. Fewer units than SMs launch programmatically
// (LaunchAfterPrevious, common.cuh), each CTA on an SM of its own, beside
// `first`'s last CTAs; more are an ordinary launch after it: launched beside
// it, their CTAs took the slots it left free unevenly over the SMs, and the
// fullest SMs set the kernel's end (docs/decisions.md).
template <typename First, typename... Exp, typename... Act>
cudaError_t LaunchPersistentBlocksAfter(First&& first, void (*kernel)(Exp...),
                                        int threads, bool equal_shares,
                                        int64_t units, size_t smem,
                                        unsigned long long* next_unit,
                                        cudaStream_t stream, Act&&... args) {
  int64_t resident = 0;
  cudaError_t e = FitLargeSmemKernel(reinterpret_cast<const void*>(kernel),
                                     threads, smem, &resident);
  if (e != cudaSuccess) return e;
  const int64_t waves = (units + resident - 1) / resident;
  const int64_t ctas = !equal_shares ? (units < resident ? units : resident)
                       : waves > 0   ? (units + waves - 1) / waves
                                     : 0;
  constexpr bool kAfterFirst =
      !std::is_same<std::decay_t<First>, NoFirstKernel>::value;
  unsigned long long* counter = units > ctas ? next_unit : nullptr;
  if (!kAfterFirst && counter != nullptr) {
    e = cudaMemsetAsync(counter, 0, sizeof(*counter), stream);
    if (e != cudaSuccess) return e;
  }
  e = first(counter);
  if (e != cudaSuccess) return e;
  return LaunchKernelEx(
      kernel, dim3(static_cast<unsigned>(ctas)), dim3(threads), smem, stream,
      /*after_previous=*/kAfterFirst && units < proj::kTunedSms,
      std::forward<Act>(args)..., counter);
}
template <typename... Exp, typename... Act>
cudaError_t LaunchPersistentBlocks(void (*kernel)(Exp...), int threads,
                                   bool equal_shares, int64_t units,
                                   size_t smem, unsigned long long* next_unit,
                                   cudaStream_t stream, Act&&... args) {
  return LaunchPersistentBlocksAfter(NoFirstKernel{}, kernel, threads,
                                     equal_shares, units, smem, next_unit,
                                     stream, std::forward<Act>(args)...);
}
// The co-resident count of CTAs of kMmaThreads.
template <typename... Exp, typename... Act>
cudaError_t LaunchPersistent(void (*kernel)(Exp...), int64_t units, size_t smem,
                             unsigned long long* next_unit, cudaStream_t stream,
                             Act&&... args) {
  return LaunchPersistentBlocks(kernel, kMmaThreads, /*equal_shares=*/false,
                                units, smem, next_unit, stream,
                                std::forward<Act>(args)...);
}

// A unit's place: tile of kMmaTokens tokens, K chunk and logit group (the
// groups of one tile and chunk are consecutive units, so they run side by
// side and share x through L2).
struct MmaUnit {
  int64_t tile;
  int chunk;
  int group;
};
__host__ __device__ inline MmaUnit UnitAt(int64_t u, int groups, int chunks) {
  return MmaUnit{u / groups / chunks, static_cast<int>(u / groups % chunks),
                 static_cast<int>(u % groups)};
}

// Runs body(unit) for each unit a persistent CTA computes: its own stride
// over the units when the launch has no counter, else the counter's next
// value, taken by thread 0 and handed to every thread through shared memory
// and a barrier.
template <typename Body>
__device__ __forceinline__ void ForEachUnit(int64_t units, int groups,
                                            int chunks,
                                            unsigned long long* next_unit,
                                            Body&& body) {
  __shared__ int64_t taken;
  for (int64_t u = blockIdx.x;; u += gridDim.x) {
    if (next_unit != nullptr) {
      if (threadIdx.x == 0)
        taken = static_cast<int64_t>(atomicAdd(next_unit, 1ull));
      __syncthreads();
      u = taken;
    }
    if (u >= units) break;
    body(UnitAt(u, groups, chunks));
  }
}

// Workspace for the counter a launch's CTAs take units from when there are
// more units than CTAs (an integer counter: which CTA computes a unit never
// changes its bits, and a CTA that finishes early takes the next unit).
inline constexpr size_t kUnitCounterBytes = 256;

// A unit covers up to kLogitGroup logits (all of them for n <= 4 layers and
// heads); wider layers (n >= 5) run ceil(N / kLogitGroup) groups of phi rows.
inline constexpr int kLogitGroup = kBf16Tiles * 8;
using proj::LogitGroups;
static_assert(proj::kLogitGroup == kLogitGroup &&
                  proj::kUnitCounterBytes == kUnitCounterBytes,
              "the plan's geometry is the kernels'");

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_FORWARD_MMA_CUH_
