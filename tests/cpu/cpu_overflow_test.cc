// The overflow contract (docs/SPEC.md section 7) on the fast CPU backend and
// on the reference's own kept-projection path: fp32 x up to 1e30 and 16-bit
// x up to the dtype's largest finite value, mixed with normal tokens and
// tokens holding an infinity or a NaN, against the float64 reference on the
// same inputs.
#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/overflow_cases.h"
#include "gtest/gtest.h"
#include "mhc/backend.h"
#include "op_harness.h"

namespace mhc::testing {
namespace {

// docs/SPEC.md section 7: fp32 outputs 1e-5 (dalpha 1e-4), 16-bit outputs
// downstream of the projection 1e-2.
double ToleranceOf(const Output& out, DType dtype) {
  if (out.activation && dtype != DType::kF32) return 1e-2;
  return out.name == "dalpha" ? 1e-4 : 1e-5;
}

// `want` is the reference's run of `op` on `oracle`; parameter gradients are
// measured against their terms (ErrorScales) where every token is finite.
void ExpectContract(const LayerSpec& spec, const Inputs& in, bool bad,
                    const std::vector<Output>& got,
                    const std::vector<Output>& want, Backend& reference,
                    OpKind op, const Inputs& oracle) {
  ASSERT_EQ(got.size(), want.size());
  const std::vector<std::vector<double>> scales =
      bad ? std::vector<std::vector<double>>(want.size())
          : ErrorScales(reference, op, oracle, want);
  for (size_t o = 0; o < got.size(); ++o) {
    ExpectOverflowContract(spec, bad, got[o].name, got[o].values,
                           want[o].values, ToleranceOf(got[o], in.dtype),
                           &scales[o]);
  }
}

Inputs OverflowInputs(const LayerSpec& spec, int64_t tokens, DType dtype,
                      bool bad) {
  Inputs in = MakeInputs(spec, tokens, dtype);
  MakeOverflowRows(spec, tokens, bad, FreshSeed(), in.x);
  ShrinkUpstreamGradient(spec.hidden, in.dy);
  return in;
}

using OverflowParam = std::tuple<std::string, DType, bool>;

class CpuOverflowTest : public ::testing::TestWithParam<OverflowParam> {};

// Every fused op and the projection, static and dynamic, gamma on and off,
// pre backward with and without the residual path, at shapes that take one
// and several kBlock blocks per token.
TEST_P(CpuOverflowTest, FusedOpsMatchReference) {
  const auto& [preset, dtype, bad] = GetParam();
  auto cpu = MakeCpuBackend(2);
  auto ref = MakeReferenceBackend();
  for (auto [n, hidden] : {std::pair{4, 37}, std::pair{2, 700}}) {
    absl::StatusOr<LayerSpec> base = PresetSpec(preset, n, hidden);
    ASSERT_TRUE(base.ok());
    for (OpKind op :
         {OpKind::kProjectionForward, OpKind::kPreForward, OpKind::kPreBackward,
          OpKind::kHeadForward, OpKind::kHeadBackward}) {
      for (int variant = 0; variant < 4; ++variant) {
        LayerSpec with = *base;
        with.dynamic = variant != 3;
        with.has_gamma = variant == 1;
        const LayerSpec spec = SpecFor(op, with);
        if (variant == 3 && spec.dynamic) continue;  // needs phi
        SCOPED_TRACE(absl::StrCat(
            OpFamilyName(op), " ", OpDirectionName(op), " n=", n,
            spec.dynamic ? " dynamic" : " static",
            spec.has_gamma ? " gamma" : "", variant == 2 ? " no-dx_next" : ""));
        Inputs in = OverflowInputs(spec, 13, dtype, bad);
        in.use_dx_next = variant != 2;
        in.keep_projection = op == OpKind::kPreForward;
        ExpectContract(spec, in, bad, RunOp(*cpu, op, in), RunOp(*ref, op, in),
                       *ref, op, in);
      }
    }
  }
}

// The layer as the server runs it: PreForward keeps its projection (h and
// the mean square, infinite where they overflow fp32), PreBackward takes it
// back; dx and the parameter gradients match the reference's backward from
// x. The reference's own forward / backward pair is held to the same.
TEST_P(CpuOverflowTest, KeptProjectionRoundTrip) {
  const auto& [preset, dtype, bad] = GetParam();
  auto cpu = MakeCpuBackend(2);
  auto ref = MakeReferenceBackend();
  absl::StatusOr<LayerSpec> base = PresetSpec(preset, 4, 37);
  ASSERT_TRUE(base.ok());
  for (bool gamma : {false, true}) {
    LayerSpec spec = SpecFor(OpKind::kPreBackward, *base);
    spec.has_gamma = gamma;
    SCOPED_TRACE(gamma ? "gamma" : "no gamma");
    Inputs in = OverflowInputs(spec, 13, dtype, bad);
    Inputs oracle = in;  // backward from x
    const std::vector<Output> want = RunOp(*ref, OpKind::kPreBackward, oracle);
    for (Backend* backend : {cpu.get(), ref.get()}) {
      SCOPED_TRACE(backend->Name());
      Inputs fwd = in;
      fwd.keep_projection = true;
      const std::vector<Output> kept =
          RunOp(*backend, OpKind::kPreForward, fwd);
      Inputs back = in;
      back.keep_projection = true;
      for (const Output& out : kept) {
        if (out.name == "h") back.h = out.values;
        if (out.name == "mean_square") back.ms = out.values;
      }
      if (dtype == DType::kF32) {
        // A huge fp32 token's mean square (1e59 or so) does not fit fp32.
        EXPECT_TRUE(std::isinf(back.ms[0])) << back.ms[0];
      }
      ExpectContract(spec, back, bad,
                     RunOp(*backend, OpKind::kPreBackward, back), want, *ref,
                     OpKind::kPreBackward, oracle);
    }
  }
}

// A huge token alone gets the bits it gets inside a batch of mixed tokens.
TEST_P(CpuOverflowTest, RepairIsBatchInvariant) {
  const auto& [preset, dtype, bad] = GetParam();
  auto cpu = MakeCpuBackend(2);
  absl::StatusOr<LayerSpec> base = PresetSpec(preset, 4, 37);
  ASSERT_TRUE(base.ok());
  for (OpKind op : {OpKind::kPreForward, OpKind::kPreBackward}) {
    const LayerSpec spec = SpecFor(op, *base);
    Inputs in = OverflowInputs(spec, 13, dtype, bad);
    in.keep_projection = op == OpKind::kPreForward;
    const std::vector<Output> all = RunOp(*cpu, op, in);
    for (int64_t m : {0, 1, 2, 12}) {
      const std::vector<Output> one = RunOp(*cpu, op, TokenSlice(in, m));
      for (size_t o = 0; o < all.size(); ++o) {
        const int64_t per = PerTokenFloats(spec, all[o].name);
        if (per == 0) continue;  // parameter gradients sum over the batch
        SCOPED_TRACE(
            absl::StrCat(OpFamilyName(op), " ", all[o].name, " token ", m));
        for (int64_t e = 0; e < per; ++e) {
          const float a = all[o].values[m * per + e], b = one[o].values[e];
          EXPECT_TRUE(a == b || (std::isnan(a) && std::isnan(b)))
              << e << ": " << a << " vs " << b;
        }
      }
    }
  }
}

// The scale op alone sees h and the mean square, not x: a token whose fp32
// mean square is far above the fused ops' repair threshold (up to the fp32
// maximum, h of its order's square root) has a finite, nonzero dms in the
// reference, about ms_dot / ms^1.5, while r^3 leaves fp32's normal range
// at ms near 1.9e25 and flushes to 0 near 8e29. Every per-token output
// within 1e-5 of the reference token by token (dms against its terms'
// magnitude where that is larger), the parameter gradients against theirs.
TEST(CpuScaleOpTest, LargeMeanSquareBackward) {
  auto cpu = MakeCpuBackend(2);
  auto ref = MakeReferenceBackend();
  const std::vector<float> mean_squares = {1.5f,  1e19f, 0x1p64f, 2e25f,
                                           1e27f, 1e29f, 1e31f,   1e34f,
                                           1e37f, 3e38f, 0x1p66f};
  const int64_t tokens = static_cast<int64_t>(mean_squares.size());
  for (const std::string& preset : PresetNames()) {
    for (int n : {4, 2}) {
      for (LayerKind kind : {LayerKind::kMhc, LayerKind::kHead}) {
        absl::StatusOr<LayerSpec> base = PresetSpec(preset, n, 64);
        ASSERT_TRUE(base.ok());
        LayerSpec spec = SpecFor(OpKind::kScaleBackward, *base);
        spec.dynamic = true;
        spec.kind = kind;
        SCOPED_TRACE(absl::StrCat(preset, " n=", n,
                                  kind == LayerKind::kHead ? " head" : ""));
        Inputs in = MakeInputs(spec, tokens, DType::kF32);
        const int64_t big_n = spec.NumLogits();
        for (int64_t m = 0; m < tokens; ++m) {
          in.ms[m] = mean_squares[m];
          const float root = std::sqrt(mean_squares[m]);
          for (int64_t g = 0; g < big_n; ++g) in.h[m * big_n + g] *= root;
        }
        const std::vector<Output> got = RunOp(*cpu, OpKind::kScaleBackward, in);
        const std::vector<Output> want =
            RunOp(*ref, OpKind::kScaleBackward, in);
        const std::vector<std::vector<double>> scales =
            ErrorScales(*ref, OpKind::kScaleBackward, in, want);
        ASSERT_EQ(got.size(), want.size());
        for (size_t o = 0; o < got.size(); ++o) {
          const std::string& name = got[o].name;
          SCOPED_TRACE(name);
          if (name != "dh" && name != "dms") {
            const double tol = name == "dalpha" ? 1e-4 : 1e-5;
            EXPECT_LE(ScaledError(got[o].values, want[o].values, scales[o]),
                      tol);
            continue;
          }
          const int64_t per = name == "dh" ? big_n : 1;
          for (int64_t m = 0; m < tokens; ++m) {
            SCOPED_TRACE(absl::StrCat("mean square ", mean_squares[m]));
            double scale = 0.0, err = 0.0;
            for (int64_t e = m * per; e < (m + 1) * per; ++e) {
              const float w = want[o].values[e];
              ASSERT_TRUE(std::isfinite(w));
              if (name == "dms") {
                ASSERT_NE(w, 0.0f);
              }
              scale = std::max(scale, std::fabs(double{w}));
              if (name == "dms") scale = std::max(scale, scales[o][e]);
              err = std::max(
                  err, std::fabs(static_cast<double>(got[o].values[e]) - w));
            }
            // A subnormal dms is only as fine as the subnormal spacing.
            EXPECT_LE(err, std::max(1e-5 * scale, SubnormalStep(DType::kF32)))
                << got[o].values[m * per] << " vs " << want[o].values[m * per];
          }
        }
      }
    }
  }
}

// The projection op's backward alone, with the dh and dms a caller passes
// for huge x (MakeProjectionGradients): x of the overflow case, with and
// without inf / NaN tokens, and (window) x near 2^63, whose mean square is
// near the fp32 maximum and whose dms is near the smallest normal float. dx
// token by token, the parameter gradients against their terms.
TEST(CpuProjectionBackwardTest, HugeTokensMatchReference) {
  auto cpu = MakeCpuBackend(2);
  auto ref = MakeReferenceBackend();
  const OpKind op = OpKind::kProjectionBackward;
  for (const char* preset : {"deepseek_v4", "transformer_engine"}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      for (auto [n, hidden] :
           {std::pair{4, 37}, std::pair{3, 37}, std::pair{4, 700}}) {
        for (int variant = 0; variant < 4; ++variant) {
          LayerSpec spec = SpecFor(op, PresetSpec(preset, n, hidden).value());
          spec.has_gamma = variant & 1;
          spec.kind = variant & 2 ? LayerKind::kHead : LayerKind::kMhc;
          for (int window = 0; window < 3; ++window) {
            const bool bad = window == 0;
            SCOPED_TRACE(absl::StrCat(
                preset, " ", DTypeName(dtype), " n=", n, " C=", hidden,
                spec.has_gamma ? " gamma" : "", variant & 2 ? " head" : "",
                bad ? " with inf/NaN tokens" : "",
                window == 2 ? " x near 2^63" : ""));
            const int64_t m = 13, k = spec.K();
            Inputs in = MakeInputs(spec, m, dtype);
            if (window == 2) {
              for (int64_t e = 0; e < m * k; ++e) {
                if (KindOf(e / k, false) == TokenKind::kNormal) continue;
                StoreActivation(in.x.data(), dtype, e,
                                std::ldexp(in.x.values[e], 63));
                in.x.values[e] = LoadActivation(in.x.data(), dtype, e);
              }
            } else {
              MakeOverflowRows(spec, m, bad, FreshSeed(), in.x);
            }
            MakeProjectionGradients(spec, m, bad, FreshSeed(), in.x, in.dh,
                                    in.dms);
            const std::vector<Output> got = RunOp(*cpu, op, in);
            const std::vector<Output> want = RunOp(*ref, op, in);
            ASSERT_EQ(got.size(), want.size());
            const std::vector<std::vector<double>> scales =
                bad ? std::vector<std::vector<double>>(want.size())
                    : ErrorScales(*ref, op, in, want);
            for (size_t o = 0; o < got.size(); ++o) {
              const double tol = ToleranceOf(got[o], dtype);
              ExpectOverflowContract(spec, bad, got[o].name, got[o].values,
                                     want[o].values, tol, &scales[o]);
              if (got[o].name == "dx") {
                // Each of the N products of a subnormal dx may round.
                ExpectTokensClose(spec, bad, "dx", got[o].values,
                                  want[o].values, tol,
                                  SubnormalStep(dtype) * spec.NumLogits());
              }
            }
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Presets, CpuOverflowTest,
    ::testing::Combine(::testing::ValuesIn(PresetNames()),
                       ::testing::Values(DType::kF32, DType::kBF16,
                                         DType::kF16),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<OverflowParam>& info) {
      return absl::StrCat(std::get<0>(info.param), "_",
                          DTypeName(std::get<1>(info.param)),
                          std::get<2>(info.param) ? "_bad" : "");
    });

}  // namespace
}  // namespace mhc::testing
