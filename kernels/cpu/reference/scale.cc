// Reference scale: logits z = alpha h r + beta and the gates (docs/SPEC.md
// section 2 steps 3-4, section 4 "logits" lines), float64. Single threaded,
// fixed loop order: bitwise deterministic and batch invariant (each token
// alone).
#include "cpu/reference/reference_math.h"

namespace mhc::reference {
namespace {

// The alpha gate of logit g: 0 pre, 1 post, 2 res (kHead has only group 0).
int Group(const LayerSpec& spec, int64_t g) {
  if (g < spec.n) return 0;
  return g < 2 * static_cast<int64_t>(spec.n) ? 1 : 2;
}

}  // namespace

void ScaleForward(const LayerSpec& spec, int64_t tokens, const double* h,
                  const double* mean_square, const Weights& w, double* h_pre,
                  double* h_post, double* logits) {
  const int n = spec.n;
  const int64_t rows = spec.NumLogits();
  const bool mhc = spec.kind == LayerKind::kMhc;
  for (int64_t m = 0; m < tokens; ++m) {
    const double r = spec.dynamic ? RmsFactor(spec, mean_square[m]) : 0.0;
    for (int64_t g = 0; g < rows; ++g) {
      double z = w.beta[g];
      if (spec.dynamic) z += w.alpha[Group(spec, g)] * h[m * rows + g] * r;
      if (g < n) {
        h_pre[m * n + g] = Sigmoid(z) + static_cast<double>(spec.eps_pre);
      } else if (!mhc) {
        continue;
      } else if (g < 2 * n) {
        h_post[m * n + (g - n)] =
            static_cast<double>(spec.post_mult) * Sigmoid(z);
      } else {
        logits[m * n * n + (g - 2 * n)] = z;
      }
    }
  }
}

void ScaleBackward(const LayerSpec& spec, int64_t tokens, const double* h,
                   const double* mean_square, const Weights& w,
                   const double* dh_pre, const double* dh_post,
                   const double* dlogits, double* dh, double* dmean_square,
                   const Grads& grads) {
  const int n = spec.n;
  const int64_t rows = spec.NumLogits();
  const int num_alpha = spec.NumAlpha();
  for (int64_t m = 0; m < tokens; ++m) {
    const double r = spec.dynamic ? RmsFactor(spec, mean_square[m]) : 0.0;
    double ms_dot = 0.0;  // sum_g dz_g alpha h_g, the chain into r
    double dalpha[3] = {0.0, 0.0, 0.0};
    for (int64_t g = 0; g < rows; ++g) {
      const int group = Group(spec, g);
      double z = w.beta[g];
      double alpha = 0.0;
      double h_g = 0.0;
      if (spec.dynamic) {
        alpha = w.alpha[group];
        h_g = h[m * rows + g];
        z += alpha * h_g * r;
      }
      const double s = Sigmoid(z);
      double dz;
      if (g < n) {
        dz = dh_pre[m * n + g] * s * (1.0 - s);
      } else if (g < 2 * n) {
        dz = dh_post[m * n + (g - n)] * static_cast<double>(spec.post_mult) *
             s * (1.0 - s);
      } else {
        dz = dlogits[m * n * n + (g - 2 * n)];
      }
      if (grads.beta != nullptr) grads.beta[g] += dz;
      if (!spec.dynamic) continue;
      dalpha[group] += dz * h_g * r;
      if (dh != nullptr) dh[m * rows + g] = alpha * dz * r;
      ms_dot += dz * alpha * h_g;
    }
    if (!spec.dynamic) continue;
    if (grads.alpha != nullptr) {
      for (int p = 0; p < num_alpha; ++p) grads.alpha[p] += dalpha[p];
    }
    if (dmean_square != nullptr) {
      dmean_square[m] = ms_dot * RmsFactorDerivative(spec, mean_square[m]);
    }
  }
}

}  // namespace mhc::reference
