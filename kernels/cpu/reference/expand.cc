// Reference expand x[i] = e and its backward de = sum_i dx[i] (docs/SPEC.md
// section 2, entry operator), float64. Single threaded, sum in stream order:
// bitwise deterministic and batch invariant (each token alone).
#include "cpu/reference/reference_math.h"

namespace mhc::reference {

void ExpandForward(const LayerSpec& spec, int64_t tokens, const double* e,
                   double* x) {
  const int64_t hidden = spec.hidden;
  const int64_t k_size = spec.K();
  for (int64_t m = 0; m < tokens; ++m) {
    for (int i = 0; i < spec.n; ++i) {
      for (int64_t c = 0; c < hidden; ++c) {
        x[m * k_size + spec.XIndex(i, c)] = e[m * hidden + c];
      }
    }
  }
}

void ExpandBackward(const LayerSpec& spec, int64_t tokens, const double* dx,
                    double* de) {
  const int64_t hidden = spec.hidden;
  const int64_t k_size = spec.K();
  for (int64_t m = 0; m < tokens; ++m) {
    for (int64_t c = 0; c < hidden; ++c) {
      double sum = 0.0;
      for (int i = 0; i < spec.n; ++i) {
        sum += dx[m * k_size + spec.XIndex(i, c)];
      }
      de[m * hidden + c] = sum;
    }
  }
}

}  // namespace mhc::reference
