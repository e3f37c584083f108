// Sinkhorn-Knopp on the n x n logits of each token (LINEAR or LOG, fp32) and
// its exact reverse mode through the T unrolled iterations.
//
// Determinism and batch invariance: one token's matrices are computed by a
// single thread with loops in a fixed order; the backward recomputes the
// forward into that thread's scratch (history), so nothing per token but
// the outputs reaches the caller's memory and no result depends on M or on
// the thread count.
#include <cmath>
#include <limits>

#include "cpu/fast/cpu_ops.h"

namespace mhc::cpu {
namespace {

// History of LINEAR: S (softmax) [n*n], X_0..X_{2T-1} [n*n each] (X_0 =
// S + eps, X_t the matrix after step t), divisors d_1..d_{2T-1} [n each].
// Of LOG: f_1..f_T and g_1..g_T [n each].
struct LinearHistory {
  float* s;
  float* x;
  float* d;
};

LinearHistory CarveLinear(const LayerSpec& spec, float* history) {
  const int64_t nn = static_cast<int64_t>(spec.n) * spec.n;
  const int64_t t = spec.sinkhorn_iterations;
  return {history, history + nn, history + nn + 2 * t * nn};
}

// Step k >= 1 of LINEAR normalises columns when k is odd, rows when even.
void LinearForward(const LayerSpec& spec, const float* a, float* p,
                   float* history) {
  const int n = spec.n;
  const float eps = spec.eps_sk;
  const int steps = 2 * spec.sinkhorn_iterations - 1;
  LinearHistory h{};
  if (history != nullptr) h = CarveLinear(spec, history);
  for (int i = 0; i < n; ++i) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < n; ++j) mx = a[i * n + j] > mx ? a[i * n + j] : mx;
    float sum = 0.0f;
    for (int j = 0; j < n; ++j) {
      p[i * n + j] = std::exp(a[i * n + j] - mx);
      sum += p[i * n + j];
    }
    for (int j = 0; j < n; ++j) {
      const float softmax = p[i * n + j] / sum;
      if (history != nullptr) h.s[i * n + j] = softmax;
      p[i * n + j] = softmax + eps;
    }
  }
  if (history != nullptr) std::copy(p, p + n * n, h.x);
  float d[kMaxStreams];
  for (int step = 1; step <= steps; ++step) {
    const bool columns = step % 2 == 1;
    for (int l = 0; l < n; ++l) {
      float sum = 0.0f;
      for (int o = 0; o < n; ++o) sum += columns ? p[o * n + l] : p[l * n + o];
      d[l] = sum + eps;
    }
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) p[i * n + j] /= d[columns ? j : i];
    }
    if (history != nullptr) {
      std::copy(p, p + n * n, h.x + step * n * n);
      std::copy(d, d + n, h.d + (step - 1) * n);
    }
  }
}

void LinearBackward(const LayerSpec& spec, const float* dp, float* da,
                    const float* history) {
  const int n = spec.n;
  const int steps = 2 * spec.sinkhorn_iterations - 1;
  const LinearHistory h = CarveLinear(spec, const_cast<float*>(history));
  float grad[kMaxStreams * kMaxStreams];
  std::copy(dp, dp + n * n, grad);
  for (int step = steps; step >= 1; --step) {
    const bool columns = step % 2 == 1;
    const float* y = h.x + step * n * n;
    const float* d = h.d + (step - 1) * n;
    for (int l = 0; l < n; ++l) {
      float dot = 0.0f;
      for (int o = 0; o < n; ++o) {
        const int e = columns ? o * n + l : l * n + o;
        dot += grad[e] * y[e];
      }
      for (int o = 0; o < n; ++o) {
        const int e = columns ? o * n + l : l * n + o;
        grad[e] = (grad[e] - dot) / d[l];
      }
    }
  }
  for (int i = 0; i < n; ++i) {
    float dot = 0.0f;
    for (int j = 0; j < n; ++j) dot += grad[i * n + j] * h.s[i * n + j];
    for (int j = 0; j < n; ++j) {
      da[i * n + j] = (grad[i * n + j] - dot) * h.s[i * n + j];
    }
  }
}

// -logsumexp of v[0..n) with stride.
float NegLogSumExp(const float* v, int n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int l = 0; l < n; ++l) mx = v[l] > mx ? v[l] : mx;
  if (std::isinf(mx) && mx < 0) return std::numeric_limits<float>::infinity();
  float sum = 0.0f;
  for (int l = 0; l < n; ++l) sum += std::exp(v[l] - mx);
  return -(mx + std::log(sum));
}

void LogForward(const LayerSpec& spec, const float* a, float* p,
                float* history) {
  const int n = spec.n;
  const int t_max = spec.sinkhorn_iterations;
  float f[kMaxStreams] = {}, g[kMaxStreams] = {}, tmp[kMaxStreams];
  for (int t = 1; t <= t_max; ++t) {
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) tmp[j] = a[i * n + j] + g[j];
      f[i] = NegLogSumExp(tmp, n);
    }
    for (int j = 0; j < n; ++j) {
      for (int i = 0; i < n; ++i) tmp[i] = a[i * n + j] + f[i];
      g[j] = NegLogSumExp(tmp, n);
    }
    if (history != nullptr) {
      std::copy(f, f + n, history + (t - 1) * n);
      std::copy(g, g + n, history + (t_max + t - 1) * n);
    }
  }
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j)
      p[i * n + j] = std::exp(f[i] + a[i * n + j] + g[j]);
  }
}

void LogBackward(const LayerSpec& spec, const float* a, const float* dp,
                 const float* p, float* da, const float* history) {
  const int n = spec.n;
  const int t_max = spec.sinkhorn_iterations;
  float df[kMaxStreams] = {}, dg[kMaxStreams] = {};
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      const float w = dp[i * n + j] * p[i * n + j];
      da[i * n + j] = w;
      df[i] += w;
      dg[j] += w;
    }
  }
  const float zero[kMaxStreams] = {};
  for (int t = t_max; t >= 1; --t) {
    const float* f = history + (t - 1) * n;
    const float* g = history + (t_max + t - 1) * n;
    const float* g_prev = t > 1 ? history + (t_max + t - 2) * n : zero;
    // g_j = -lse_i(A_ij + f_i): d/dA_ij = d/df_i = -w_ij.
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        const float w = std::exp(a[i * n + j] + f[i] + g[j]);
        da[i * n + j] -= dg[j] * w;
        df[i] -= dg[j] * w;
      }
    }
    for (int j = 0; j < n; ++j) dg[j] = 0.0f;
    // f_i = -lse_j(A_ij + g_prev_j): d/dA_ij = d/dg_prev_j = -u_ij.
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        const float u = std::exp(a[i * n + j] + g_prev[j] + f[i]);
        da[i * n + j] -= df[i] * u;
        dg[j] -= df[i] * u;
      }
    }
    for (int i = 0; i < n; ++i) df[i] = 0.0f;
  }
}

}  // namespace

int64_t SinkhornHistoryFloats(const LayerSpec& spec) {
  const int64_t n = spec.n;
  const int64_t t = spec.sinkhorn_iterations;
  return (2 * t + 1) * n * n + 2 * t * n;
}

void SinkhornToken(const LayerSpec& spec, const float* a, float* p,
                   float* history) {
  if (spec.sinkhorn_mode == SinkhornMode::kLinear) {
    LinearForward(spec, a, p, history);
  } else {
    LogForward(spec, a, p, history);
  }
}

void SinkhornBackwardToken(const LayerSpec& spec, const float* a,
                           const float* dp, float* da, float* p,
                           float* history) {
  SinkhornToken(spec, a, p, history);
  if (spec.sinkhorn_mode == SinkhornMode::kLinear) {
    LinearBackward(spec, dp, da, history);
  } else {
    LogBackward(spec, a, dp, p, da, history);
  }
}

absl::Status SinkhornForward(const OpContext& ctx,
                             const SinkhornForwardParams& p) {
  const int64_t nn = static_cast<int64_t>(p.spec->n) * p.spec->n;
  ForTokens(ctx, p.tokens, [&](int64_t m, const ThreadScratch&) {
    SinkhornToken(*p.spec, p.logits + m * nn, p.h_res + m * nn, nullptr);
  });
  return absl::OkStatus();
}

absl::Status SinkhornBackward(const OpContext& ctx,
                              const SinkhornBackwardParams& p) {
  const int64_t nn = static_cast<int64_t>(p.spec->n) * p.spec->n;
  ForTokens(ctx, p.tokens, [&](int64_t m, const ThreadScratch& s) {
    SinkhornBackwardToken(*p.spec, p.logits + m * nn, p.dh_res + m * nn,
                          p.dlogits + m * nn, s.small, s.hist);
  });
  return absl::OkStatus();
}

}  // namespace mhc::cpu
