// Reference aggregate y = sum_i H_pre[i] x[i] and its backward (docs/SPEC.md
// sections 2 step 6 and 4), float64. Single threaded, sum in stream order i =
// 0..n-1: bitwise deterministic and batch invariant (each token alone).
#include "cpu/reference/reference_math.h"

namespace mhc::reference {

void AggregateForward(const LayerSpec& spec, int64_t tokens, const double* x,
                      const double* h_pre, double* y) {
  const int n = spec.n;
  const int64_t hidden = spec.hidden;
  const int64_t k_size = spec.K();
  for (int64_t m = 0; m < tokens; ++m) {
    const double* xm = x + m * k_size;
    for (int64_t c = 0; c < hidden; ++c) {
      double sum = 0.0;
      for (int i = 0; i < n; ++i) {
        sum += h_pre[m * n + i] * xm[spec.XIndex(i, c)];
      }
      y[m * hidden + c] = sum;
    }
  }
}

void AggregateBackward(const LayerSpec& spec, int64_t tokens, const double* x,
                       const double* h_pre, const double* dy, double* dx,
                       double* dh_pre) {
  const int n = spec.n;
  const int64_t hidden = spec.hidden;
  const int64_t k_size = spec.K();
  for (int64_t m = 0; m < tokens; ++m) {
    const double* xm = x + m * k_size;
    const double* dym = dy + m * hidden;
    for (int i = 0; i < n; ++i) {
      double sum = 0.0;
      for (int64_t c = 0; c < hidden; ++c) {
        sum += dym[c] * xm[spec.XIndex(i, c)];
        if (dx != nullptr) {
          dx[m * k_size + spec.XIndex(i, c)] = h_pre[m * n + i] * dym[c];
        }
      }
      dh_pre[m * n + i] = sum;
    }
  }
}

}  // namespace mhc::reference
