// Error measures used to check the daemon's outputs against the float64
// reference (docs/SPEC.md section 7).
#ifndef MHC_CLIENT_COMPARE_H_
#define MHC_CLIENT_COMPARE_H_

#include <cstdint>
#include <string>

#include "absl/types/span.h"

namespace mhc::client {

struct Comparison {
  // max_i |got_i - want_i| / max(|want_i|, floor), floor = floor_fraction *
  // max_j |want_j|: relative per element, except that elements far below the
  // tensor's scale are measured against that scale. Such elements come from
  // cancellation in fp32 sums, whose rounding error is proportional to the
  // terms, not to the (small) result, so a pure per-element ratio would
  // measure the cancellation rather than the kernel. NaN when `got` is not
  // finite where `want` is, or the sizes differ.
  double error = 0.0;
  int64_t worst_index = -1;
  bool finite = true;  // every element of `got` is finite
  bool sizes_match = true;

  bool Within(double tolerance) const {
    return sizes_match && finite && error <= tolerance;
  }
  std::string ToString() const;
};

Comparison Compare(absl::Span<const float> got, absl::Span<const float> want,
                   double floor_fraction = 0.1);

// Largest |sum_i H[m][i][j] - 1| over tokens m and columns j of H_res.
double MaxColumnSumError(absl::Span<const float> h_res, int n);

bool AllFinite(absl::Span<const float> values);

}  // namespace mhc::client

#endif  // MHC_CLIENT_COMPARE_H_
