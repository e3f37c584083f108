// Per-token mixing math in fp32 registers: the scale step (logits and gates)
// and Sinkhorn-Knopp with its exact reverse mode through the T unrolled
// iterations. One thread owns one token, so every result depends on that
// token alone (batch invariant) and the operation order is fixed
// (deterministic). NT is the stream capacity: 4 (n known at compile time,
// everything in registers) or 16 (runtime n, local arrays).
#ifndef MHC_KERNELS_CUDA_MIX_CUH_
#define MHC_KERNELS_CUDA_MIX_CUH_

#include <cmath>

#include "common.cuh"

namespace mhc::cuda {

template <int NT>
__device__ __forceinline__ int StreamCount(const DevSpec& s) {
  return NT == 4 ? 4 : s.n;
}

__device__ __forceinline__ float Sigmoid(float z) {
  return 1.0f / (1.0f + expf(-z));
}

__device__ __forceinline__ float RmsFactor(const DevSpec& s, float ms) {
  return s.outside ? 1.0f / (sqrtf(ms) + s.eps_rms)
                   : 1.0f / sqrtf(ms + s.eps_rms);
}

// dr/dms; OUTSIDE at ms = 0 contributes nothing (v = 0 there, see the
// reference's RmsFactorDerivative).
__device__ __forceinline__ float RmsDerivative(const DevSpec& s, float ms,
                                               float r) {
  if (!s.outside) return -0.5f * r * r * r;
  if (ms == 0.0f) return 0.0f;
  return -r * r / (2.0f * sqrtf(ms));
}

// Gate i of H_pre from z_i = alpha_0 h_i r + beta_i (dynamic) or beta_i:
// ScaleForwardToken's first step, which the fused aggregate also runs on
// its own (the same code, so the same bits).
template <bool kDynamic>
__device__ __forceinline__ float PreGate(const DevSpec& s, float h_i, float r,
                                         float al0, float beta_i) {
  float z = beta_i;
  if (kDynamic) z += al0 * h_i * r;
  return Sigmoid(z) + s.eps_pre;
}

// z_g = alpha h_g r + beta_g (dynamic) or beta_g, then the gates.
// h: [N] (dynamic only). a: [NT*NT] raw logits (kMhc only).
// kDynamic and the alphas in registers up front: tested and loaded per
// logit, each logit waited out a branch and a shared-memory load.
template <int NT, bool kDynamic>
__device__ __forceinline__ void ScaleForwardTokenAs(
    const DevSpec& s, const float* h, float ms, const float* alpha,
    const float* beta, float (&h_pre)[NT], float (&h_post)[NT],
    float (&a)[NT * NT]) {
  const int n = StreamCount<NT>(s);
  const float r = kDynamic ? RmsFactor(s, ms) : 0.0f;
  float al[3] = {0.0f, 0.0f, 0.0f};
  if (kDynamic) {
    al[0] = alpha[0];
    if (!s.head) al[1] = alpha[1], al[2] = alpha[2];
  }
#pragma unroll(NT == 4 ? NT : 1)
  for (int i = 0; i < NT; ++i) {
    if (i >= n) break;
    h_pre[i] = PreGate<kDynamic>(s, kDynamic ? h[i] : 0.0f, r, al[0], beta[i]);
  }
  if (s.head) return;
#pragma unroll(NT == 4 ? NT : 1)
  for (int i = 0; i < NT; ++i) {
    if (i >= n) break;
    float z = beta[n + i];
    if (kDynamic) z += al[1] * h[n + i] * r;
    h_post[i] = s.post_mult * Sigmoid(z);
  }
#pragma unroll(NT == 4 ? NT * NT : 1)
  for (int e = 0; e < NT * NT; ++e) {
    if (e >= n * n) break;
    float z = beta[2 * n + e];
    if (kDynamic) z += al[2] * h[2 * n + e] * r;
    a[e] = z;
  }
}
template <int NT>
__device__ __forceinline__ void ScaleForwardToken(
    const DevSpec& s, const float* h, float ms, const float* alpha,
    const float* beta, float (&h_pre)[NT], float (&h_post)[NT],
    float (&a)[NT * NT]) {
  if (s.dynamic) {
    ScaleForwardTokenAs<NT, true>(s, h, ms, alpha, beta, h_pre, h_post, a);
  } else {
    ScaleForwardTokenAs<NT, false>(s, h, ms, alpha, beta, h_pre, h_post, a);
  }
}

// Reverse of ScaleForwardToken. Writes dh [N] and *dms (dynamic), and the
// token's parameter-gradient contributions contrib [N + num_alpha]: dz_g
// (dbeta) then dz h r summed per alpha group in g order (dalpha). A null
// output is not written (the lanes of a quad that run this beside its
// writer). kDynamic and the alphas in registers up front, as the forward.
template <int NT, bool kDynamic>
__device__ __forceinline__ void ScaleBackwardTokenAs(
    const DevSpec& s, const float* h, float ms, const float* alpha,
    const float* beta, const float* dh_pre, const float* dh_post,
    const float (&da)[NT * NT], float* dh, float* dms, float* contrib) {
  const int n = StreamCount<NT>(s);
  const int rows = s.N;
  const float r = kDynamic ? RmsFactor(s, ms) : 0.0f;
  float al[3] = {0.0f, 0.0f, 0.0f};
  if (kDynamic) {
    al[0] = alpha[0];
    if (!s.head) al[1] = alpha[1], al[2] = alpha[2];
  }
  float ms_dot = 0.0f;
  float dalpha[3] = {0.0f, 0.0f, 0.0f};
  auto visit = [&](int g, int group, float dz) {
    if (contrib != nullptr) contrib[g] = dz;
    if (!kDynamic) return;
    const float hg = h[g];
    dalpha[group] += dz * hg * r;
    if (dh != nullptr) dh[g] = al[group] * dz * r;
    ms_dot += dz * al[group] * hg;
  };
  auto gate = [&](int g, int group) {
    float z = beta[g];
    if (kDynamic) z += al[group] * h[g] * r;
    const float sg = Sigmoid(z);
    return sg * (1.0f - sg);
  };
#pragma unroll(NT == 4 ? NT : 1)
  for (int i = 0; i < NT; ++i) {
    if (i >= n) break;
    visit(i, 0, dh_pre[i] * gate(i, 0));
  }
  if (!s.head) {
#pragma unroll(NT == 4 ? NT : 1)
    for (int i = 0; i < NT; ++i) {
      if (i >= n) break;
      visit(n + i, 1, dh_post[i] * s.post_mult * gate(n + i, 1));
    }
#pragma unroll(NT == 4 ? NT * NT : 1)
    for (int e = 0; e < NT * NT; ++e) {
      if (e >= n * n) break;
      visit(2 * n + e, 2, da[e]);
    }
  }
  if (contrib != nullptr) {
    for (int p = 0; p < s.num_alpha; ++p) {
      contrib[rows + p] = kDynamic ? dalpha[p] : 0.0f;
    }
  }
  if (kDynamic && dms != nullptr) *dms = ms_dot * RmsDerivative(s, ms, r);
}
template <int NT>
__device__ __forceinline__ void ScaleBackwardToken(
    const DevSpec& s, const float* h, float ms, const float* alpha,
    const float* beta, const float* dh_pre, const float* dh_post,
    const float (&da)[NT * NT], float* dh, float* dms, float* contrib) {
  if (s.dynamic) {
    ScaleBackwardTokenAs<NT, true>(s, h, ms, alpha, beta, dh_pre, dh_post, da,
                                   dh, dms, contrib);
  } else {
    ScaleBackwardTokenAs<NT, false>(s, h, ms, alpha, beta, dh_pre, dh_post, da,
                                    dh, dms, contrib);
  }
}

// ------------------------------------------------------------ Sinkhorn --

// 1/d from the hardware approximation (<= 1 ulp) refined by one Newton step,
// so every Sinkhorn step costs one reciprocal per row or column instead of a
// full IEEE division per element; the product x * (1/d) stays within a few
// fp32 ulps of x / d, far inside docs/SPEC.md's 1e-5. NaN and d = 0 still give
// NaN (e = 1 - 0 * inf), as x / d would for the all-zero sums that produce
// them.
__device__ __forceinline__ float Reciprocal(float d) {
  float r;
  asm("rcp.approx.f32 %0, %1;" : "=f"(r) : "f"(d));
  const float e = fmaf(-d, r, 1.0f);
  return fmaf(r, e, r);
}

// Normalises the rows (columns == false) or columns of p by (sum + eps).
template <int NT>
__device__ __forceinline__ void Normalise(int n, float (&p)[NT * NT],
                                          bool columns, float eps) {
#pragma unroll(NT == 4 ? NT : 1)
  for (int a = 0; a < NT; ++a) {
    if (a >= n) break;
    float sum = 0.0f;
#pragma unroll(NT == 4 ? NT : 1)
    for (int b = 0; b < NT; ++b) {
      if (b >= n) break;
      sum += columns ? p[b * n + a] : p[a * n + b];
    }
    const float inv = Reciprocal(sum + eps);
#pragma unroll(NT == 4 ? NT : 1)
    for (int b = 0; b < NT; ++b) {
      if (b >= n) break;
      const int idx = columns ? b * n + a : a * n + b;
      p[idx] = p[idx] * inv;
    }
  }
}

// Reverse of one normalisation whose input was x: g <- dX.
template <int NT>
__device__ __forceinline__ void NormaliseBackward(int n,
                                                  const float (&x)[NT * NT],
                                                  bool columns, float eps,
                                                  float (&g)[NT * NT]) {
#pragma unroll(NT == 4 ? NT : 1)
  for (int a = 0; a < NT; ++a) {
    if (a >= n) break;
    float sum = 0.0f;
    float dot = 0.0f;
#pragma unroll(NT == 4 ? NT : 1)
    for (int b = 0; b < NT; ++b) {
      if (b >= n) break;
      const int idx = columns ? b * n + a : a * n + b;
      sum += x[idx];
      dot += g[idx] * x[idx];
    }
    const float inv = Reciprocal(sum + eps);
    const float shift = dot * inv;
#pragma unroll(NT == 4 ? NT : 1)
    for (int b = 0; b < NT; ++b) {
      if (b >= n) break;
      const int idx = columns ? b * n + a : a * n + b;
      g[idx] = (g[idx] - shift) * inv;
    }
  }
}

// Row softmax of a (NaN never wins the max, so it poisons its row).
template <int NT>
__device__ __forceinline__ void Softmax(int n, const float (&a)[NT * NT],
                                        float (&p)[NT * NT]) {
#pragma unroll(NT == 4 ? NT : 1)
  for (int i = 0; i < NT; ++i) {
    if (i >= n) break;
    float best = a[i * n];
#pragma unroll(NT == 4 ? NT : 1)
    for (int j = 1; j < NT; ++j) {
      if (j >= n) break;
      if (a[i * n + j] > best) best = a[i * n + j];
    }
    float sum = 0.0f;
#pragma unroll(NT == 4 ? NT : 1)
    for (int j = 0; j < NT; ++j) {
      if (j >= n) break;
      p[i * n + j] = expf(a[i * n + j] - best);
      sum += p[i * n + j];
    }
#pragma unroll(NT == 4 ? NT : 1)
    for (int j = 0; j < NT; ++j) {
      if (j >= n) break;
      p[i * n + j] = p[i * n + j] / sum;
    }
  }
}

// Step 0 and every even step normalise columns, odd steps rows.
__device__ __forceinline__ bool StepIsColumns(int step) {
  return (step & 1) == 0;
}

// -logsumexp over t of a[t*stride] + shift[t].
template <int NT>
__device__ __forceinline__ float NegLogSumExp(int n, const float* a, int stride,
                                              const float (&shift)[NT]) {
  float best = a[0] + shift[0];
#pragma unroll(NT == 4 ? NT : 1)
  for (int t = 1; t < NT; ++t) {
    if (t >= n) break;
    const float v = a[t * stride] + shift[t];
    if (v > best) best = v;
  }
  if (isinf(best) && best < 0.0f) return INFINITY;
  float sum = 0.0f;
#pragma unroll(NT == 4 ? NT : 1)
  for (int t = 0; t < NT; ++t) {
    if (t >= n) break;
    sum += expf(a[t * stride] + shift[t] - best);
  }
  return -(best + logf(sum));
}

// One LOG iteration: f from g, then g from f.
template <int NT>
__device__ __forceinline__ void LogIteration(int n, const float (&a)[NT * NT],
                                             float (&f)[NT], float (&g)[NT]) {
#pragma unroll(NT == 4 ? NT : 1)
  for (int i = 0; i < NT; ++i) {
    if (i >= n) break;
    f[i] = NegLogSumExp<NT>(n, a + i * n, 1, g);
  }
#pragma unroll(NT == 4 ? NT : 1)
  for (int j = 0; j < NT; ++j) {
    if (j >= n) break;
    g[j] = NegLogSumExp<NT>(n, a + j, n, f);
  }
}

template <int NT>
__device__ __forceinline__ void SinkhornForwardToken(const DevSpec& s,
                                                     const float (&a)[NT * NT],
                                                     float (&p)[NT * NT]) {
  const int n = StreamCount<NT>(s);
  if (s.log_mode) {
    float f[NT], g[NT];
#pragma unroll(NT == 4 ? NT : 1)
    for (int i = 0; i < NT; ++i) f[i] = g[i] = 0.0f;
    for (int t = 0; t < s.iterations; ++t) LogIteration<NT>(n, a, f, g);
#pragma unroll(NT == 4 ? NT : 1)
    for (int i = 0; i < NT; ++i) {
      if (i >= n) break;
#pragma unroll(NT == 4 ? NT : 1)
      for (int j = 0; j < NT; ++j) {
        if (j >= n) break;
        p[i * n + j] = expf(f[i] + a[i * n + j] + g[j]);
      }
    }
    return;
  }
  Softmax<NT>(n, a, p);
#pragma unroll(NT == 4 ? NT * NT : 1)
  for (int e = 0; e < NT * NT; ++e) {
    if (e >= n * n) break;
    p[e] += s.eps_sk;
  }
  const int steps = 2 * s.iterations - 1;
  for (int step = 0; step < steps; ++step) {
    Normalise<NT>(n, p, StepIsColumns(step), s.eps_sk);
  }
}

// Checkpoints kept by the reverse mode: the forward state every L steps, so
// the state before any step is recomputed from the nearest checkpoint
// (O(steps * L) work, no per-token memory beyond the thread's own).
template <int NT>
struct Checkpoints {
  static constexpr int kLinear = NT == 4 ? 16 : 2;
  static constexpr int kLog = 32;
};

template <int NT>
__device__ void LinearBackwardToken(const DevSpec& s, const float (&a)[NT * NT],
                                    const float (&dp)[NT * NT],
                                    float (&da)[NT * NT]) {
  const int n = StreamCount<NT>(s);
  const int nn = n * n;
  const float eps = s.eps_sk;
  const int steps = 2 * s.iterations - 1;
  constexpr int kCk = Checkpoints<NT>::kLinear;
  const int span = (steps + kCk - 1) / kCk;
  float ck[kCk][NT * NT];
  float x[NT * NT];
  Softmax<NT>(n, a, x);
#pragma unroll(NT == 4 ? NT * NT : 1)
  for (int e = 0; e < NT * NT; ++e) {
    if (e >= nn) break;
    x[e] += eps;
  }
  for (int step = 0; step < steps; ++step) {
    if (step % span == 0) {
#pragma unroll(NT == 4 ? NT * NT : 1)
      for (int e = 0; e < NT * NT; ++e) {
        if (e >= nn) break;
        ck[step / span][e] = x[e];
      }
    }
    Normalise<NT>(n, x, StepIsColumns(step), eps);
  }
  float g[NT * NT];
#pragma unroll(NT == 4 ? NT * NT : 1)
  for (int e = 0; e < NT * NT; ++e) {
    if (e >= nn) break;
    g[e] = dp[e];
  }
  for (int step = steps - 1; step >= 0; --step) {
    const int q = step / span;
#pragma unroll(NT == 4 ? NT * NT : 1)
    for (int e = 0; e < NT * NT; ++e) {
      if (e >= nn) break;
      x[e] = ck[q][e];
    }
    for (int u = q * span; u < step; ++u) {
      Normalise<NT>(n, x, StepIsColumns(u), eps);
    }
    NormaliseBackward<NT>(n, x, StepIsColumns(step), eps, g);
  }
  // The + eps after the softmax has unit derivative; then the softmax.
  Softmax<NT>(n, a, x);
#pragma unroll(NT == 4 ? NT : 1)
  for (int i = 0; i < NT; ++i) {
    if (i >= n) break;
    float dot = 0.0f;
#pragma unroll(NT == 4 ? NT : 1)
    for (int j = 0; j < NT; ++j) {
      if (j >= n) break;
      dot += g[i * n + j] * x[i * n + j];
    }
#pragma unroll(NT == 4 ? NT : 1)
    for (int j = 0; j < NT; ++j) {
      if (j >= n) break;
      da[i * n + j] = (g[i * n + j] - dot) * x[i * n + j];
    }
  }
}

template <int NT>
__device__ void LogBackwardToken(const DevSpec& s, const float (&a)[NT * NT],
                                 const float (&dp)[NT * NT],
                                 float (&da)[NT * NT]) {
  const int n = StreamCount<NT>(s);
  const int iterations = s.iterations;
  constexpr int kCk = Checkpoints<NT>::kLog;
  const int span = (iterations + kCk - 1) / kCk;
  // ck[q] = g after q * span iterations.
  float ck[kCk][NT];
  float f[NT], g[NT];
#pragma unroll(NT == 4 ? NT : 1)
  for (int i = 0; i < NT; ++i) f[i] = g[i] = 0.0f;
  for (int t = 0; t < iterations; ++t) {
    if (t % span == 0) {
#pragma unroll(NT == 4 ? NT : 1)
      for (int j = 0; j < NT; ++j) {
        if (j >= n) break;
        ck[t / span][j] = g[j];
      }
    }
    LogIteration<NT>(n, a, f, g);
  }
  float df[NT], dg[NT];
#pragma unroll(NT == 4 ? NT : 1)
  for (int i = 0; i < NT; ++i) df[i] = dg[i] = 0.0f;
#pragma unroll(NT == 4 ? NT : 1)
  for (int i = 0; i < NT; ++i) {
    if (i >= n) break;
#pragma unroll(NT == 4 ? NT : 1)
    for (int j = 0; j < NT; ++j) {
      if (j >= n) break;
      const float w = dp[i * n + j] * expf(f[i] + a[i * n + j] + g[j]);
      da[i * n + j] = w;
      df[i] += w;
      dg[j] += w;
    }
  }
  float g_prev[NT];
  for (int t = iterations; t >= 1; --t) {
    // Recompute g after t - 1 iterations, then f and g of iteration t.
    const int q = (t - 1) / span;
#pragma unroll(NT == 4 ? NT : 1)
    for (int j = 0; j < NT; ++j) g_prev[j] = j < n ? ck[q][j] : 0.0f;
    for (int u = q * span; u < t - 1; ++u) LogIteration<NT>(n, a, f, g_prev);
#pragma unroll(NT == 4 ? NT : 1)
    for (int j = 0; j < NT; ++j) g[j] = g_prev[j];
    LogIteration<NT>(n, a, f, g);
    // g_j = -lse_i(A_ij + f_i).
#pragma unroll(NT == 4 ? NT : 1)
    for (int i = 0; i < NT; ++i) {
      if (i >= n) break;
#pragma unroll(NT == 4 ? NT : 1)
      for (int j = 0; j < NT; ++j) {
        if (j >= n) break;
        const float w = dg[j] * expf(a[i * n + j] + f[i] + g[j]);
        da[i * n + j] -= w;
        df[i] -= w;
      }
    }
#pragma unroll(NT == 4 ? NT : 1)
    for (int j = 0; j < NT; ++j) dg[j] = 0.0f;
      // f_i = -lse_j(A_ij + g_prev_j).
#pragma unroll(NT == 4 ? NT : 1)
    for (int i = 0; i < NT; ++i) {
      if (i >= n) break;
#pragma unroll(NT == 4 ? NT : 1)
      for (int j = 0; j < NT; ++j) {
        if (j >= n) break;
        const float w = df[i] * expf(a[i * n + j] + g_prev[j] + f[i]);
        da[i * n + j] -= w;
        dg[j] -= w;
      }
    }
#pragma unroll(NT == 4 ? NT : 1)
    for (int i = 0; i < NT; ++i) df[i] = 0.0f;
  }
}

template <int NT>
__device__ __forceinline__ void SinkhornBackwardToken(
    const DevSpec& s, const float (&a)[NT * NT], const float (&dp)[NT * NT],
    float (&da)[NT * NT]) {
  if (s.log_mode) {
    LogBackwardToken<NT>(s, a, dp, da);
  } else {
    LinearBackwardToken<NT>(s, a, dp, da);
  }
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_MIX_CUH_
