// Reference Sinkhorn-Knopp, LINEAR and LOG (docs/SPEC.md section 3), and its
// exact reverse mode through the T unrolled iterations (docs/SPEC.md section
// 4), float64. The backward replays the forward and keeps every intermediate
// matrix, which is affordable for n <= 16 and makes the reverse mode a literal
// transcription of the forward. Single threaded, fixed loop order: bitwise
// deterministic and batch invariant (each token alone).
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/reference/reference_math.h"

namespace mhc::reference {
namespace {

using Matrix = std::vector<double>;  // n x n, row major

// Max that lets NaN through only via the exp below (NaN never wins a >), so
// a NaN logit still poisons its whole row.
double RowMax(const double* a, int count, int stride) {
  double best = a[0];
  for (int t = 1; t < count; ++t) {
    if (a[t * stride] > best) best = a[t * stride];
  }
  return best;
}

// -logsumexp of `count` values a[t*stride] + shift[t].
double NegLogSumExp(const double* a, int stride, const double* shift,
                    int count) {
  double best = a[0] + shift[0];
  for (int t = 1; t < count; ++t) {
    const double value = a[t * stride] + shift[t];
    if (value > best) best = value;
  }
  if (std::isinf(best) && best < 0) return INFINITY;  // every term is exp(-inf)
  double sum = 0.0;
  for (int t = 0; t < count; ++t) {
    sum += std::exp(a[t * stride] + shift[t] - best);
  }
  return -(best + std::log(sum));
}

// ------------------------------------------------------------------ LINEAR --

// Step s of the 2T-1 normalisations normalises columns when s is even (the
// first step and the second half of every later iteration) and rows when odd.
bool StepIsColumns(int step) { return step % 2 == 0; }

void Normalise(const Matrix& in, int n, bool columns, double eps, Matrix& out) {
  out.assign(n * n, 0.0);
  for (int a = 0; a < n; ++a) {
    double sum = 0.0;
    for (int b = 0; b < n; ++b) sum += columns ? in[b * n + a] : in[a * n + b];
    const double denom = sum + eps;
    for (int b = 0; b < n; ++b) {
      const int idx = columns ? b * n + a : a * n + b;
      out[idx] = in[idx] / denom;
    }
  }
}

// Softmax rows of `a`, then the 2T-1 normalisations. states[0] is the softmax
// (without eps) and states[s + 1] is the output of step s.
void LinearForward(const LayerSpec& spec, const double* a,
                   std::vector<Matrix>& states) {
  const int n = spec.n;
  const int steps = 2 * spec.sinkhorn_iterations - 1;
  const double eps = spec.eps_sk;
  states.assign(steps + 1, Matrix());
  Matrix& soft = states[0];
  soft.assign(n * n, 0.0);
  for (int i = 0; i < n; ++i) {
    const double row_max = RowMax(a + i * n, n, 1);
    double sum = 0.0;
    for (int j = 0; j < n; ++j) {
      soft[i * n + j] = std::exp(a[i * n + j] - row_max);
      sum += soft[i * n + j];
    }
    for (int j = 0; j < n; ++j) soft[i * n + j] /= sum;
  }
  Matrix first = soft;
  for (double& value : first) value += eps;
  Normalise(first, n, StepIsColumns(0), eps, states[1]);
  for (int s = 1; s < steps; ++s) {
    Normalise(states[s], n, StepIsColumns(s), eps, states[s + 1]);
  }
}

// Y = X / (s + eps): dX = (dY - sum_over_line(dY X) / (s + eps)) / (s + eps).
void NormaliseBackward(const Matrix& in, int n, bool columns, double eps,
                       Matrix& grad) {
  for (int a = 0; a < n; ++a) {
    double sum = 0.0;
    double dot = 0.0;
    for (int b = 0; b < n; ++b) {
      const int idx = columns ? b * n + a : a * n + b;
      sum += in[idx];
      dot += grad[idx] * in[idx];
    }
    const double denom = sum + eps;
    for (int b = 0; b < n; ++b) {
      const int idx = columns ? b * n + a : a * n + b;
      grad[idx] = (grad[idx] - dot / denom) / denom;
    }
  }
}

void LinearBackward(const LayerSpec& spec, const double* a, const double* dp,
                    double* da) {
  const int n = spec.n;
  const int steps = 2 * spec.sinkhorn_iterations - 1;
  const double eps = spec.eps_sk;
  std::vector<Matrix> states;
  LinearForward(spec, a, states);
  Matrix grad(dp, dp + n * n);
  for (int s = steps - 1; s >= 1; --s) {
    NormaliseBackward(states[s], n, StepIsColumns(s), eps, grad);
  }
  Matrix first = states[0];
  for (double& value : first) value += eps;
  NormaliseBackward(first, n, StepIsColumns(0), eps, grad);
  // The + eps after the softmax has unit derivative; then the softmax.
  const Matrix& soft = states[0];
  for (int i = 0; i < n; ++i) {
    double dot = 0.0;
    for (int j = 0; j < n; ++j) dot += grad[i * n + j] * soft[i * n + j];
    for (int j = 0; j < n; ++j) {
      da[i * n + j] = (grad[i * n + j] - dot) * soft[i * n + j];
    }
  }
}

// --------------------------------------------------------------------- LOG --

// f[t], g[t] for t = 0..T (f[0] = g[0] = 0): the potentials after iteration t.
void LogForward(const LayerSpec& spec, const double* a,
                std::vector<std::vector<double>>& f,
                std::vector<std::vector<double>>& g) {
  const int n = spec.n;
  const int iterations = spec.sinkhorn_iterations;
  f.assign(iterations + 1, std::vector<double>(n, 0.0));
  g.assign(iterations + 1, std::vector<double>(n, 0.0));
  for (int t = 1; t <= iterations; ++t) {
    for (int i = 0; i < n; ++i) {
      f[t][i] = NegLogSumExp(a + i * n, 1, g[t - 1].data(), n);
    }
    for (int j = 0; j < n; ++j) {
      g[t][j] = NegLogSumExp(a + j, n, f[t].data(), n);
    }
  }
}

void LogBackward(const LayerSpec& spec, const double* a, const double* dp,
                 double* da) {
  const int n = spec.n;
  const int iterations = spec.sinkhorn_iterations;
  std::vector<std::vector<double>> f, g;
  LogForward(spec, a, f, g);
  std::vector<double> df(n, 0.0), dg(n, 0.0);
  // P = exp(f + A + g): dA = df_i = dg_j contributions of dP * P.
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      const double p =
          std::exp(f[iterations][i] + a[i * n + j] + g[iterations][j]);
      const double w = dp[i * n + j] * p;
      da[i * n + j] = w;
      df[i] += w;
      dg[j] += w;
    }
  }
  for (int t = iterations; t >= 1; --t) {
    // g_j = -lse_i(A_ij + f_i): d/d(A_ij + f_i) = -softmax_i = -exp(A+f+g).
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        const double w = dg[j] * std::exp(a[i * n + j] + f[t][i] + g[t][j]);
        da[i * n + j] -= w;
        df[i] -= w;
      }
    }
    // f_i = -lse_j(A_ij + g_j) with g from the previous iteration; g[t - 1]
    // feeds nothing else, so its gradient starts from zero here.
    std::fill(dg.begin(), dg.end(), 0.0);
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        const double w = df[i] * std::exp(a[i * n + j] + g[t - 1][j] + f[t][i]);
        da[i * n + j] -= w;
        dg[j] -= w;
      }
    }
    std::fill(df.begin(), df.end(), 0.0);
  }
}

}  // namespace

void SinkhornForward(const LayerSpec& spec, int64_t tokens,
                     const double* logits, double* h_res) {
  const int n = spec.n;
  const int64_t nn = static_cast<int64_t>(n) * n;
  for (int64_t m = 0; m < tokens; ++m) {
    const double* a = logits + m * nn;
    double* out = h_res + m * nn;
    if (spec.sinkhorn_mode == SinkhornMode::kLinear) {
      std::vector<Matrix> states;
      LinearForward(spec, a, states);
      for (int64_t e = 0; e < nn; ++e) out[e] = states.back()[e];
    } else {
      std::vector<std::vector<double>> f, g;
      LogForward(spec, a, f, g);
      const int last = spec.sinkhorn_iterations;
      for (int i = 0; i < n; ++i) {
        for (int j = 0; j < n; ++j) {
          out[i * n + j] = std::exp(f[last][i] + a[i * n + j] + g[last][j]);
        }
      }
    }
  }
}

void SinkhornBackward(const LayerSpec& spec, int64_t tokens,
                      const double* logits, const double* dh_res,
                      double* dlogits) {
  const int64_t nn = static_cast<int64_t>(spec.n) * spec.n;
  for (int64_t m = 0; m < tokens; ++m) {
    if (spec.sinkhorn_mode == SinkhornMode::kLinear) {
      LinearBackward(spec, logits + m * nn, dh_res + m * nn, dlogits + m * nn);
    } else {
      LogBackward(spec, logits + m * nn, dh_res + m * nn, dlogits + m * nn);
    }
  }
}

}  // namespace mhc::reference
