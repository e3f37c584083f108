#include "mhc/client/compare.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_format.h"

namespace mhc::client {

std::string Comparison::ToString() const {
  if (!sizes_match) return "size mismatch";
  if (!finite) return absl::StrFormat("non-finite at %d", worst_index);
  return absl::StrFormat("%.3g (at %d)", error, worst_index);
}

Comparison Compare(absl::Span<const float> got, absl::Span<const float> want,
                   double floor_fraction) {
  Comparison c;
  if (got.size() != want.size()) {
    c.sizes_match = false;
    c.error = std::numeric_limits<double>::quiet_NaN();
    return c;
  }
  double scale = 0.0;
  for (float w : want) {
    if (std::isfinite(w)) scale = std::max(scale, std::fabs(double{w}));
  }
  double floor = std::max(scale * floor_fraction,
                          double{std::numeric_limits<float>::min()});
  for (size_t i = 0; i < got.size(); ++i) {
    double g = got[i];
    double w = want[i];
    if (!std::isfinite(g)) {
      // A non-finite output is only right where the reference is identical.
      bool same = (std::isnan(g) && std::isnan(w)) || g == w;
      if (!same) {
        c.finite = false;
        c.worst_index = static_cast<int64_t>(i);
        c.error = std::numeric_limits<double>::quiet_NaN();
        return c;
      }
      continue;
    }
    double error = std::fabs(g - w) / std::max(std::fabs(w), floor);
    if (c.worst_index < 0 || error > c.error) {
      c.error = error;
      c.worst_index = static_cast<int64_t>(i);
    }
  }
  return c;
}

double MaxColumnSumError(absl::Span<const float> h_res, int n) {
  if (n <= 0) return 0.0;
  size_t per_token = static_cast<size_t>(n) * n;
  double worst = 0.0;
  for (size_t base = 0; base + per_token <= h_res.size(); base += per_token) {
    for (int j = 0; j < n; ++j) {
      double sum = 0.0;
      for (int i = 0; i < n; ++i) sum += h_res[base + i * n + j];
      double error = std::fabs(sum - 1.0);
      if (!(error <= worst)) worst = error;  // NaN propagates as worst
    }
  }
  return worst;
}

bool AllFinite(absl::Span<const float> values) {
  return std::all_of(values.begin(), values.end(),
                     [](float v) { return std::isfinite(v); });
}

}  // namespace mhc::client
