// Overflow repair of the projection (docs/SPEC.md section 7): tokens whose
// fp32 sum of squares or logits overflowed are recomputed from x in float64
// and kept with a power-of-two scale (cpu_ops.h, kRepairMeanSquare).
//
// Determinism and batch invariance: whether a token is repaired, and its
// repaired values, depend on that token's x and the layer alone; the
// float64 sums run in k order on one thread.
#include <cmath>

#include "cpu/fast/cpu_ops.h"

namespace mhc::cpu {
namespace {

// h[N] and the mean square of token m in float64; false when its x row is
// not finite (the token keeps its fp32 values).
bool ProjectTokenDouble(const LayerSpec& spec, DType dtype, const void* x,
                        int64_t m, const LayerWeights& w, float* v, double* h,
                        double* mean_square) {
  const int64_t k_total = spec.K();
  const int64_t big_n = spec.NumLogits();
  double squares = 0.0;
  for (int64_t g = 0; g < big_n; ++g) h[g] = 0.0;
  for (int64_t k0 = 0; k0 < k_total; k0 += kBlock) {
    const int64_t kb = std::min(kBlock, k_total - k0);
    LoadAct(dtype, x, m * k_total + k0, kb, v);
    for (int64_t k = 0; k < kb; ++k) {
      const double vk = v[k];
      squares += vk * vk;
    }
    // phi' = phi gamma rounded once (docs/SPEC.md section 2); v gamma
    // could overflow fp32.
    const float* gamma = spec.has_gamma ? w.gamma + k0 : nullptr;
    for (int64_t g = 0; g < big_n; ++g) {
      const float* row = w.phi + g * k_total + k0;
      double sum = 0.0;
      for (int64_t k = 0; k < kb; ++k) {
        const float folded = gamma != nullptr ? row[k] * gamma[k] : row[k];
        sum += static_cast<double>(folded) * v[k];
      }
      h[g] += sum;
    }
  }
  *mean_square = squares / static_cast<double>(k_total);
  return std::isfinite(*mean_square);
}

}  // namespace

int RepairExponent(double mean_square) {
  int e2 = 0;
  std::frexp(mean_square, &e2);
  return e2 > 0 ? e2 / 2 : 0;
}

bool NeedsRepair(const LayerSpec& spec, const float* h, float ms) {
  if (!(ms <= kRepairMeanSquare)) return true;  // also NaN
  const int64_t big_n = spec.NumLogits();
  for (int64_t g = 0; g < big_n; ++g) {
    if (!std::isfinite(h[g])) return true;
  }
  return false;
}

LayerSpec ScaledSpec(const LayerSpec& spec, int exponent) {
  LayerSpec scaled = spec;
  const int shift =
      spec.eps_placement == EpsPlacement::kInside ? 2 * exponent : exponent;
  scaled.eps_rms = std::ldexp(spec.eps_rms, -shift);
  return scaled;
}

void RepairGroup(const LayerSpec& spec, DType dtype, const void* x, int64_t m0,
                 int count, const LayerWeights& w, const ThreadScratch& s,
                 float* h, float* ms, int* exponent) {
  const int64_t big_n = spec.NumLogits();
  for (int t = 0; t < count; ++t) {
    exponent[t] = 0;
    float* h_t = h + t * big_n;
    if (!spec.dynamic || !NeedsRepair(spec, h_t, ms[t])) continue;
    double h_d[kMaxStreams * kMaxStreams + 2 * kMaxStreams];
    double ms_d = 0.0;
    if (!ProjectTokenDouble(spec, dtype, x, m0 + t, w, s.v, h_d, &ms_d)) {
      continue;
    }
    const int e = RepairExponent(ms_d);
    for (int64_t g = 0; g < big_n; ++g) {
      h_t[g] = static_cast<float>(std::ldexp(h_d[g], -e));
    }
    ms[t] = static_cast<float>(std::ldexp(ms_d, -2 * e));
    exponent[t] = e;
  }
}

void UnscaleProjection(const LayerSpec& spec, int exponent, const float* h_s,
                       float ms_s, float* h, float* ms) {
  const int64_t big_n = spec.NumLogits();
  for (int64_t g = 0; g < big_n; ++g) h[g] = std::ldexp(h_s[g], exponent);
  *ms = std::ldexp(ms_s, 2 * exponent);
}

}  // namespace mhc::cpu
