// The bf16 math of the projection units (ProjectUnit): x stays bf16
// from HBM to the tensor cores (ldmatrix + mma.m16n8k16), and phi' is split
// into bf16 terms whose products with x are exact in fp32: hi + mid under
// tf32 (16 significant bits, more than tf32's 11) and hi + mid + lo under
// IEEE (24 bits, fp32's own precision). The sum of squares comes from the
// same fragments: mma(x, x^T) puts each token's x.x on the diagonal, exact
// products added in fp32. No per-element conversion of x is left, so the
// tile streams x at a few instructions per 16-byte vector (the tf32 path
// spends ~40).
//
// Work split of a stage (kMmaBk = 64 k of kMmaTokens = 128 tokens): warp w
// takes tokens 32 (w % 4) .. +31 (two 16-token mma rows) and k half w / 4,
// so every phi fragment loaded from shared memory feeds two mma rows. The
// two k halves are added in a fixed order at the end (WritePartials).
#ifndef MHC_KERNELS_CUDA_PROJECTION_FORWARD_MMA_BF16_CUH_
#define MHC_KERNELS_CUDA_PROJECTION_FORWARD_MMA_BF16_CUH_

#include <cuda_bf16.h>

#include <cstdint>

namespace mhc::cuda {

// Padded row of a bf16 x stage: 144 bytes puts the 8 rows of an ldmatrix
// phase on distinct banks.
inline constexpr int kBf16Row = 72;
inline constexpr int kBf16Steps = 4;  // 16-k mma steps per stage
// 8-logit mma columns: 24 logits, the most of any tensor-core layer (n = 4
// mHC: N = 24; heads: N = n <= 16).
inline constexpr int kBf16Tiles = 3;
// phi' of one stage in mma fragment order: a uint4 per (step, column tile,
// lane) holding hi (b0, b1) and mid (b0, b1), then a uint2 per (step, tile,
// lane) with lo (b0, b1), read under IEEE only. Shared memory holds a ring
// of these (as many as x stages); the pre-split copy in workspace
// (ProjectUnit's phi_split) is the same blocks for every stage of K, without
// the lo part unless IEEE (Bf16SplitWords).
inline constexpr int kBf16HiMidWords = kBf16Steps * kBf16Tiles * 32 * 4;
inline constexpr int kBf16LoWords = kBf16Steps * kBf16Tiles * 32 * 2;
inline constexpr int kBf16StageWords = kBf16HiMidWords + kBf16LoWords;
inline constexpr int kBf16PhiBuffers = 4;
inline constexpr size_t kBf16PhiBytes =
    size_t{kBf16PhiBuffers} * kBf16StageWords * 4;
__host__ __device__ inline int Bf16SplitWords(bool ieee) {
  return ieee ? kBf16StageWords : kBf16HiMidWords;
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

__device__ __forceinline__ void Mma16816(float (&c)[4], const uint32_t (&a)[4],
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
      "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as bf16x2 (v0 in the low half: the lower k of an mma pair) and
// what rounding left of each (explicitly rounded: the pre-split and in-tile
// splits must agree bit for bit).
__device__ __forceinline__ uint32_t SplitPair(float& v0, float& v1) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(v0, v1);
  const uint32_t bits = *reinterpret_cast<const uint32_t*>(&h);
  v0 = __fsub_rn(v0, __uint_as_float(bits << 16));
  v1 = __fsub_rn(v1, __uint_as_float(bits & 0xffff0000u));
  return bits;
}

// Per-thread state of one tile, for 2 mma rows (16 tokens each): the
// tensor cores accumulate a few stages into st / gram, which Flush adds to
// acc / ss with rounded fp32 adds (the tensor cores truncate against a long
// running sum, which over long K would cost more than the 1e-5 IEEE budget).
// gram[r][h] is mma(x, x^T) against tokens 8h .. 8h + 7 of row r: the lane
// with t4 == g / 2 holds token g's x.x (h = 0) and token g + 8's (h = 1).
struct Bf16TileMath {
  int lane, token_group, k_half;
  float acc[2][kBf16Tiles][4];
  float st[2][kBf16Tiles][4];
  float gram[2][2][4];
  float ss[2][2];

  __device__ void Init() {
    const int warp = threadIdx.x >> 5;
    lane = threadIdx.x & 31;
    token_group = warp & 3;
    k_half = warp >> 2;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int j = 0; j < kBf16Tiles; ++j) {
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[r][j][q] = st[r][j][q] = 0.0f;
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) gram[r][0][q] = gram[r][1][q] = 0.0f;
      ss[r][0] = ss[r][1] = 0.0f;
    }
  }

  __device__ void Flush() {
    const int diag = (lane >> 2) & 1;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int j = 0; j < kBf16Tiles; ++j) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          acc[r][j][q] += st[r][j][q];
          st[r][j][q] = 0.0f;
        }
      }
      ss[r][0] += diag ? gram[r][0][1] : gram[r][0][0];
      ss[r][1] += diag ? gram[r][1][3] : gram[r][1][2];
#pragma unroll
      for (int q = 0; q < 4; ++q) gram[r][0][q] = gram[r][1][q] = 0.0f;
    }
  }

  // Stores phi' of row prow, stage k pk .. pk + 7 (pk a multiple of 8) into
  // the stage block's fragment order: b0 of lane 4 g + t takes k 2t, 2t + 1
  // of row g of its column tile, b1 the same k + 8.
  __device__ static void StorePhi(const float (&pv)[8], int prow, int pk,
                                  bool ieee, uint32_t* stage) {
    const int tile = prow >> 3;
    if (tile >= kBf16Tiles) return;  // rows past every layer's N
    const int step = pk >> 4;
    const int half = (pk >> 3) & 1;
    const int slot = (step * kBf16Tiles + tile) * 32 + (prow & 7) * 4;
    uint32_t* hi_mid = stage + slot * 4 + half;
    uint32_t* lo = stage + kBf16HiMidWords + slot * 2 + half;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float v0 = pv[2 * e], v1 = pv[2 * e + 1];
      hi_mid[e * 4] = SplitPair(v0, v1);
      hi_mid[e * 4 + 2] = SplitPair(v0, v1);
      if (ieee) lo[e * 2] = SplitPair(v0, v1);
    }
  }

  // One stage: xs is the stage's [kMmaTokens][kBf16Row] bf16 tile, stage
  // its phi' block. kTiles > 0 fixes the column tile count at compile time
  // (no per-tile branches between the mmas); 0 takes `tiles`.
  template <int kTiles>
  __device__ void Compute(const __nv_bfloat16* xs, const uint32_t* stage,
                          int tiles, bool ieee) {
    if constexpr (kTiles > 0) tiles = kTiles;
    // ldmatrix.x4 rows: lanes 0-15 give rows 0-15 at k 0, lanes 16-31 the
    // same rows at k 8, so a[0..3] come out in mma A order.
    const __nv_bfloat16* base = xs +
                                (token_group * 32 + (lane & 15)) * kBf16Row +
                                k_half * 32 + (lane >> 4) * 8;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      uint32_t a[2][4];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        LdMatrixX4(a[r], base + r * 16 * kBf16Row + s * 16);
        // As B operands the same registers are x^T: tokens 0-7 in a[0],
        // a[2], tokens 8-15 in a[1], a[3].
        Mma16816(gram[r][0], a[r], a[r][0], a[r][2]);
        Mma16816(gram[r][1], a[r], a[r][1], a[r][3]);
      }
      const int slot = (k_half * 2 + s) * kBf16Tiles * 32 + lane;
      const uint4* hi_mid = reinterpret_cast<const uint4*>(stage) + slot;
      const uint2* lo =
          reinterpret_cast<const uint2*>(stage + kBf16HiMidWords) + slot;
      // Term-major order: the 2 x tiles mmas of one term are independent, so
      // a term's mma never waits on the one just issued.
      uint4 b[kBf16Tiles];
      uint2 c[kBf16Tiles];
#pragma unroll
      for (int j = 0; j < kBf16Tiles; ++j) {
        if (j >= tiles) break;
        b[j] = hi_mid[j * 32];
        if (ieee) c[j] = lo[j * 32];
      }
#pragma unroll
      for (int j = 0; j < kBf16Tiles; ++j) {
        if (j >= tiles) break;
#pragma unroll
        for (int r = 0; r < 2; ++r) Mma16816(st[r][j], a[r], b[j].x, b[j].y);
      }
#pragma unroll
      for (int j = 0; j < kBf16Tiles; ++j) {
        if (j >= tiles) break;
#pragma unroll
        for (int r = 0; r < 2; ++r) Mma16816(st[r][j], a[r], b[j].z, b[j].w);
      }
      if (ieee) {
#pragma unroll
        for (int j = 0; j < kBf16Tiles; ++j) {
          if (j >= tiles) break;
#pragma unroll
          for (int r = 0; r < 2; ++r) Mma16816(st[r][j], a[r], c[j].x, c[j].y);
        }
      }
    }
  }

  // part[token * row + col] = h partial (col < 8 tiles), part[token * row +
  // ss_col] = sum of squares: k half 1 writes, then k half 0 adds its own.
  // part aliases the x stages: the caller has drained them.
  __device__ void WritePartials(float* part, int row, int ss_col, int tiles) {
    const int g = lane >> 2;
    const int t4 = lane & 3;
    Flush();
    for (int pass = 1; pass >= 0; --pass) {
      if (k_half == pass) {
        // Half 0 adds to what half 1 left; half 1 never reads (stale smem).
        auto put = [pass](float* p, float v) { *p = pass == 0 ? v + *p : v; };
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float* p0 = part + (token_group * 32 + r * 16 + g) * row;
          float* p1 = p0 + 8 * row;
#pragma unroll
          for (int j = 0; j < kBf16Tiles; ++j) {
            if (j >= tiles) break;
            const int col = j * 8 + 2 * t4;
            put(p0 + col, acc[r][j][0]);
            put(p0 + col + 1, acc[r][j][1]);
            put(p1 + col, acc[r][j][2]);
            put(p1 + col + 1, acc[r][j][3]);
          }
          if (t4 == g >> 1) {
            put(p0 + ss_col, ss[r][0]);
            put(p1 + ss_col, ss[r][1]);
          }
        }
      }
      __syncthreads();
    }
  }
};

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_FORWARD_MMA_BF16_CUH_
