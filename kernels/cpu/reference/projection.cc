// Reference projection + mean of squares (docs/SPEC.md section 2 steps 1-2 and
// the projection lines of section 4), float64. Single threaded, fixed loop
// order: bitwise deterministic and batch invariant (each token alone).
#include <cmath>
#include <vector>

#include "cpu/reference/reference_math.h"

namespace mhc::reference {
namespace {

// phi' = phi * gamma, materialised once per call so both directions use the
// same folded values.
std::vector<double> FoldedPhi(const LayerSpec& spec, const Weights& w) {
  const int64_t rows = spec.NumLogits();
  const int64_t k_size = spec.K();
  std::vector<double> folded(w.phi, w.phi + rows * k_size);
  if (spec.has_gamma) {
    for (int64_t g = 0; g < rows; ++g) {
      for (int64_t k = 0; k < k_size; ++k) folded[g * k_size + k] *= w.gamma[k];
    }
  }
  return folded;
}

}  // namespace

double Sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

double RmsFactor(const LayerSpec& spec, double mean_square) {
  const double eps = spec.eps_rms;
  if (spec.eps_placement == EpsPlacement::kInside) {
    return 1.0 / std::sqrt(mean_square + eps);
  }
  return 1.0 / (std::sqrt(mean_square) + eps);
}

double RmsFactorDerivative(const LayerSpec& spec, double mean_square) {
  const double r = RmsFactor(spec, mean_square);
  if (spec.eps_placement == EpsPlacement::kInside) return -0.5 * r * r * r;
  if (mean_square == 0.0) return 0.0;  // see the header
  return -r * r / (2.0 * std::sqrt(mean_square));
}

void ProjectionForward(const LayerSpec& spec, int64_t tokens, const double* x,
                       const Weights& w, double* h, double* mean_square) {
  if (tokens == 0) return;
  const int64_t rows = spec.NumLogits();
  const int64_t k_size = spec.K();
  const std::vector<double> phi = FoldedPhi(spec, w);
  for (int64_t m = 0; m < tokens; ++m) {
    const double* v = x + m * k_size;
    for (int64_t g = 0; g < rows; ++g) {
      const double* row = phi.data() + g * k_size;
      double sum = 0.0;
      for (int64_t k = 0; k < k_size; ++k) sum += row[k] * v[k];
      h[m * rows + g] = sum;
    }
    double squares = 0.0;
    for (int64_t k = 0; k < k_size; ++k) squares += v[k] * v[k];
    mean_square[m] = squares / static_cast<double>(k_size);
  }
}

void ProjectionBackward(const LayerSpec& spec, int64_t tokens, const double* x,
                        const Weights& w, const double* dh,
                        const double* dmean_square, double* dx,
                        const Grads& grads) {
  if (tokens == 0) return;
  const int64_t rows = spec.NumLogits();
  const int64_t k_size = spec.K();
  const std::vector<double> phi = FoldedPhi(spec, w);
  // dphi' = sum over tokens of dh v; both dphi and dgamma derive from it.
  const bool want_folded =
      grads.phi != nullptr || (spec.has_gamma && grads.gamma != nullptr);
  std::vector<double> dfolded(want_folded ? rows * k_size : 0, 0.0);
  for (int64_t m = 0; m < tokens; ++m) {
    const double* v = x + m * k_size;
    const double* dh_m = dh + m * rows;
    if (dx != nullptr) {
      const double ms_scale =
          2.0 * dmean_square[m] / static_cast<double>(k_size);
      double* dv = dx + m * k_size;
      for (int64_t k = 0; k < k_size; ++k) {
        double sum = 0.0;
        for (int64_t g = 0; g < rows; ++g) sum += dh_m[g] * phi[g * k_size + k];
        dv[k] = sum + ms_scale * v[k];
      }
    }
    if (want_folded) {
      for (int64_t g = 0; g < rows; ++g) {
        for (int64_t k = 0; k < k_size; ++k) {
          dfolded[g * k_size + k] += dh_m[g] * v[k];
        }
      }
    }
  }
  if (grads.phi != nullptr) {
    for (int64_t g = 0; g < rows; ++g) {
      for (int64_t k = 0; k < k_size; ++k) {
        const double scale = spec.has_gamma ? w.gamma[k] : 1.0;
        grads.phi[g * k_size + k] += dfolded[g * k_size + k] * scale;
      }
    }
  }
  if (spec.has_gamma && grads.gamma != nullptr) {
    for (int64_t k = 0; k < k_size; ++k) {
      double sum = 0.0;
      for (int64_t g = 0; g < rows; ++g) {
        sum += dfolded[g * k_size + k] * w.phi[g * k_size + k];
      }
      grads.gamma[k] += sum;
    }
  }
}

}  // namespace mhc::reference
