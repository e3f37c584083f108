// Post forward and backward on the tensor cores, for bf16 activations in the
// stream-major layout at n = 3 and 5..16: there the FFMA kernels of post.cu
// spend n^2 + n multiply-adds per channel in each direction, more time than
// the memory takes (docs/decisions.md).
//
// A warp takes 32 channels of a token per step: lane (g, t) (g = lane / 4,
// t = lane % 4) loads channels [c + 8t, c + 8t + 8) of stream rows g and
// g + 8 with one 16-byte access each, and its four 32-bit words are the
// mma operands as loaded:
//  - sums over channels (dH_res = X G^T) take channels as the mma k, the
//    order of which no sum over all channels sees;
//  - sums over streams (x_next = R^T X, dx = R G, df = G^T h_post) need the
//    streams as k: movmatrix transposes each 8 x 8 block in registers, and
//    the output lands back in the lane that loaded its channels, ready for a
//    16-byte store.
// R and H_post enter as two bf16 terms (hi + lo, 16 significant bits), whose
// products with bf16 activations are exact in fp32: the split costs ~2^-17
// relative, far below the 2^-8 of rounding the outputs to bf16. H_post
// (f + bias) and dH_post = G (f + bias) stay fp32 multiply-adds.
// Determinism / batch invariance: one CTA per token; every sum runs in a
// fixed order (mma steps per warp, then warps and lanes in order through
// shared memory), independent of M and of the other tokens.
#include <cuda_bf16.h>

#include "common.cuh"
#include "dispatch.cuh"
#include "launch.h"
#include "post_mixing.cuh"
#include "projection/forward/mma_bf16.cuh"

namespace mhc::cuda {
namespace {

using Bf16 = __nv_bfloat16;

inline constexpr int kPostMmaWarps = 4;
inline constexpr int kPostMmaThreads = kPostMmaWarps * 32;
inline constexpr int kWarpChannels = 32;  // channels per warp step

__device__ __forceinline__ uint32_t TransposeBlock(uint32_t v) {
  uint32_t r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(v));
  return r;
}

// Word-level bf16 packing and unpacking: LoadVec / StoreVec of common.cuh
// in its place measured slower here (docs/decisions.md).
__device__ __forceinline__ float LowHalf(uint32_t w) {
  return __uint_as_float(w << 16);
}
__device__ __forceinline__ float HighHalf(uint32_t w) {
  return __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Lane (g, t) of a warp step at channel c: the lane's eight channels of
// stream rows g + 8h (h < NT / 8) as four bf16x2 words each, zero past n or C.
template <int NT>
struct StepRows {
  uint32_t w[NT / 8][4];
};
template <int NT>
__device__ __forceinline__ void LoadRows(const Bf16* token_row, int64_t C,
                                         int n, int g, int64_t c,
                                         StepRows<NT>& rows) {
#pragma unroll
  for (int h = 0; h < NT / 8; ++h) {
    const int i = g + 8 * h;
    uint4 u = make_uint4(0u, 0u, 0u, 0u);
    if (i < n && c < C)
      u = *reinterpret_cast<const uint4*>(token_row + i * C + c);
    rows.w[h][0] = u.x;
    rows.w[h][1] = u.y;
    rows.w[h][2] = u.z;
    rows.w[h][3] = u.w;
  }
}

// Output rows g + 8h of the lane's eight channels from the four 8-channel
// mma tiles of a step (tile q holds channels 8t + 2q, 8t + 2q + 1 of rows g
// and g + 8 in d[q][0..1] and d[q][2..3]).
template <int NT>
__device__ __forceinline__ void StoreRows(Bf16* token_row, int64_t C, int n,
                                          int g, int64_t c,
                                          const float (&d)[4][4]) {
  if (c >= C) return;
#pragma unroll
  for (int h = 0; h < NT / 8; ++h) {
    const int i = g + 8 * h;
    if (i >= n) continue;
    uint4 u;
    u.x = PackBf16(d[0][2 * h], d[0][2 * h + 1]);
    u.y = PackBf16(d[1][2 * h], d[1][2 * h + 1]);
    u.z = PackBf16(d[2][2 * h], d[2][2 * h + 1]);
    u.w = PackBf16(d[3][2 * h], d[3][2 * h + 1]);
    *reinterpret_cast<uint4*>(token_row + i * C + c) = u;
  }
}

// The A operand of out[r][ch] = sum_k A[r][k] rows[k][ch] for a 16 x NT
// fp32 matrix value(r, k), split in bf16 hi + lo: one mma k-step per term at
// NT = 16; at NT = 8 one step holds both (k slots 0-7 hi, 8-15 lo, the B
// operand repeating the 8 rows).
template <int NT>
struct MixOperand {
  uint32_t a[NT / 8][4];
};
template <int NT, typename Value>
__device__ __forceinline__ MixOperand<NT> SplitOperand(Value value, int g,
                                                       int t) {
  MixOperand<NT> op;
#pragma unroll
  for (int e = 0; e < (NT == 16 ? 4 : 2); ++e) {
    const int row = g + 8 * (e & 1);
    const int col = 2 * t + 8 * (e >> 1);
    float v0 = value(row, col);
    float v1 = value(row, col + 1);
    const uint32_t hi = SplitPair(v0, v1);
    const uint32_t lo = SplitPair(v0, v1);
    if constexpr (NT == 16) {
      op.a[0][e] = hi;
      op.a[1][e] = lo;
    } else {
      op.a[0][e] = hi;
      op.a[0][e + 2] = lo;
    }
  }
  return op;
}

// d (one 8-channel tile) += A rows over the streams; b[h] is the transposed
// block of stream rows 8h .. 8h + 7.
template <int NT>
__device__ __forceinline__ void MixTile(float (&d)[4], const MixOperand<NT>& op,
                                        const uint32_t (&b)[NT / 8]) {
  if constexpr (NT == 16) {
    Mma16816(d, op.a[0], b[0], b[1]);
    Mma16816(d, op.a[1], b[0], b[1]);
  } else {
    Mma16816(d, op.a[0], b[0], b[0]);
  }
}

// The transposed blocks of tile q (word q of every row group).
template <int NT>
__device__ __forceinline__ void TransposedTile(const StepRows<NT>& rows, int q,
                                               uint32_t (&b)[NT / 8]) {
#pragma unroll
  for (int h = 0; h < NT / 8; ++h) b[h] = TransposeBlock(rows.w[h][q]);
}

// f + bias at the lane's eight channels.
__device__ __forceinline__ void LoadFPlusBias(const Bf16* f_row,
                                              const float* bias, int64_t C,
                                              int64_t c, float (&fb)[8]) {
  uint4 u = make_uint4(0u, 0u, 0u, 0u);
  if (c < C) u = *reinterpret_cast<const uint4*>(f_row + c);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    fb[2 * q] = LowHalf(w[q]);
    fb[2 * q + 1] = HighHalf(w[q]);
  }
  if (bias != nullptr && c < C) {
    const float4 b0 = *reinterpret_cast<const float4*>(bias + c);
    const float4 b1 = *reinterpret_cast<const float4*>(bias + c + 4);
    fb[0] += b0.x;
    fb[1] += b0.y;
    fb[2] += b0.z;
    fb[3] += b0.w;
    fb[4] += b1.x;
    fb[5] += b1.y;
    fb[6] += b1.z;
    fb[7] += b1.w;
  }
}

// The warp's steps of a token row: load(c, loaded) fills a Loaded for the
// lane's channels from c (zero past C), step(c, loaded) consumes it. With
// kPrefetch the next step's loads are issued before the current step's
// math, so the warp keeps two steps in flight: the backward gains at
// n <= 8, where a step moves a few hundred bytes; the forward, whose step
// ends in as many stores, loses (docs/decisions.md).
template <typename Loaded, bool kPrefetch, typename Load, typename Step>
__device__ __forceinline__ void ForEachWarpStep(int64_t C, int warp, int t,
                                                Load load, Step step) {
  constexpr int64_t kStride = kPostMmaWarps * kWarpChannels;
  const int64_t first = int64_t{warp} * kWarpChannels;
  if constexpr (kPrefetch) {
    Loaded current;
    load(first + 8 * t, current);
    for (int64_t c0 = first; c0 < C; c0 += kStride) {
      const int64_t c = c0 + 8 * t;
      Loaded next;
      load(c + kStride, next);
      step(c, current);
      current = next;
    }
  } else {
    for (int64_t c0 = first; c0 < C; c0 += kStride) {
      const int64_t c = c0 + 8 * t;
      Loaded current;
      load(c, current);
      step(c, current);
    }
  }
}

template <int NT>
__global__ void __launch_bounds__(kPostMmaThreads)
    post_forward_mma_kernel(DevSpec s, const Bf16* f, const Bf16* x,
                            const float* h_post, const float* h_res,
                            const float* bias, Bf16* x_next) {
  WaitForPrerequisiteGrid();  // f, x and the mixing
  const int n = s.n;
  const int64_t m = blockIdx.x;
  const int warp = threadIdx.x >> 5;
  const int g = (threadIdx.x & 31) >> 2;
  const int t = threadIdx.x & 3;
  __shared__ float mix[kMixingSlots<NT>];
  PostMixing<NT, kPostMmaThreads> mixing;
  FetchMixing<NT>(mixing, s, n, h_post, h_res, m);
  mixing.Publish(mix);
  const float* r = mix;
  const float* hp = mix + NT * NT;
  // x_next[j] = sum_i R[i][j] x[i]: A[j][i] = R[i][j].
  const MixOperand<NT> rt = SplitOperand<NT>(
      [&](int j, int i) { return j < NT ? r[i * NT + j] : 0.0f; }, g, t);
  const float hp_g = hp[g];
  const float hp_g8 = NT == 16 ? hp[g + 8] : 0.0f;
  const Bf16* x_row = x + m * s.K;
  const Bf16* f_row = f + m * s.C;
  Bf16* out_row = x_next + m * s.K;
  struct Loaded {
    StepRows<NT> x;
    float fb[8];
  };
  ForEachWarpStep<Loaded, /*kPrefetch=*/false>(
      s.C, warp, t,
      [&](int64_t c, Loaded& l) {
        LoadRows<NT>(x_row, s.C, n, g, c, l.x);
        LoadFPlusBias(f_row, bias, s.C, c, l.fb);
      },
      [&](int64_t c, const Loaded& l) {
        float d[4][4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          d[q][0] = hp_g * l.fb[2 * q];
          d[q][1] = hp_g * l.fb[2 * q + 1];
          d[q][2] = hp_g8 * l.fb[2 * q];
          d[q][3] = hp_g8 * l.fb[2 * q + 1];
          uint32_t b[NT / 8];
          TransposedTile<NT>(l.x, q, b);
          MixTile<NT>(d[q], rt, b);
        }
        StoreRows<NT>(out_row, s.C, n, g, c, d);
      });
}

// Per-lane sums of the backward: dR[i][j] for i = g + 8 (v / 2 % 2),
// j = 8 (v / 4) + 2t + v % 2 at slot v < 4 NT / 8, then dH_post[g + 8h]
// over the lane's channels at slot 4 NT / 8 + h.
template <int NT>
inline constexpr int kLaneSums = 5 * (NT / 8);

template <int NT>
__global__ void __launch_bounds__(kPostMmaThreads)
    post_backward_mma_kernel(DevSpec s, const Bf16* dx_next, const Bf16* f,
                             const Bf16* x, const float* h_post,
                             const float* h_res, const float* bias, Bf16* df,
                             Bf16* dx, float* dh_post, float* dh_res) {
  WaitForPrerequisiteGrid();  // dx_next, f, x and the mixing
  constexpr int H = NT / 8;
  const int n = s.n;
  const int64_t m = blockIdx.x;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  __shared__ float mix[kMixingSlots<NT>];
  __shared__ float part[kPostMmaWarps][kLaneSums<NT>][32];
  PostMixing<NT, kPostMmaThreads> mixing;
  FetchMixing<NT>(mixing, s, n, h_post, h_res, m);
  mixing.Publish(mix);
  const float* r = mix;
  const float* hp = mix + NT * NT;
  // dx[i] = sum_j R[i][j] g[j]; df = sum_j H_post[j] g[j] rides in row 8
  // of the same mma at NT = 8 and has its own at NT = 16 (row 0).
  const MixOperand<NT> rg = SplitOperand<NT>(
      [&](int i, int j) {
        if (i < NT) return r[i * NT + j];
        return i == 8 ? hp[j] : 0.0f;
      },
      g, t);
  MixOperand<NT> hg{};
  if constexpr (NT == 16) {
    hg = SplitOperand<NT>([&](int i, int j) { return i == 0 ? hp[j] : 0.0f; },
                          g, t);
  }
  float acc[kLaneSums<NT>];
#pragma unroll
  for (int v = 0; v < kLaneSums<NT>; ++v) acc[v] = 0.0f;
  const Bf16* g_row = dx_next + m * s.K;
  const Bf16* x_row = x + m * s.K;
  const Bf16* f_row = f + m * s.C;
  struct Loaded {
    StepRows<NT> g, x;
    float fb[8];
  };
  ForEachWarpStep<Loaded, /*kPrefetch=*/true>(
      s.C, warp, t,
      [&](int64_t c, Loaded& l) {
        LoadRows<NT>(g_row, s.C, n, g, c, l.g);
        LoadRows<NT>(x_row, s.C, n, g, c, l.x);
        LoadFPlusBias(f_row, bias, s.C, c, l.fb);
      },
      [&](int64_t c, const Loaded& l) {
  // dR = X G^T over this step's channels (k slots: word 2k and 2k + 1 of
  // the lane's rows), added to the lane's sums with rounded fp32 adds.
#pragma unroll
        for (int jt = 0; jt < H; ++jt) {
          float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            const uint32_t a[4] = {
                l.x.w[0][2 * k], H == 2 ? l.x.w[H - 1][2 * k] : 0u,
                l.x.w[0][2 * k + 1], H == 2 ? l.x.w[H - 1][2 * k + 1] : 0u};
            Mma16816(d, a, l.g.w[jt][2 * k], l.g.w[jt][2 * k + 1]);
          }
#pragma unroll
          for (int v = 0; v < 4; ++v) acc[4 * jt + v] += d[v];
        }
#pragma unroll
        for (int h = 0; h < H; ++h) {
          float sum = 0.0f;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            sum = fmaf(LowHalf(l.g.w[h][q]), l.fb[2 * q], sum);
            sum = fmaf(HighHalf(l.g.w[h][q]), l.fb[2 * q + 1], sum);
          }
          acc[4 * H + h] += sum;
        }
        float dxv[4][4], dfv[4][4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          uint32_t b[H];
          TransposedTile<NT>(l.g, q, b);
#pragma unroll
          for (int v = 0; v < 4; ++v) dxv[q][v] = dfv[q][v] = 0.0f;
          MixTile<NT>(dxv[q], rg, b);
          if constexpr (NT == 16) MixTile<NT>(dfv[q], hg, b);
        }
        if (dx != nullptr) StoreRows<NT>(dx + m * s.K, s.C, n, g, c, dxv);
        // df is row 0 of its tiles at NT = 16 and row 8 of dx's at NT = 8,
        // both in the lanes with g == 0.
        if (g == 0 && c < s.C) {
          const int e = NT == 16 ? 0 : 2;
          const float(&src)[4][4] = NT == 16 ? dfv : dxv;
          uint4 u;
          u.x = PackBf16(src[0][e], src[0][e + 1]);
          u.y = PackBf16(src[1][e], src[1][e + 1]);
          u.z = PackBf16(src[2][e], src[2][e + 1]);
          u.w = PackBf16(src[3][e], src[3][e + 1]);
          *reinterpret_cast<uint4*>(df + m * s.C + c) = u;
        }
      });
#pragma unroll
  for (int v = 0; v < kLaneSums<NT>; ++v) part[warp][v][lane] = acc[v];
  __syncthreads();
  for (int o = threadIdx.x; o < n * n + n; o += kPostMmaThreads) {
    float sum = 0.0f;
    if (o < n * n) {
      const int i = o / n;
      const int j = o % n;
      const int from = (i % 8) * 4 + (j % 8) / 2;
      const int v = 4 * (j / 8) + 2 * (i / 8) + j % 2;
      for (int w = 0; w < kPostMmaWarps; ++w) sum += part[w][v][from];
      // dH_res is the gradient of H_res itself: transpose back for
      // DEST_ROWS.
      dh_res[m * n * n + (s.dest_rows ? j * n + i : i * n + j)] = sum;
    } else {
      const int j = o - n * n;
      const int v = 4 * H + j / 8;
      for (int w = 0; w < kPostMmaWarps; ++w) {
        for (int lt = 0; lt < 4; ++lt) sum += part[w][v][(j % 8) * 4 + lt];
      }
      dh_post[m * n + j] = sum;
    }
  }
}

template <typename F>
void DispatchPostMma(int n, F&& f) {
  if (n <= 8) {
    f(IntTag<8>{});
  } else {
    f(IntTag<16>{});
  }
}

}  // namespace

absl::Status LaunchPostForwardMma(const PostForwardParams& p,
                                  cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*p.spec);
  const float* bias = s.has_bias ? p.weights.bias : nullptr;
  cudaError_t err = cudaSuccess;
  DispatchPostMma(s.n, [&](auto nt) {
    err = LaunchAfterPrevious(post_forward_mma_kernel<decltype(nt)::value>,
                              dim3(GridSize(p.tokens)), dim3(kPostMmaThreads),
                              0, stream, s, static_cast<const Bf16*>(p.f),
                              static_cast<const Bf16*>(p.x), p.h_post, p.h_res,
                              bias, static_cast<Bf16*>(p.x_next));
  });
  MHC_CUDA_RETURN_IF_ERROR(err, "post forward",
                           LaunchShape(*p.spec, p.tokens, p.act_dtype));
  MHC_CUDA_CHECK_LAUNCH("post forward",
                        LaunchShape(*p.spec, p.tokens, p.act_dtype));
  return absl::OkStatus();
}

absl::Status LaunchPostBackwardMma(const PostBackwardParams& p,
                                   cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*p.spec);
  const float* bias = s.has_bias ? p.weights.bias : nullptr;
  cudaError_t err = cudaSuccess;
  DispatchPostMma(s.n, [&](auto nt) {
    err = LaunchAfterPrevious(post_backward_mma_kernel<decltype(nt)::value>,
                              dim3(GridSize(p.tokens)), dim3(kPostMmaThreads),
                              0, stream, s, static_cast<const Bf16*>(p.dx_next),
                              static_cast<const Bf16*>(p.f),
                              static_cast<const Bf16*>(p.x), p.h_post, p.h_res,
                              bias, static_cast<Bf16*>(p.df),
                              static_cast<Bf16*>(p.dx), p.dh_post, p.dh_res);
  });
  MHC_CUDA_RETURN_IF_ERROR(err, "post backward",
                           LaunchShape(*p.spec, p.tokens, p.act_dtype));
  MHC_CUDA_CHECK_LAUNCH("post backward",
                        LaunchShape(*p.spec, p.tokens, p.act_dtype));
  return absl::OkStatus();
}

}  // namespace mhc::cuda
