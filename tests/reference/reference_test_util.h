// Helpers of the reference suites: random float64 data, float64 finite
// differences and the gradient comparison they are held to (docs/SPEC.md
// section 7: 1e-6 relative).
#ifndef MHC_TESTS_REFERENCE_REFERENCE_TEST_UTIL_H_
#define MHC_TESTS_REFERENCE_REFERENCE_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "cpu/reference/reference_math.h"
#include "gtest/gtest.h"
#include "mhc/types.h"

namespace mhc::testing {

// Uniform in [lo, hi) in double; never all zeros.
inline std::vector<double> RandomDoubles(int64_t count, double lo = -1.0,
                                         double hi = 1.0) {
  std::vector<double> v(static_cast<size_t>(count));
  std::mt19937_64 rng(FreshSeed());
  std::uniform_real_distribution<double> dist(lo, hi);
  for (double& x : v) x = dist(rng);
  return v;
}

inline double Dot(const std::vector<double>& a, const std::vector<double>& b) {
  double sum = 0.0;
  for (size_t e = 0; e < a.size(); ++e) sum += a[e] * b[e];
  return sum;
}

// d loss / d values[k] for every k by the fourth-order central difference
// (-L(+2h) + 8 L(+h) - 8 L(-h) + L(-2h)) / 12h. The O(h^4) truncation lets a
// large step keep round-off far below the 1e-6 tolerance.
inline std::vector<double> NumericGradient(std::vector<double>& values,
                                           const std::function<double()>& loss,
                                           double step = 1e-3) {
  std::vector<double> grad(values.size());
  for (size_t k = 0; k < values.size(); ++k) {
    const double saved = values[k];
    const double h = step * std::max(1.0, std::fabs(saved));
    auto at = [&](double offset) {
      values[k] = saved + offset;
      return loss();
    };
    grad[k] = (-at(2 * h) + 8 * at(h) - 8 * at(-h) + at(-2 * h)) / (12 * h);
    values[k] = saved;
  }
  return grad;
}

// max_k |analytic - numeric| <= tol * max_k |analytic| (with a floor for
// gradients that are zero, e.g. Sinkhorn at n = 1).
inline void ExpectGradientsMatch(const std::vector<double>& analytic,
                                 const std::vector<double>& numeric,
                                 const std::string& what,
                                 double tolerance = 1e-6) {
  ASSERT_EQ(analytic.size(), numeric.size()) << what;
  double scale = 0.0;
  double worst = 0.0;
  size_t worst_index = 0;
  for (size_t k = 0; k < analytic.size(); ++k) {
    ASSERT_TRUE(std::isfinite(analytic[k])) << what << " [" << k << "]";
    scale = std::max(scale, std::fabs(analytic[k]));
    const double err = std::fabs(analytic[k] - numeric[k]);
    if (err > worst) {
      worst = err;
      worst_index = k;
    }
  }
  const double bound = tolerance * std::max(scale, 1e-6);
  EXPECT_LE(worst, bound) << what << ": worst at [" << worst_index
                          << "] analytic " << analytic[worst_index]
                          << " numeric " << numeric[worst_index]
                          << " (max |grad| " << scale << ")";
}

// A dynamic kMhc spec with small shapes for gradient checks.
inline LayerSpec SmallSpec(int n, int64_t hidden, Layout layout) {
  LayerSpec spec;
  spec.n = n;
  spec.hidden = hidden;
  spec.layout = layout;
  return spec;
}

inline std::string SpecName(const LayerSpec& spec) {
  return "n" + std::to_string(spec.n) + "_C" + std::to_string(spec.hidden) +
         "_" + std::string(LayoutName(spec.layout));
}

// The parameters of one layer as owned double vectors (random, never zero).
struct DoubleParams {
  std::vector<double> phi, alpha, beta, gamma, bias;

  static DoubleParams Random(const LayerSpec& spec) {
    DoubleParams p;
    const int64_t rows = spec.NumLogits();
    if (spec.dynamic) {
      p.phi = RandomDoubles(rows * spec.K(), -0.5, 0.5);
      p.alpha = RandomDoubles(spec.NumAlpha(), 0.5, 1.5);
    }
    p.beta = RandomDoubles(rows, -1.0, 1.0);
    if (spec.has_gamma) p.gamma = RandomDoubles(spec.K(), 0.5, 1.5);
    if (spec.has_post_bias) p.bias = RandomDoubles(spec.hidden, -1.0, 1.0);
    return p;
  }

  reference::Weights View() const {
    auto ptr = [](const std::vector<double>& v) {
      return v.empty() ? nullptr : v.data();
    };
    return {ptr(phi), ptr(alpha), ptr(beta), ptr(gamma), ptr(bias)};
  }

  // Zeroed gradient accumulators of the same shapes.
  DoubleParams ZerosLike() const {
    DoubleParams g;
    g.phi.assign(phi.size(), 0.0);
    g.alpha.assign(alpha.size(), 0.0);
    g.beta.assign(beta.size(), 0.0);
    g.gamma.assign(gamma.size(), 0.0);
    g.bias.assign(bias.size(), 0.0);
    return g;
  }

  reference::Grads GradView() {
    auto ptr = [](std::vector<double>& v) {
      return v.empty() ? nullptr : v.data();
    };
    return {ptr(phi), ptr(alpha), ptr(beta), ptr(gamma), ptr(bias)};
  }
};

}  // namespace mhc::testing

#endif  // MHC_TESTS_REFERENCE_REFERENCE_TEST_UTIL_H_
