// Scale (logits and gates) forward and backward, plus the fixed-order
// token reductions that turn per-token contributions into parameter
// gradients. Determinism / batch invariance: every per-token output comes
// from code that sees that token alone, in a fixed order; dalpha / dbeta
// (and every other parameter gradient built from per-token rows) are summed
// over fixed groups of tokens in a fixed order (the scale backward at n != 4:
// warps of 32 by an xor tree, then chunks of warp rows in order), then over
// the groups in order, never with float atomics.
//
// n = 4 (the production case) has its own kernels. The step is elementwise
// over (token, logit) but for the per-token dms sum, and every group
// boundary (4, 8) of the N = 24 logits (N = 4 for heads) falls on a multiple
// of 4, so thread (token, quarter c) owns logits 4c .. 4c + 3, all of one
// group: h, dh, the gates and the H_res logits each move as one 16-byte
// access per thread and consecutive threads touch consecutive bytes. (A
// thread per token touched 24 scattered 4-byte words of h and dh per token:
// one L1 wavefront / L2 request each, which was most of the time.) The
// backward is one launch: each block sums its kScaleTile tokens' dalpha /
// dbeta rows in token order into a partial row, and the last block to finish
// (an integer arrival counter, reset by that block) adds the partial rows in
// block order. Unaligned pointers take the same code with scalar accesses,
// so alignment never changes a bit. The scale plan (plans/scale.h) says
// which kernel runs.
#include "common.cuh"
#include "dispatch.cuh"
#include "launch.h"
#include "mix.cuh"
#include "overflow_repair.cuh"
#include "overflow_repair.h"
#include "primitives/grid_arrival.cuh"

namespace mhc::cuda {
namespace {

constexpr int kTokenThreads = 64;
constexpr int kMaxAlpha = 3;  // gate groups: pre, post, H_res

// Token m's gates and logits to their rows.
template <int NT>
__device__ __forceinline__ void StoreScaleToken(
    const DevSpec& s, int64_t m, const float (&hp)[NT], const float (&hq)[NT],
    const float (&a)[NT * NT], float* h_pre, float* h_post, float* logits) {
  const int n = StreamCount<NT>(s);
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    if (i >= n) break;
    h_pre[m * n + i] = hp[i];
  }
  if (s.head) return;
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    if (i >= n) break;
    h_post[m * n + i] = hq[i];
  }
#pragma unroll
  for (int e = 0; e < NT * NT; ++e) {
    if (e >= n * n) break;
    logits[m * n * n + e] = a[e];
  }
}

// A flagged token (overflow_repair.cuh): its gates and logits from the
// scaled float64 recompute, then its kept projection unscaled (the forward)
// or its scaled projection for the scale backward (the backward's rows), and
// its flag; from the fp32 values when x is not finite. Out of line and last
// in the kernel, so the common path keeps its registers.
template <int NT>
__device__ __noinline__ void RepairedScaleForward(
    const DevSpec& s, int64_t m, const float* h, float ms,
    const ScaleRepair& repair, const float* alpha, const float* beta,
    float* h_pre, float* h_post, float* logits) {
  float h_s[NT * NT + 2 * NT];
  float ms_s = 0.0f;
  const int flag = RepairProjection(s, repair.src, m, h_s, &ms_s);
  if (repair.rows.flag != nullptr) repair.rows.flag[m] = flag;
  float hp[NT], hq[NT], a[NT * NT];
  if (flag == 0) {  // x is not finite: the fp32 values carry it
    ScaleForwardToken<NT>(s, h, ms, alpha, beta, hp, hq, a);
    StoreScaleToken<NT>(s, m, hp, hq, a, h_pre, h_post, logits);
    return;
  }
  const int e = flag - kRepairFlagBias;
  ScaleForwardToken<NT>(ScaledSpec(s, e), h_s, ms_s, alpha, beta, hp, hq, a);
  StoreScaleToken<NT>(s, m, hp, hq, a, h_pre, h_post, logits);
  if (repair.kept_h != nullptr) {
    StoreUnscaled(s, e, h_s, ms_s, repair.kept_h + m * s.N, repair.kept_ms + m);
  }
  if (repair.rows.scaled != nullptr) {
    float* row = repair.rows.scaled + m * (s.N + 1);
    for (int g = 0; g < s.N; ++g) row[g] = h_s[g];
    row[s.N] = ms_s;
  }
}

// `repair` is on (x given) for the dynamic layers of the fused ops alone.
template <int NT>
__global__ void __launch_bounds__(kTokenThreads)
    scale_forward_kernel(DevSpec s, int64_t tokens, const float* h,
                         const float* mean_square, const float* alpha,
                         const float* beta, float* h_pre, float* h_post,
                         float* logits, ScaleRepair repair) {
  WaitForPrerequisiteGrid();  // h and the mean square
  const int64_t m = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (m >= tokens) return;
  float hp[NT], hq[NT], a[NT * NT];
  const float* h_row = s.dynamic ? h + m * s.N : nullptr;
  const float ms = s.dynamic ? mean_square[m] : 0.0f;
  if (repair.src.x != nullptr && NeedsRepair(s, h_row, ms)) {
    RepairedScaleForward<NT>(s, m, h_row, ms, repair, alpha, beta, h_pre,
                             h_post, logits);
    return;
  }
  if (repair.rows.flag != nullptr) repair.rows.flag[m] = 0;
  ScaleForwardToken<NT>(s, h_row, ms, alpha, beta, hp, hq, a);
  StoreScaleToken<NT>(s, m, hp, hq, a, h_pre, h_post, logits);
}

// One thread per token; the contributions of each warp's 32 tokens (lanes
// past M add zeros) are summed by a fixed xor tree into one row per warp
// (warp_rows: [WarpRows(M)][width]), which LaunchColumnSum then adds in
// order like per-token rows: rows per warp rather than per token keep the
// scratch near 1 % of the op's tensors.
int64_t WarpRows(int64_t tokens) { return (tokens + 31) / 32; }

// A repaired token of the fused backward, whose scaled projection the scale
// forward left in `rows`: its reverse mode from the scaled values, its
// scaled dh and dms to `rows` for the repair pass and zeros to the dx
// kernel's rows (as RepairedBackwardMix in fused_pre_backward_mix.cu); from
// the fp32 values when x is not finite (flag 0). Out of line, as the
// forward's.
template <int NT>
__device__ __noinline__ void RepairedScaleBackward(
    const DevSpec& s, int64_t m, const float* h, float ms,
    const RepairRows& rows, const float* alpha, const float* beta,
    const float* dh_pre, const float* dh_post, const float* dlogits, float* dh,
    float* dmean_square, float* contrib) {
  const int flag = rows.flag[m];
  const int n = StreamCount<NT>(s);
  float da[NT * NT];
#pragma unroll
  for (int e = 0; e < NT * NT; ++e) {
    da[e] = (!s.head && e < n * n) ? dlogits[m * n * n + e] : 0.0f;
  }
  const float* up = s.head ? nullptr : dh_post + m * n;
  if (flag == 0) {
    ScaleBackwardToken<NT>(s, h, ms, alpha, beta, dh_pre + m * n, up, da,
                           dh + m * s.N, dmean_square + m, contrib);
    return;
  }
  float* row = rows.scaled + m * (s.N + 1);
  float h_s[NT * NT + 2 * NT];
  for (int g = 0; g < s.N; ++g) h_s[g] = row[g];
  const float ms_s = row[s.N];
  ScaleBackwardToken<NT>(ScaledSpec(s, flag - kRepairFlagBias), h_s, ms_s,
                         alpha, beta, dh_pre + m * n, up, da, dh + m * s.N,
                         dmean_square + m, contrib);
  for (int g = 0; g < s.N; ++g) {
    row[g] = dh[m * s.N + g];
    dh[m * s.N + g] = 0.0f;
  }
  row[s.N] = dmean_square[m];
  dmean_square[m] = 0.0f;
  atomicAdd(rows.count, 1);  // an integer count: order does not matter
}

// The scale op alone sees h and the mean square, not x, so it repairs
// nothing; but dms = ms_dot dr/dms with dr/dms about ms^-1.5 leaves fp32's
// normal range past ms near 1.9e25 (near 8e29 it is 0) while dms itself,
// about ms_dot / ms^1.5 with ms_dot of order sqrt(ms), is a normal float.
// A token whose mean square is finite and above kRepairMeanSquare (the
// fused ops repair such tokens from x) runs in the repair's scaled form
// instead: h_s = h 2^-e, ms_s = ms 2^-2e, eps_rms scaled (ScaledSpec), so
// r_s = r 2^e exactly, h_s r_s = h r, and the gates, dz and dalpha terms
// are the unscaled path's bits (unless h_g 2^-e falls below fp32's normal
// range, where its terms are far below the others); dh = dh_s 2^-e and
// dms = dms_s 2^-2e.
__device__ __forceinline__ bool ScaledScaleToken(const DevSpec& s, float ms) {
  return s.dynamic && ms > kRepairMeanSquare && isfinite(ms);
}

// Such a token's reverse mode in the generic kernel. Out of line, as the
// repaired token's.
template <int NT>
__device__ __noinline__ void ScaledScaleBackward(
    const DevSpec& s, int64_t m, const float* h, float ms, const float* alpha,
    const float* beta, const float* dh_pre, const float* dh_post,
    const float* dlogits, float* dh, float* dmean_square, float* contrib) {
  const int n = StreamCount<NT>(s);
  float da[NT * NT];
#pragma unroll
  for (int e = 0; e < NT * NT; ++e) {
    da[e] = (!s.head && e < n * n) ? dlogits[m * n * n + e] : 0.0f;
  }
  const int e = RepairExponent(ms);
  float h_s[NT * NT + 2 * NT];
  for (int g = 0; g < s.N; ++g) h_s[g] = ldexpf(h[g], -e);
  float* dh_row = dh + m * s.N;
  ScaleBackwardToken<NT>(ScaledSpec(s, e), h_s, ldexpf(ms, -2 * e), alpha, beta,
                         dh_pre + m * n, s.head ? nullptr : dh_post + m * n, da,
                         dh_row, dmean_square + m, contrib);
  for (int g = 0; g < s.N; ++g) dh_row[g] = ldexpf(dh_row[g], -e);
  dmean_square[m] = ldexpf(dmean_square[m], -2 * e);
}

// Such a token's dms in the n = 4 kernel, from ms_dot (the sum over h): the
// scaled form's ms_dot_s = ms_dot 2^-e times dr_s/dms_s, then 2^-2e.
__device__ __noinline__ float ScaledRmsGrad(const DevSpec& s, float ms,
                                            float ms_dot) {
  const int e = RepairExponent(ms);
  const DevSpec scaled = ScaledSpec(s, e);
  const float ms_s = ldexpf(ms, -2 * e);
  const float dr = RmsDerivative(scaled, ms_s, RmsFactor(scaled, ms_s));
  return ldexpf(ldexpf(ms_dot, -e) * dr, -2 * e);
}

// `repair.rows` is given for the dynamic layers of the fused backward alone;
// without it (the scale op alone) a token ScaledScaleToken picks runs in
// the scaled form.
template <int NT>
__global__ void __launch_bounds__(kTokenThreads)
    scale_backward_kernel(DevSpec s, int64_t tokens, const float* h,
                          const float* mean_square, const float* alpha,
                          const float* beta, const float* dh_pre,
                          const float* dh_post, const float* dlogits, float* dh,
                          float* dmean_square, float* warp_rows,
                          ScaleRepair repair) {
  WaitForPrerequisiteGrid();  // the upstream gradients
  static_assert(kTokenThreads % 32 == 0, "whole warps");
  const int64_t m = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if ((m & ~int64_t{31}) >= tokens) return;  // the whole warp is past M
  const int n = StreamCount<NT>(s);
  const int width = s.N + s.num_alpha;
  float contrib[NT * NT + 2 * NT + kMaxAlpha];
  const bool live = m < tokens;
  const float* h_row = s.dynamic && live ? h + m * s.N : nullptr;
  const float ms = s.dynamic && live ? mean_square[m] : 0.0f;
  if (!live) {
    for (int g = 0; g < width; ++g) contrib[g] = 0.0f;
  } else if (repair.rows.flag != nullptr && NeedsRepair(s, h_row, ms)) {
    RepairedScaleBackward<NT>(s, m, h_row, ms, repair.rows, alpha, beta, dh_pre,
                              dh_post, dlogits, dh, dmean_square, contrib);
  } else if (repair.rows.flag == nullptr && ScaledScaleToken(s, ms)) {
    ScaledScaleBackward<NT>(s, m, h_row, ms, alpha, beta, dh_pre, dh_post,
                            dlogits, dh, dmean_square, contrib);
  } else {
    float da[NT * NT];
#pragma unroll
    for (int e = 0; e < NT * NT; ++e) {
      da[e] = (!s.head && e < n * n) ? dlogits[m * n * n + e] : 0.0f;
    }
    ScaleBackwardToken<NT>(s, h_row, ms, alpha, beta, dh_pre + m * n,
                           s.head ? nullptr : dh_post + m * n, da,
                           s.dynamic ? dh + m * s.N : nullptr,
                           s.dynamic ? dmean_square + m : nullptr, contrib);
  }
  if (warp_rows == nullptr) return;
  const int lane = threadIdx.x & 31;
  float* row = warp_rows + (m >> 5) * width;
  for (int g = 0; g < width; ++g) {
    float sum = contrib[g];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    if (lane == (g & 31)) row[g] = sum;
  }
}

// ---------------------------------------------------------------- n = 4 --

constexpr int kScale4Threads = 256;  // forward block
constexpr int kScaleTile = 128;      // backward: tokens per block / partial
constexpr int kScaleRuns = 16;       // runs of kScaleTile / kScaleRuns tokens
constexpr int kScaleBatch = 16;      // partial rows in flight per thread

// Logit quarter c of a token: 0 the pre gates, 1 the post gates, 2..5 H_res.
__device__ __forceinline__ int QuarterGroup(int c) { return c < 2 ? c : 2; }

template <bool kVec>
__device__ __forceinline__ void Load4(const float* p, float (&v)[4]) {
  if (kVec) {
    const float4 q = __ldg(reinterpret_cast<const float4*>(p));
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = p[k];
  }
}

// Quarter c of token m's logits (zeros for static layers) and its RMS
// factor (0 for static layers).
template <int kN, bool kVec>
__device__ __forceinline__ float LoadQuarter(const DevSpec& s, const float* h,
                                             const float* mean_square,
                                             int64_t m, int c, float (&hv)[4]) {
  hv[0] = hv[1] = hv[2] = hv[3] = 0.0f;
  if (!s.dynamic) return 0.0f;
  Load4<kVec>(h + m * kN + 4 * c, hv);
  return RmsFactor(s, mean_square[m]);
}

template <bool kVec>
__device__ __forceinline__ void Store4(float* p, const float (&v)[4]) {
  if (kVec) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) p[k] = v[k];
  }
}

// A token's dalpha of gate group p (0 pre, 1 post, 2 H_res) from its
// quarters' terms, added in quarter order. Straight-line code: a loop bounded
// by p kept the H_res column's shared loads one after another, the longest
// chain of the block's partial row.
template <int kQuarters>
__device__ __forceinline__ float GroupDalpha(
    const float (&quarter)[kQuarters + 1], int p) {
  if constexpr (kQuarters == 1) {
    return quarter[0];  // HEAD: one group
  } else {
    if (p < 2) return quarter[p];
    float v = quarter[2];
#pragma unroll
    for (int g = 3; g < kQuarters; ++g) v += quarter[g];
    return v;
  }
}

// kQuarters = N / 4: 6 for kMhc, 1 for kHead. The gate / logit expressions
// are ScaleForwardToken's (mix.cuh), element by element.
template <int kQuarters, bool kVec>
__global__ void __launch_bounds__(kScale4Threads)
    scale4_forward_kernel(DevSpec s, int64_t tokens, const float* h,
                          const float* mean_square, const float* alpha,
                          const float* beta, float* h_pre, float* h_post,
                          float* logits) {
  WaitForPrerequisiteGrid();  // h and the mean square
  constexpr int kN = 4 * kQuarters;
  const int64_t e =
      static_cast<int64_t>(blockIdx.x) * kScale4Threads + threadIdx.x;
  const int64_t m = e / kQuarters;
  const int c = static_cast<int>(e % kQuarters);
  if (m >= tokens) return;
  const int group = QuarterGroup(c);
  float hv[4];
  const float r = LoadQuarter<kN, kVec>(s, h, mean_square, m, c, hv);
  float out[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float z = beta[4 * c + k];
    if (s.dynamic) z += alpha[group] * hv[k] * r;
    out[k] = group == 0   ? Sigmoid(z) + s.eps_pre
             : group == 1 ? s.post_mult * Sigmoid(z)
                          : z;
  }
  float* dst = group == 0   ? h_pre + m * 4
               : group == 1 ? h_post + m * 4
                            : logits + m * 16 + 4 * (c - 2);
  Store4<kVec>(dst, out);
}

// One block per kScaleTile tokens, thread (token t, quarter c). Per token: dz
// as ScaleBackwardToken computes it, dh, and dms = (sum over quarters in order
// of the quarter's dz alpha h sum) dr/dms, in the scaled form for a token
// ScaledScaleToken picks (ScaledRmsGrad; its dz and dh are the same bits either
// way). With partial != null also the parameter gradients: the block's partial
// row (dbeta[N], dalpha[num alpha]) is its tokens' sum as kScaleRuns runs of
// consecutive tokens, each in token order, then the runs in order; the last
// block adds the partial rows into grad_beta / grad_alpha in block order
// (kSplit interleaved strands per column, then the strands in order). Both
// orders depend on M alone.
template <int kQuarters, bool kVec>
__global__ void __launch_bounds__(kScaleTile* kQuarters, kQuarters == 1 ? 4 : 2)
    scale4_backward_kernel(DevSpec s, int64_t tokens, const float* h,
                           const float* mean_square, const float* alpha,
                           const float* beta, const float* dh_pre,
                           const float* dh_post, const float* dlogits,
                           float* dh, float* dmean_square, float* partial,
                           unsigned* arrivals, float* grad_beta,
                           float* grad_alpha) {
  WaitForPrerequisiteGrid();  // the upstream gradients
  constexpr int kThreads = kScaleTile * kQuarters;
  constexpr int kN = 4 * kQuarters;
  constexpr int kAlpha = kQuarters == 1 ? 1 : 3;
  constexpr int kWidth = kN + kAlpha;
  constexpr int kSplit = kThreads / kWidth;
  static_assert(kWidth * kScaleRuns <= kThreads, "one thread per run");
  // Odd row strides keep the column walks below free of bank conflicts.
  __shared__ float dz_s[kScaleTile][kN + 1];
  __shared__ float dalpha_s[kScaleTile][kQuarters + 1];
  __shared__ float msdot_s[kScaleTile][kQuarters + 1];
  __shared__ float runs[kWidth][kScaleRuns + 1];
  __shared__ float strands[kSplit][kWidth];

  const int t = threadIdx.x / kQuarters, c = threadIdx.x % kQuarters;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kScaleTile;
  const int64_t m = m0 + t;
  const int group = QuarterGroup(c);
  // The gradient this thread adds to if its block comes last, read now so
  // that the last block's tail does not wait on it.
  float* grad = nullptr;
  if (partial != nullptr && threadIdx.x < kWidth) {
    const int w = threadIdx.x;
    grad = w < kN ? (grad_beta != nullptr ? grad_beta + w : nullptr)
                  : (grad_alpha != nullptr ? grad_alpha + (w - kN) : nullptr);
  }
  const float grad_before = grad != nullptr ? *grad : 0.0f;
  float dz[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float dalpha = 0.0f, ms_dot = 0.0f;
  if (m < tokens) {
    float hv[4];
    const float r = LoadQuarter<kN, kVec>(s, h, mean_square, m, c, hv);
    float up[4];
    Load4<kVec>(group == 0   ? dh_pre + m * 4
                : group == 1 ? dh_post + m * 4
                             : dlogits + m * 16 + 4 * (c - 2),
                up);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (group == 2) {
        dz[k] = up[k];
        continue;
      }
      float z = beta[4 * c + k];
      if (s.dynamic) z += alpha[group] * hv[k] * r;
      const float sg = Sigmoid(z);
      const float gate = sg * (1.0f - sg);
      dz[k] = group == 0 ? up[k] * gate : up[k] * s.post_mult * gate;
    }
    if (s.dynamic) {
      const float al = alpha[group];
      float dhv[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        dalpha += dz[k] * hv[k] * r;
        dhv[k] = al * dz[k] * r;
        ms_dot += dz[k] * al * hv[k];
      }
      Store4<kVec>(dh + m * kN + 4 * c, dhv);
    }
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) dz_s[t][4 * c + k] = dz[k];
  dalpha_s[t][c] = dalpha;
  msdot_s[t][c] = ms_dot;
  __syncthreads();

  if (s.dynamic && threadIdx.x < kScaleTile) {
    const int u = threadIdx.x;
    const int64_t mu = m0 + u;
    if (mu < tokens) {
      float sum = 0.0f;
#pragma unroll
      for (int q = 0; q < kQuarters; ++q) sum += msdot_s[u][q];
      const float ms = mean_square[mu];
      dmean_square[mu] = ScaledScaleToken(s, ms)
                             ? ScaledRmsGrad(s, ms, sum)
                             : sum * RmsDerivative(s, ms, RmsFactor(s, ms));
    }
  }
  if (partial == nullptr) return;  // no parameter gradient asked for

  constexpr int kRun = kScaleTile / kScaleRuns;
  if (threadIdx.x < kWidth * kScaleRuns) {
    const int w = threadIdx.x / kScaleRuns, q = threadIdx.x % kScaleRuns;
    // Column w: dbeta[w] for w < N, else dalpha of group w - N.
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kRun; ++i) {
      const int u = q * kRun + i;
      sum += w < kN ? dz_s[u][w] : GroupDalpha<kQuarters>(dalpha_s[u], w - kN);
    }
    runs[w][q] = sum;
  }
  __syncthreads();
  if (threadIdx.x < kWidth) {
    float sum = 0.0f;
#pragma unroll
    for (int q = 0; q < kScaleRuns; ++q) sum += runs[threadIdx.x][q];
    partial[static_cast<int64_t>(blockIdx.x) * kWidth + threadIdx.x] = sum;
  }
  if (!LastCtaToArrive(arrivals)) return;

  const int64_t blocks = gridDim.x;
  if (threadIdx.x < kSplit * kWidth) {
    const int k = threadIdx.x / kWidth, w = threadIdx.x % kWidth;
    float sum = 0.0f;
    // kScaleBatch independent L2 reads in flight per pass; rows past the
    // end add 0, which never changes a sum.
    for (int64_t b0 = k; b0 < blocks; b0 += int64_t{kSplit} * kScaleBatch) {
      float v[kScaleBatch];
      const float* row = partial + b0 * kWidth + w;
      if (b0 + int64_t{kScaleBatch - 1} * kSplit < blocks) {
#pragma unroll
        for (int i = 0; i < kScaleBatch; ++i) {
          v[i] = __ldcg(row + i * kSplit * kWidth);
        }
      } else {
#pragma unroll
        for (int i = 0; i < kScaleBatch; ++i) {
          v[i] = b0 + int64_t{i} * kSplit < blocks
                     ? __ldcg(row + i * kSplit * kWidth)
                     : 0.0f;
        }
      }
#pragma unroll
      for (int i = 0; i < kScaleBatch; ++i) sum += v[i];
    }
    strands[k][w] = sum;
  }
  __syncthreads();
  if (threadIdx.x < kWidth) {
    const int w = threadIdx.x;
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < kSplit; ++k) total += strands[k][w];
    if (grad != nullptr) *grad = grad_before + total;
  }
  ResetArrivals(arrivals);
}

// One warp per (chunk, column): lane l adds tokens l, l + 32, ... of the
// chunk in order, then a fixed xor tree; the order depends on the chunk's
// token count alone. The last CTA to finish then adds each column's chunk
// partials in chunk order, as chunk_sum_kernel does, in the same launch.
// kEarly (LaunchColumnSum's rows_before_previous): the rows are complete
// when the kernel starts, so it sums them beside the previous kernel, and
// waits for that kernel only at its end, so that whatever follows still
// finds every earlier kernel finished.
constexpr int kColumnWarps = 4;
// out_a[c] += total for c < split, out_b[c - split] += total above (null:
// not asked for).
__device__ __forceinline__ void AddColumn(int c, float total, int split,
                                          float* out_a, float* out_b) {
  float* out = c < split ? out_a : out_b;
  if (out != nullptr) out[c < split ? c : c - split] += total;
}
template <bool kEarly>
__device__ __forceinline__ void SumColumns(const float* rows, int64_t tokens,
                                           int width, int split, float* partial,
                                           unsigned* arrivals, float* out_a,
                                           float* out_b) {
  const int lane = threadIdx.x & 31;
  const int w = blockIdx.y * kColumnWarps + (threadIdx.x >> 5);
  const int64_t chunk = blockIdx.x;
  if (w < width) {
    const int64_t begin = chunk * kTokenChunk;
    const int64_t end = min(tokens, begin + kTokenChunk);
    float sum = 0.0f;
    for (int64_t m = begin + lane; m < end; m += 32) {
      // Early, through L2: this SM's L1 may hold lines of an older kernel.
      sum += kEarly ? __ldcg(rows + m * width + w) : rows[m * width + w];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    if (gridDim.x == 1) {
      // One chunk: its column is the total (the same 0 + partial as below),
      // with no count and no second read.
      if (lane == 0) AddColumn(w, 0.0f + sum, split, out_a, out_b);
      return;
    }
    if (lane == 0) partial[chunk * width + w] = sum;
  }
  if (gridDim.x == 1 || !LastCtaToArrive(arrivals)) return;
  const int64_t chunks = gridDim.x;
  for (int c = threadIdx.x; c < width; c += blockDim.x) {
    float sum = 0.0f;
#pragma unroll 8
    for (int64_t q = 0; q < chunks; ++q) sum += __ldcg(partial + q * width + c);
    AddColumn(c, sum, split, out_a, out_b);
  }
  ResetArrivals(arrivals);
}

template <bool kEarly>
__global__ void __launch_bounds__(kColumnWarps * 32)
    column_sum_kernel(const float* rows, int64_t tokens, int width, int split,
                      float* partial, unsigned* arrivals, float* out_a,
                      float* out_b) {
  if constexpr (!kEarly) WaitForPrerequisiteGrid();  // the rows
  SumColumns<kEarly>(rows, tokens, width, split, partial, arrivals, out_a,
                     out_b);
  if constexpr (kEarly) WaitForPrerequisiteGrid();
}

__global__ void chunk_sum_kernel(const float* partial, int64_t chunks,
                                 int64_t width, float* out) {
  WaitForPrerequisiteGrid();  // the partials
  const int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (w >= width) return;
  float sum = 0.0f;
  for (int64_t q = 0; q < chunks; ++q) sum += partial[q * width + w];
  out[w] += sum;
}

}  // namespace

ScalePlan PlanOf(const ScaleForwardParams& p) {
  return PlanScale(*p.spec, LeastAlignment({p.h, p.h_pre, p.h_post, p.logits}));
}

ScalePlan PlanOf(const ScaleBackwardParams& p) {
  return PlanScale(*p.spec,
                   LeastAlignment({p.h, p.dh, p.dh_pre, p.dh_post, p.dlogits}));
}

absl::Status LaunchColumnSum(const ColumnSumArgs& c, cudaStream_t stream,
                             bool rows_before_previous) {
  if (c.out_a == nullptr && c.out_b == nullptr) return absl::OkStatus();
  if (c.arrivals == nullptr) {
    return absl::InternalError("column sum: no arrival counter");
  }
  const dim3 grid(GridSize(NumChunks(c.tokens)),
                  GridSize((c.width + kColumnWarps - 1) / kColumnWarps));
  const cudaError_t err = LaunchAfterPrevious(
      rows_before_previous ? column_sum_kernel<true> : column_sum_kernel<false>,
      grid, dim3(kColumnWarps * 32), 0, stream, c.rows, c.tokens, c.width,
      c.split, c.partial, c.arrivals, c.out_a, c.out_b);
  MHC_CUDA_RETURN_IF_ERROR(err, "column sum",
                           absl::StrCat("[M=", c.tokens, " W=", c.width, "]"));
  MHC_CUDA_CHECK_LAUNCH("column sum",
                        absl::StrCat("[M=", c.tokens, " W=", c.width, "]"));
  return absl::OkStatus();
}

absl::Status LaunchChunkSum(const float* partial, int64_t chunks, int64_t width,
                            float* out, cudaStream_t stream) {
  const cudaError_t err =
      LaunchAfterPrevious(chunk_sum_kernel, dim3(GridSize((width + 127) / 128)),
                          dim3(128), 0, stream, partial, chunks, width, out);
  MHC_CUDA_RETURN_IF_ERROR(err, "chunk sum",
                           absl::StrCat("[chunks=", chunks, " W=", width, "]"));
  MHC_CUDA_CHECK_LAUNCH("chunk sum",
                        absl::StrCat("[chunks=", chunks, " W=", width, "]"));
  return absl::OkStatus();
}

size_t ScaleBackwardWorkspace(const LayerSpec& spec, int64_t tokens) {
  const int64_t width = spec.NumLogits() + spec.NumAlpha();
  // The workspace is the same at every alignment.
  if (PlanScale(spec, 16).variant != ScaleVariant::kThread) {
    // One partial row per kScaleTile tokens.
    return AlignBytes(sizeof(float) * ((tokens + kScaleTile - 1) / kScaleTile) *
                      width);
  }
  const int64_t rows = WarpRows(tokens);  // warp rows, then their chunks
  return AlignBytes(sizeof(float) * rows * width) +
         AlignBytes(sizeof(float) * NumChunks(rows) * width);
}

absl::Status LaunchScaleForward(const ScaleForwardParams& p,
                                cudaStream_t stream,
                                const ScaleRepair* repair) {
  const DevSpec s = MakeDevSpec(*p.spec);
  // The n = 4 kernels never get a repair: SplitMix layers have n != 4.
  const ScaleRepair fix = repair != nullptr ? *repair : ScaleRepair{};
  const ScalePlan plan = PlanOf(p);
  cudaError_t err = cudaSuccess;
  if (plan.variant != ScaleVariant::kThread) {
    const bool vec = plan.variant == ScaleVariant::kN4Vector;
    const unsigned grid = GridSize(
        (p.tokens * plan.quarters + kScale4Threads - 1) / kScale4Threads);
    auto launch = [&](auto kernel) {
      err = LaunchAfterPrevious(kernel, dim3(grid), dim3(kScale4Threads), 0,
                                stream, s, p.tokens, p.h, p.mean_square,
                                p.weights.alpha, p.weights.beta, p.h_pre,
                                p.h_post, p.logits);
    };
    if (plan.quarters == 1) {
      vec ? launch(scale4_forward_kernel<1, true>)
          : launch(scale4_forward_kernel<1, false>);
    } else {
      vec ? launch(scale4_forward_kernel<6, true>)
          : launch(scale4_forward_kernel<6, false>);
    }
  } else {
    const unsigned grid =
        GridSize((p.tokens + kTokenThreads - 1) / kTokenThreads);
    DispatchMix(s.n, [&](auto nt) {
      err = LaunchAfterPrevious(
          scale_forward_kernel<decltype(nt)::value>, dim3(grid),
          dim3(kTokenThreads), 0, stream, s, p.tokens, p.h, p.mean_square,
          p.weights.alpha, p.weights.beta, p.h_pre, p.h_post, p.logits, fix);
    });
  }
  MHC_CUDA_RETURN_IF_ERROR(err, "scale forward",
                           LaunchShape(*p.spec, p.tokens, DType::kF32));
  MHC_CUDA_CHECK_LAUNCH("scale forward",
                        LaunchShape(*p.spec, p.tokens, DType::kF32));
  return absl::OkStatus();
}

absl::Status LaunchScaleBackward(const ScaleBackwardParams& p, Workspace ws,
                                 unsigned* arrivals, cudaStream_t stream,
                                 const ScaleRepair* repair) {
  const DevSpec s = MakeDevSpec(*p.spec);
  const ScaleRepair fix = repair != nullptr ? *repair : ScaleRepair{};
  if (ws.bytes < ScaleBackwardWorkspace(*p.spec, p.tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda scale backward ",
                     ShapeText(LaunchShape(*p.spec, p.tokens, DType::kF32)),
                     ": workspace too small"));
  }
  const int width = s.N + s.num_alpha;
  if (p.tokens == 0) return absl::OkStatus();
  float* grad_alpha = s.dynamic ? p.grads.alpha : nullptr;
  const ScalePlan plan = PlanOf(p);
  cudaError_t err = cudaSuccess;
  if (plan.variant != ScaleVariant::kThread) {
    const bool grads = p.grads.beta != nullptr || grad_alpha != nullptr;
    float* partial = grads ? static_cast<float*>(ws.data) : nullptr;
    const bool vec = plan.variant == ScaleVariant::kN4Vector;
    const unsigned grid = GridSize((p.tokens + kScaleTile - 1) / kScaleTile);
    auto launch = [&](auto kernel) {
      err = LaunchAfterPrevious(
          kernel, dim3(grid), dim3(kScaleTile * plan.quarters), 0, stream, s,
          p.tokens, p.h, p.mean_square, p.weights.alpha, p.weights.beta,
          p.dh_pre, p.dh_post, p.dlogits, p.dh, p.dmean_square, partial,
          arrivals, p.grads.beta, grad_alpha);
    };
    if (plan.quarters == 1) {
      vec ? launch(scale4_backward_kernel<1, true>)
          : launch(scale4_backward_kernel<1, false>);
    } else {
      vec ? launch(scale4_backward_kernel<6, true>)
          : launch(scale4_backward_kernel<6, false>);
    }
    MHC_CUDA_RETURN_IF_ERROR(err, "scale backward",
                             LaunchShape(*p.spec, p.tokens, DType::kF32));
    MHC_CUDA_CHECK_LAUNCH("scale backward",
                          LaunchShape(*p.spec, p.tokens, DType::kF32));
    return absl::OkStatus();
  }
  const bool grads = p.grads.beta != nullptr || grad_alpha != nullptr;
  float* warp_rows = grads ? static_cast<float*>(ws.data) : nullptr;
  const unsigned grid =
      GridSize((p.tokens + kTokenThreads - 1) / kTokenThreads);
  DispatchMix(s.n, [&](auto nt) {
    err = LaunchAfterPrevious(scale_backward_kernel<decltype(nt)::value>,
                              dim3(grid), dim3(kTokenThreads), 0, stream, s,
                              p.tokens, p.h, p.mean_square, p.weights.alpha,
                              p.weights.beta, p.dh_pre, p.dh_post, p.dlogits,
                              p.dh, p.dmean_square, warp_rows, fix);
  });
  MHC_CUDA_RETURN_IF_ERROR(err, "scale backward",
                           LaunchShape(*p.spec, p.tokens, DType::kF32));
  MHC_CUDA_CHECK_LAUNCH("scale backward",
                        LaunchShape(*p.spec, p.tokens, DType::kF32));
  if (!grads) return absl::OkStatus();
  ColumnSumArgs sums;
  sums.rows = warp_rows;
  sums.tokens = WarpRows(p.tokens);
  sums.width = width;
  sums.split = s.N;
  sums.partial =
      reinterpret_cast<float*>(static_cast<char*>(ws.data) +
                               AlignBytes(sizeof(float) * sums.tokens * width));
  sums.arrivals = arrivals;
  sums.out_a = p.grads.beta;
  sums.out_b = grad_alpha;
  return LaunchColumnSum(sums, stream);
}

}  // namespace mhc::cuda
