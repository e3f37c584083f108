// Inputs at the edge of the activation range and the overflow contract of
// docs/SPEC.md section 7, shared by the CPU and CUDA suites: tokens whose x
// is finite but whose fp32 sum of squares overflows get finite outputs
// within the usual tolerances of the float64 reference; tokens with an
// infinite or NaN x get non-finite outputs where the reference has them,
// and no other token's outputs change.
#ifndef MHC_TESTS_COMMON_OVERFLOW_CASES_H_
#define MHC_TESTS_COMMON_OVERFLOW_CASES_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "gtest/gtest.h"
#include "mhc/backend.h"

namespace mhc::testing {

// What a token of an overflow case holds.
enum class TokenKind { kNormal, kHuge, kInfinite, kNaN };

// Token m's kind: huge and normal tokens interleaved, and with `bad` one
// token with an infinite element and one with a NaN.
inline TokenKind KindOf(int64_t m, bool bad) {
  if (bad && m % 5 == 3)
    return m % 10 == 3 ? TokenKind::kInfinite : TokenKind::kNaN;
  return m % 3 == 1 ? TokenKind::kNormal : TokenKind::kHuge;
}

// The largest magnitude the case gives x of `dtype`: fp32 reaches 1e30,
// the 16-bit types their largest finite value.
inline float HugeOf(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return Bf16ToFloat(0x7F7F);  // largest finite bf16
    case DType::kF16:
      return 65504.0f;
    default:
      return 1e30f;
  }
}

// Rewrites the x rows of `x` ([tokens, K] in `spec`'s layout) by kind: a
// huge token is uniform in +-huge / (2 n) with one element at +-huge whose
// channel's other streams are 0, so that y = sum_i H_pre[i] x[i] (H_pre
// <= 1 + eps_pre) stays finite in every dtype.
inline void MakeOverflowRows(const LayerSpec& spec, int64_t tokens, bool bad,
                             uint64_t seed, ActTensor& x) {
  const int64_t k = spec.K();
  const float huge = HugeOf(x.dtype);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int64_t> channel(0, spec.hidden - 1);
  std::uniform_int_distribution<int> stream(0, spec.n - 1);
  auto set = [&](int64_t m, int i, int64_t c, float value) {
    const int64_t at = m * k + spec.XIndex(i, c);
    StoreActivation(x.data(), x.dtype, at, value);
    x.values[at] = LoadActivation(x.data(), x.dtype, at);
  };
  for (int64_t m = 0; m < tokens; ++m) {
    const TokenKind kind = KindOf(m, bad);
    if (kind == TokenKind::kNormal) continue;
    const float spread = huge / static_cast<float>(2 * spec.n);
    for (int i = 0; i < spec.n; ++i) {
      for (int64_t c = 0; c < spec.hidden; ++c) {
        set(m, i, c, unit(rng) * spread);
      }
    }
    const int64_t c0 = channel(rng);
    const int i0 = stream(rng);
    for (int i = 0; i < spec.n; ++i) set(m, i, c0, 0.0f);
    const float sign = unit(rng) < 0.0f ? -1.0f : 1.0f;
    float special = sign * huge;
    if (kind == TokenKind::kInfinite) {
      special = sign * std::numeric_limits<float>::infinity();
    } else if (kind == TokenKind::kNaN) {
      special = std::numeric_limits<float>::quiet_NaN();
    }
    set(m, i0, c0, special);
  }
}

// dy for x near the bf16 maximum: dH_pre = sum_c dy[c] x[i][c] and the
// parameter gradients built from it (dbeta, dalpha: sums of dz over tokens)
// are gradients of the math itself and overflow fp32 with dy of order 1, as
// the reference's do. Scaled by a power of two below 1 / (256 C), they fit.
inline void ShrinkUpstreamGradient(int64_t hidden, ActTensor& dy) {
  if (dy.dtype != DType::kBF16) return;
  const float scale =
      std::ldexp(1.0f, -8 - static_cast<int>(std::ceil(std::log2(hidden))));
  for (int64_t e = 0; e < dy.size(); ++e) {
    StoreActivation(dy.data(), dy.dtype, e, dy.values[e] * scale);
    dy.values[e] = LoadActivation(dy.data(), dy.dtype, e);
  }
}

// The projection backward's dh [tokens, N] and dms [tokens] for the huge
// tokens of a case whose x is given; normal and bad tokens keep theirs. A
// huge token's dh is about 1 / rms(x), as the scale op's backward gives it
// (so dh v, its dphi term, is of order 1); its dms by turns is about 1 / ms
// (the scale op's, 0 in fp32 where ms is far above the fp32 range), a
// subnormal (whose product with 2 / K underflows further while dms x is
// well inside the fp32 range), or of order 1 (dms x as large as dx gets).
inline void MakeProjectionGradients(const LayerSpec& spec, int64_t tokens,
                                    bool bad, uint64_t seed, const ActTensor& x,
                                    std::vector<float>& dh,
                                    std::vector<float>& dms) {
  const int64_t k = spec.K(), big_n = spec.NumLogits();
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  for (int64_t m = 0; m < tokens; ++m) {
    if (KindOf(m, bad) != TokenKind::kHuge) continue;
    double squares = 0.0;
    for (int64_t e = m * k; e < (m + 1) * k; ++e) {
      squares += static_cast<double>(x.values[e]) * x.values[e];
    }
    const double ms = squares / static_cast<double>(k);
    const double rms = std::sqrt(ms);
    for (int64_t g = 0; g < big_n; ++g) {
      dh[m * big_n + g] = static_cast<float>(unit(rng) / rms);
    }
    switch (m / 3 % 3) {
      case 0:
        dms[m] = static_cast<float>(unit(rng) / ms);
        break;
      case 1:
        dms[m] = static_cast<float>(std::ldexp(unit(rng), -130));
        break;
      default:
        dms[m] = static_cast<float>(unit(rng));
        break;
    }
  }
}

// Floats per token of a per-token output, or 0 for parameter gradients.
inline int64_t PerTokenFloats(const LayerSpec& spec, const std::string& name) {
  const int64_t n = spec.n;
  if (name == "y") return spec.hidden;
  if (name == "dx" || name == "x") return spec.K();
  if (name == "h_pre" || name == "h_post" || name == "mix") return n;
  if (name == "h_res") return n * n;
  if (name == "h") return spec.NumLogits();
  if (name == "mean_square") return 1;
  return 0;
}

// Whether the true value of a kept projection output may exceed fp32: h and
// the mean square of a huge token, infinite in fp32 as in the reference
// rounded to fp32.
inline bool MayOverflow(const std::string& name) {
  return name == "h" || name == "mean_square";
}

// Checks one output of a case: per-token outputs of finite tokens finite
// (except a kept h / mean square that the reference also overflows) and
// within `tol` normwise of the reference over those tokens; outputs of bad
// tokens non-finite exactly where the reference's are, and close elsewhere;
// parameter gradients within `tol` normwise, or, with bad tokens, non-finite
// exactly where the reference's are. `scale`, when given, is what the error
// is measured against instead of the reference's values: a parameter
// gradient's terms, which its sum over tokens can cancel far below.
inline void ExpectOverflowContract(const LayerSpec& spec, bool bad,
                                   const std::string& name,
                                   const std::vector<float>& got,
                                   const std::vector<float>& ref, double tol,
                                   const std::vector<double>* scale = nullptr) {
  SCOPED_TRACE(name);
  ASSERT_EQ(got.size(), ref.size());
  const int64_t per = PerTokenFloats(spec, name);
  double max_ref = 0.0, max_err = 0.0;
  int64_t mismatched = 0, nonfinite = 0;
  for (size_t e = 0; e < got.size(); ++e) {
    const bool token_bad = per > 0 && KindOf(static_cast<int64_t>(e) / per,
                                             bad) >= TokenKind::kInfinite;
    const bool whole_bad = per == 0 && bad;
    const bool ref_finite = std::isfinite(ref[e]);
    if (token_bad || whole_bad || (MayOverflow(name) && !ref_finite)) {
      if (std::isfinite(got[e]) != ref_finite) ++mismatched;
      if (!ref_finite || whole_bad) continue;
    } else if (!std::isfinite(got[e]) || !ref_finite) {
      ++nonfinite;
      continue;
    }
    max_ref = std::max(max_ref, scale != nullptr && !scale->empty()
                                    ? (*scale)[e]
                                    : std::fabs(static_cast<double>(ref[e])));
    max_err =
        std::max(max_err, std::fabs(static_cast<double>(got[e]) - ref[e]));
  }
  EXPECT_EQ(nonfinite, 0) << "non-finite outputs of finite tokens";
  EXPECT_EQ(mismatched, 0) << "finite where the reference is not, or back";
  EXPECT_LE(max_ref == 0.0 ? max_err : max_err / max_ref, tol);
}

// The spacing of `dtype`'s subnormals: where a reference output is itself
// subnormal, one rounding step of an fp32 sum is this much of it.
inline double SubnormalStep(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return std::ldexp(1.0, -133);
    case DType::kF16:
      return std::ldexp(1.0, -24);
    default:
      return std::ldexp(1.0, -149);
  }
}

// Per-token outputs of a case's finite tokens, token by token: within `tol`
// of the largest magnitude of the reference's token, or within `floor`
// (absolute) where that is larger. A huge token's outputs can be far below
// a normal token's, where a check over the whole tensor would not see them.
inline void ExpectTokensClose(const LayerSpec& spec, bool bad,
                              const std::string& name,
                              const std::vector<float>& got,
                              const std::vector<float>& ref, double tol,
                              double floor) {
  SCOPED_TRACE(name);
  ASSERT_EQ(got.size(), ref.size());
  const int64_t per = PerTokenFloats(spec, name);
  ASSERT_GT(per, 0);
  for (int64_t m = 0; m * per < static_cast<int64_t>(got.size()); ++m) {
    if (KindOf(m, bad) >= TokenKind::kInfinite) continue;
    double max_ref = 0.0, max_err = 0.0;
    int64_t worst = m * per;
    for (int64_t e = m * per; e < (m + 1) * per; ++e) {
      ASSERT_TRUE(std::isfinite(ref[e])) << "token " << m << " element " << e;
      max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref[e])));
      double err = std::fabs(static_cast<double>(got[e]) - ref[e]);
      if (std::isnan(err)) err = INFINITY;
      if (err > max_err) {
        max_err = err;
        worst = e;
      }
    }
    EXPECT_LE(max_err, std::max(tol * max_ref, floor))
        << "token " << m << " (largest " << max_ref << "): " << got[worst]
        << " vs " << ref[worst];
  }
}

}  // namespace mhc::testing

#endif  // MHC_TESTS_COMMON_OVERFLOW_CASES_H_
