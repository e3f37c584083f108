// Reference post (expand & combine) x_next = H_post (f + bias) + R^T x and its
// backward (docs/SPEC.md sections 2 and 4), float64, both orientations of R.
// Single threaded, fixed loop order: bitwise deterministic and batch invariant
// (each token alone); dbias is summed over tokens in token order.
#include "cpu/reference/reference_math.h"

namespace mhc::reference {
namespace {

// Index of R[i][j] (i = source stream, j = destination) inside H_res.
int64_t RIndex(const LayerSpec& spec, int i, int j) {
  return spec.orientation == Orientation::kSourceRows
             ? static_cast<int64_t>(i) * spec.n + j
             : static_cast<int64_t>(j) * spec.n + i;
}

double Biased(const LayerSpec& spec, const Weights& w, const double* f,
              int64_t c) {
  return spec.has_post_bias ? f[c] + w.bias[c] : f[c];
}

}  // namespace

void PostForward(const LayerSpec& spec, int64_t tokens, const double* f,
                 const double* x, const double* h_post, const double* h_res,
                 const Weights& w, double* x_next) {
  const int n = spec.n;
  const int64_t hidden = spec.hidden;
  const int64_t k_size = spec.K();
  const int64_t nn = static_cast<int64_t>(n) * n;
  for (int64_t m = 0; m < tokens; ++m) {
    const double* xm = x + m * k_size;
    const double* res = h_res + m * nn;
    for (int j = 0; j < n; ++j) {
      for (int64_t c = 0; c < hidden; ++c) {
        double sum = h_post[m * n + j] * Biased(spec, w, f + m * hidden, c);
        for (int i = 0; i < n; ++i) {
          sum += res[RIndex(spec, i, j)] * xm[spec.XIndex(i, c)];
        }
        x_next[m * k_size + spec.XIndex(j, c)] = sum;
      }
    }
  }
}

void AddResidualGradient(const LayerSpec& spec, int64_t tokens,
                         const double* h_res, const double* dx_next,
                         double* dx) {
  const int n = spec.n;
  const int64_t hidden = spec.hidden;
  const int64_t k_size = spec.K();
  const int64_t nn = static_cast<int64_t>(n) * n;
  for (int64_t m = 0; m < tokens; ++m) {
    const double* res = h_res + m * nn;
    const double* dnext = dx_next + m * k_size;
    for (int i = 0; i < n; ++i) {
      for (int64_t c = 0; c < hidden; ++c) {
        double sum = 0.0;
        for (int j = 0; j < n; ++j) {
          sum += res[RIndex(spec, i, j)] * dnext[spec.XIndex(j, c)];
        }
        dx[m * k_size + spec.XIndex(i, c)] += sum;
      }
    }
  }
}

void PostBackward(const LayerSpec& spec, int64_t tokens, const double* dx_next,
                  const double* f, const double* x, const double* h_post,
                  const double* h_res, const Weights& w, double* df, double* dx,
                  double* dh_post, double* dh_res, const Grads& grads) {
  const int n = spec.n;
  const int64_t hidden = spec.hidden;
  const int64_t k_size = spec.K();
  const int64_t nn = static_cast<int64_t>(n) * n;
  for (int64_t m = 0; m < tokens; ++m) {
    const double* xm = x + m * k_size;
    const double* fm = f + m * hidden;
    const double* dnext = dx_next + m * k_size;
    for (int64_t c = 0; c < hidden; ++c) {
      double sum = 0.0;
      for (int j = 0; j < n; ++j) {
        sum += h_post[m * n + j] * dnext[spec.XIndex(j, c)];
      }
      df[m * hidden + c] = sum;
      if (spec.has_post_bias && grads.bias != nullptr) grads.bias[c] += sum;
    }
    for (int j = 0; j < n; ++j) {
      double sum = 0.0;
      for (int64_t c = 0; c < hidden; ++c) {
        sum += dnext[spec.XIndex(j, c)] * Biased(spec, w, fm, c);
      }
      dh_post[m * n + j] = sum;
    }
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        double sum = 0.0;
        for (int64_t c = 0; c < hidden; ++c) {
          sum += xm[spec.XIndex(i, c)] * dnext[spec.XIndex(j, c)];
        }
        dh_res[m * nn + RIndex(spec, i, j)] = sum;
      }
    }
  }
  if (dx != nullptr) {
    for (int64_t e = 0; e < tokens * k_size; ++e) dx[e] = 0.0;
    AddResidualGradient(spec, tokens, h_res, dx_next, dx);
  }
}

}  // namespace mhc::reference
