// Scale: logits z = alpha h r + beta and the gates, and the reverse mode.
//
// Determinism and batch invariance: each token's gates and input gradients
// come from scalar loops in a fixed order on one thread. dalpha and dbeta
// are staged per token in the workspace and then summed over tokens in
// token order by a single pass, independent of the thread count.
#include <cmath>

#include "cpu/fast/cpu_ops.h"

namespace mhc::cpu {
namespace {

inline float Sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

}  // namespace

float RmsFactor(const LayerSpec& spec, float ms) {
  if (spec.eps_placement == EpsPlacement::kInside) {
    return 1.0f / std::sqrt(ms + spec.eps_rms);
  }
  return 1.0f / (std::sqrt(ms) + spec.eps_rms);
}

float RmsFactorDerivative(const LayerSpec& spec, float ms, float r) {
  if (spec.eps_placement == EpsPlacement::kInside) return -0.5f * r * r * r;
  if (ms == 0.0f) return 0.0f;
  return -r * r / (2.0f * std::sqrt(ms));
}

void ScaleToken(const LayerSpec& spec, const LayerWeights& w, const float* h,
                float ms, float* h_pre, float* h_post, float* logits) {
  const int n = spec.n;
  const int64_t big_n = spec.NumLogits();
  const float r = spec.dynamic ? RmsFactor(spec, ms) : 0.0f;
  for (int64_t g = 0; g < big_n; ++g) {
    const float z = spec.dynamic
                        ? w.alpha[AlphaGroup(spec, g)] * h[g] * r + w.beta[g]
                        : w.beta[g];
    if (g < n) {
      h_pre[g] = Sigmoid(z) + spec.eps_pre;
    } else if (g < 2 * n) {
      h_post[g - n] = spec.post_mult * Sigmoid(z);
    } else {
      logits[g - 2 * n] = z;
    }
  }
}

void ScaleBackwardToken(const LayerSpec& spec, const LayerWeights& w,
                        const float* h, float ms, const float* dh_pre,
                        const float* dh_post, const float* dlogits, float* dz,
                        float* da, float* dh, float* dms) {
  const int n = spec.n;
  const int64_t big_n = spec.NumLogits();
  const float r = spec.dynamic ? RmsFactor(spec, ms) : 0.0f;
  for (int p = 0; p < spec.NumAlpha(); ++p) da[p] = 0.0f;
  // In double: the N products cancel, and dms is that sum alone (a single
  // token's dms came out 2.5e-5 off in fp32 against 1e-5 allowed).
  double dr = 0.0;
  for (int64_t g = 0; g < big_n; ++g) {
    const int group = AlphaGroup(spec, g);
    const float alpha = spec.dynamic ? w.alpha[group] : 0.0f;
    const float z = spec.dynamic ? alpha * h[g] * r + w.beta[g] : w.beta[g];
    float grad;
    if (g < n) {
      const float s = Sigmoid(z);
      grad = dh_pre[g] * (s * (1.0f - s));
    } else if (g < 2 * n) {
      const float s = Sigmoid(z);
      grad = dh_post[g - n] * spec.post_mult * (s * (1.0f - s));
    } else {
      grad = dlogits[g - 2 * n];
    }
    dz[g] = grad;
    if (spec.dynamic) {
      da[group] += grad * h[g] * r;
      dh[g] = alpha * grad * r;
      dr += static_cast<double>(grad) * alpha * h[g];
    }
  }
  if (spec.dynamic) {
    *dms = RmsFactorDerivative(spec, ms, r) * static_cast<float>(dr);
  }
}

// dms = ms_dot dr/dms with dr/dms about ms^-1.5: past ms near 1.9e25 that
// factor leaves fp32's normal range (near 8e29 it is 0) while dms, about
// ms_dot / ms^1.5 with ms_dot of order sqrt(ms), is still a normal float.
// Scaled as a repaired token is (h_s = h 2^-e, ms_s = ms 2^-2e, eps_rms
// scaled, ScaledSpec), r_s = r 2^e exactly, so h_s r_s = h r and the gates,
// dz and the dalpha terms are the unscaled path's bits (unless h_g 2^-e
// falls below fp32's normal range, where its terms are far below the
// others); dh = dh_s 2^-e and dms = dms_s 2^-2e.
void ScaledScaleBackwardToken(const LayerSpec& spec, const LayerWeights& w,
                              const float* h, float ms, const float* dh_pre,
                              const float* dh_post, const float* dlogits,
                              float* dz, float* da, float* dh, float* dms) {
  const int64_t big_n = spec.NumLogits();
  const int e = RepairExponent(ms);
  float h_s[kMaxStreams * kMaxStreams + 2 * kMaxStreams];
  for (int64_t g = 0; g < big_n; ++g) h_s[g] = std::ldexp(h[g], -e);
  ScaleBackwardToken(ScaledSpec(spec, e), w, h_s, std::ldexp(ms, -2 * e),
                     dh_pre, dh_post, dlogits, dz, da, dh, dms);
  for (int64_t g = 0; g < big_n; ++g) dh[g] = std::ldexp(dh[g], -e);
  *dms = std::ldexp(*dms, -2 * e);
}

void ReduceScaleGrads(const LayerSpec& spec, int64_t tokens, const float* rows,
                      int64_t stride, int64_t da_offset,
                      const LayerGrads& grads) {
  const int64_t big_n = spec.NumLogits();
  if (grads.beta != nullptr) {
    for (int64_t g = 0; g < big_n; ++g) {
      double sum = 0.0;  // cheap here, and these sums cancel heavily
      for (int64_t m = 0; m < tokens; ++m) sum += rows[m * stride + g];
      grads.beta[g] += static_cast<float>(sum);
    }
  }
  if (grads.alpha != nullptr && spec.dynamic) {
    for (int p = 0; p < spec.NumAlpha(); ++p) {
      double sum = 0.0;
      for (int64_t m = 0; m < tokens; ++m) {
        sum += rows[m * stride + da_offset + p];
      }
      grads.alpha[p] += static_cast<float>(sum);
    }
  }
}

absl::Status ScaleForward(const OpContext& ctx, const ScaleForwardParams& p) {
  const LayerSpec& spec = *p.spec;
  const int n = spec.n;
  const int64_t big_n = spec.NumLogits();
  ForTokens(ctx, p.tokens, [&](int64_t m, const ThreadScratch&) {
    const bool mhc = spec.kind == LayerKind::kMhc;
    ScaleToken(spec, p.weights, spec.dynamic ? p.h + m * big_n : nullptr,
               spec.dynamic ? p.mean_square[m] : 0.0f, p.h_pre + m * n,
               mhc ? p.h_post + m * n : nullptr,
               mhc ? p.logits + m * n * n : nullptr);
  });
  return absl::OkStatus();
}

absl::Status ScaleBackward(const OpContext& ctx, const ScaleBackwardParams& p) {
  const LayerSpec& spec = *p.spec;
  const int n = spec.n;
  const int64_t big_n = spec.NumLogits();
  const int64_t stride = big_n + 3;
  float* rows = reinterpret_cast<float*>(ctx.shared);
  ForTokens(ctx, p.tokens, [&](int64_t m, const ThreadScratch&) {
    const bool mhc = spec.kind == LayerKind::kMhc;
    float* row = rows + m * stride;
    const float ms = spec.dynamic ? p.mean_square[m] : 0.0f;
    const bool scaled =
        spec.dynamic && ms > kRepairMeanSquare && std::isfinite(ms);
    (scaled ? ScaledScaleBackwardToken : ScaleBackwardToken)(
        spec, p.weights, spec.dynamic ? p.h + m * big_n : nullptr, ms,
        p.dh_pre + m * n, mhc ? p.dh_post + m * n : nullptr,
        mhc ? p.dlogits + m * n * n : nullptr, row, row + big_n,
        spec.dynamic ? p.dh + m * big_n : nullptr,
        spec.dynamic ? p.dmean_square + m : nullptr);
  });
  ReduceScaleGrads(spec, p.tokens, rows, stride, big_n, p.grads);
  return absl::OkStatus();
}

}  // namespace mhc::cpu
