// The fast CPU backend against the fp64 reference, through the Backend
// interface, on fresh random data.
//
// Tolerances (docs/SPEC.md section 7). Errors are normwise: max |cpu - ref|
// over a tensor divided by max |ref| of that tensor, because fp32 accumulation
// error scales with the magnitude of the terms, not with an element that
// happens to cancel to ~0.
// - fp32 activations and every fp32 output (h, gates, H_res, dlogits, dH,
//   parameter gradients, for every dtype): <= 1e-5.
// - bf16/fp16 outputs of the single ops (aggregate, post, expand, and the
//   dx of projection backward): within 1 ulp of the reference rounded
//   correctly to the dtype; elements whose absolute error is below 1e-6 of
//   the tensor's max are exempt (total cancellation: no fp32 kernel can
//   decide their 16-bit rounding).
// - bf16/fp16 activation outputs of the fused pre/head ops (downstream of
//   the projection): <= 1e-2 normwise.
// - parameter gradients (sums over tokens that can cancel far below their
//   terms): <= 1e-5 of the accumulator's start plus the sum over tokens of
//   each token's |contribution| (measured with the reference token by token)
//   at small sizes, normwise at large sizes; dalpha (h enters every term, an
//   fp32 dot product of length K) at 1e-4.
// - the scale ops' per-token sums of signed terms (H_res logits, dms): <=
//   1e-5 of the same op on the inputs' magnitudes at small sizes, where a
//   tensor of one or a few tokens has nothing to average a cancelled
//   element against; normwise at large sizes.
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "mhc/backend.h"
#include "op_harness.h"

namespace mhc::testing {
namespace {

// Runs `op` on both backends with the same inputs and compares.
void CompareOp(Backend& cpu, Backend& ref, OpKind op, const LayerSpec& base,
               int64_t tokens, DType dtype, bool use_dx_next = true,
               bool keep_projection = false) {
  const LayerSpec spec = SpecFor(op, base);
  SCOPED_TRACE(absl::StrCat(
      OpFamilyName(op), " ", OpDirectionName(op), " M=", tokens, " n=", spec.n,
      " C=", spec.hidden, " ", DTypeName(dtype), " ", LayoutName(spec.layout),
      spec.dynamic ? " dynamic" : " static", spec.has_gamma ? " gamma" : "",
      spec.has_post_bias ? " bias" : "", use_dx_next ? "" : " no-dx_next",
      keep_projection ? " kept projection" : ""));
  Inputs in = MakeInputs(spec, tokens, dtype);
  in.use_dx_next = use_dx_next;
  in.keep_projection = keep_projection;
  const std::vector<Output> got = RunOp(cpu, op, in);
  const std::vector<Output> want = RunOp(ref, op, in);
  // Token-by-token reference runs give parameter gradients their proper
  // error scale; they double the reference's time, so only at small sizes.
  constexpr int64_t kScaledCheckElements = 1500000;
  if (tokens * spec.K() <= kScaledCheckElements) {
    const auto scales = ErrorScales(ref, op, in, want);
    ExpectMatchesReference(op, dtype, got, want, &scales);
  } else {
    ExpectMatchesReference(op, dtype, got, want);
  }
}

using CrossParam = std::tuple<std::string, Layout, DType>;

class CpuCrossProductTest : public ::testing::TestWithParam<CrossParam> {};

// Every op x preset x layout x dtype at a small odd shape, in the variants
// that change the math: gamma and post bias on and off, static layers, pre
// backward with and without the folded residual gradient, and the pre ops
// keeping / taking the projection.
TEST_P(CpuCrossProductTest, MatchesReference) {
  const auto& [preset, layout, dtype] = GetParam();
  auto cpu = MakeCpuBackend(2);
  auto ref = MakeReferenceBackend();
  absl::StatusOr<LayerSpec> base = PresetSpec(preset, 4, 37);
  ASSERT_TRUE(base.ok());
  base->layout = layout;
  for (OpKind op : kAllOps) {
    LayerSpec with = *base;
    with.has_gamma = true;
    with.has_post_bias = true;
    CompareOp(*cpu, *ref, op, with, 13, dtype);
    LayerSpec without = *base;
    CompareOp(*cpu, *ref, op, without, 13, dtype, /*use_dx_next=*/false);
    if (op == OpKind::kPreForward || op == OpKind::kPreBackward) {
      CompareOp(*cpu, *ref, op, with, 13, dtype, /*use_dx_next=*/true,
                /*keep_projection=*/true);
    }
    if (!NeedsDynamic(op) && op != OpKind::kSinkhornForward &&
        op != OpKind::kSinkhornBackward) {
      LayerSpec fixed = *base;
      fixed.dynamic = false;
      fixed.has_post_bias = true;
      CompareOp(*cpu, *ref, op, fixed, 13, dtype);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllPresets, CpuCrossProductTest,
    ::testing::Combine(
        ::testing::ValuesIn(PresetNames()),
        ::testing::Values(Layout::kStreamMajor, Layout::kStreamMinor),
        ::testing::Values(DType::kBF16, DType::kF16, DType::kF32)),
    [](const ::testing::TestParamInfo<CrossParam>& info) {
      return absl::StrCat(std::get<0>(info.param), "_",
                          LayoutName(std::get<1>(info.param)), "_",
                          DTypeName(std::get<2>(info.param)));
    });

// The M / C / n grid of docs/SPEC.md section 7 on a subset that keeps the fp64
// reference fast: every listed M, C and n appears, with every op, and the
// presets and layouts rotate across shapes.
struct GridShape {
  int64_t tokens;
  int64_t hidden;
  int n;
  DType dtype;
};

class CpuGridTest : public ::testing::TestWithParam<GridShape> {};

TEST_P(CpuGridTest, MatchesReference) {
  const GridShape shape = GetParam();
  auto cpu = MakeCpuBackend(2);
  auto ref = MakeReferenceBackend();
  const std::vector<std::string>& presets = PresetNames();
  const std::string& preset =
      presets[(shape.tokens + shape.hidden + shape.n) % presets.size()];
  absl::StatusOr<LayerSpec> base = PresetSpec(preset, shape.n, shape.hidden);
  ASSERT_TRUE(base.ok());
  base->has_gamma = shape.n % 2 == 0;
  base->has_post_bias = shape.hidden % 2 == 1;
  if (shape.n == 3) base->layout = Layout::kStreamMinor;
  for (OpKind op : kAllOps) {
    CompareOp(*cpu, *ref, op, *base, shape.tokens, shape.dtype);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CpuGridTest,
    ::testing::Values(
        GridShape{0, 5129, 4, DType::kBF16}, GridShape{0, 1, 16, DType::kF32},
        GridShape{1, 5129, 16, DType::kBF16},
        GridShape{1, 5129, 4, DType::kF32}, GridShape{1, 1, 1, DType::kF16},
        GridShape{13, 5129, 8, DType::kF32},
        GridShape{13, 5129, 3, DType::kBF16}, GridShape{13, 1, 2, DType::kF16},
        GridShape{137, 1, 16, DType::kBF16}, GridShape{137, 1, 4, DType::kF32},
        GridShape{137, 5129, 1, DType::kF16},
        GridShape{137, 5129, 2, DType::kBF16},
        GridShape{137, 1024, 4, DType::kF32}),
    [](const ::testing::TestParamInfo<GridShape>& info) {
      return absl::StrCat("M", info.param.tokens, "_C", info.param.hidden, "_n",
                          info.param.n, "_", DTypeName(info.param.dtype));
    });

}  // namespace
}  // namespace mhc::testing
