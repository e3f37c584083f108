// The sampled shapes and spec variants the CUDA suites run: every preset and
// dtype meets M in {0, 1, 13, 137}, C in {1, 777, 1037, 5129} (plus aligned
// widths that take the 16-byte and tensor-core paths) and n in {1, 2, 3, 4,
// 6, 8, 12, 16}, with layouts, orientations, gamma, post bias and static
// layers varied per case.
#ifndef MHC_TESTS_CUDA_CUDA_CASES_H_
#define MHC_TESTS_CUDA_CUDA_CASES_H_

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "mhc/types.h"

namespace mhc::testing {

struct Shape {
  int n;
  int64_t hidden;
  int64_t tokens;
};

inline const std::vector<Shape>& SampledShapes() {
  static const std::vector<Shape> kShapes = {
      {4, 5129, 137}, {4, 520, 137}, {4, 1, 13},     {1, 5129, 13},
      {2, 64, 137},   {3, 5, 1},     {8, 1, 137},    {16, 33, 13},
      {4, 1024, 1},   {4, 256, 0},   {2, 1, 1},      {8, 40, 13},
      {8, 1037, 13},  {2, 777, 13},  {16, 1040, 13}, {6, 520, 137},
      {12, 40, 13},   {8, 1024, 13}, {16, 1024, 1},
  };
  return kShapes;
}

// The preset's spec with per-case variations (index picks them) so every
// variant meets every preset across the sampled shapes.
inline LayerSpec CaseSpec(const std::string& preset, const Shape& shape,
                          int index) {
  LayerSpec spec = PresetSpec(preset, shape.n, shape.hidden).value();
  spec.has_gamma = index % 2 == 1;
  spec.has_post_bias = index % 3 != 2;
  if (index % 4 == 3) {
    spec.layout = spec.layout == Layout::kStreamMajor ? Layout::kStreamMinor
                                                      : Layout::kStreamMajor;
  }
  if (index % 5 == 4) {
    spec.orientation = spec.orientation == Orientation::kSourceRows
                           ? Orientation::kDestRows
                           : Orientation::kSourceRows;
  }
  spec.matmul_precision = MatmulPrecision::kIeee;
  return spec;
}

inline std::string CaseName(const LayerSpec& spec, int64_t tokens,
                            DType dtype) {
  return absl::StrCat(
      "n=", spec.n, " C=", spec.hidden, " M=", tokens, " ", DTypeName(dtype),
      " ", LayoutName(spec.layout),
      spec.orientation == Orientation::kDestRows ? " dest" : " src",
      spec.dynamic ? "" : " static", spec.has_gamma ? " gamma" : "",
      spec.has_post_bias ? " bias" : "");
}

// Norm-wise tolerance for results downstream of the projection / mixing
// math: docs/SPEC.md section 7 (ieee fp32 1e-5, 16-bit 1e-2); backward sums
// over tokens and the Sinkhorn reverse mode get 1e-4 in fp32.
inline double ForwardTol(DType dtype) {
  return dtype == DType::kF32 ? 1e-5 : 1e-2;
}
inline double BackwardTol(DType dtype) {
  return dtype == DType::kF32 ? 1e-4 : 1e-2;
}
// fp32 values reduced from 16-bit or fp32 data in fp32 (dh_pre, dH, ...).
inline constexpr double kMixTol = 1e-4;

}  // namespace mhc::testing

#endif  // MHC_TESTS_CUDA_CUDA_CASES_H_
