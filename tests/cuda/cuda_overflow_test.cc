// The overflow contract (docs/SPEC.md section 7) on the CUDA backend: fp32 x
// up to 1e30 and 16-bit x up to the dtype's largest finite value, mixed with
// normal tokens and tokens holding an infinity or a NaN, through the fused
// pre forward (keeping its projection) and the pre backward from x (with and
// without the phi gradient) and from that kept projection, against the
// float64 reference on the same inputs; n = 4 and the stream counts whose
// mHC layers split the mixing into the scale and Sinkhorn op kernels; the
// projection op alone; the scale op backward alone at mean squares up
// to the fp32 maximum; and the projection op backward alone, with the dh
// and dms a caller passes for huge x. Widths 37, 1024 and 5129 take different
// projection and dx variants. Skips without a GPU.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/overflow_cases.h"
#include "cuda/cuda_harness.h"
#include "gtest/gtest.h"
#include "projection/plan.h"

namespace mhc::testing {
namespace {

std::vector<float> Floats(const std::vector<uint8_t>& bytes, DType dtype) {
  const int64_t count = bytes.size() / DTypeSize(dtype);
  std::vector<float> out(count);
  for (int64_t e = 0; e < count; ++e) {
    out[e] = LoadActivation(bytes.data(), dtype, e);
  }
  return out;
}

struct Outputs {
  std::vector<std::pair<std::string, std::vector<float>>> named;
};

// Pre forward with the kept projection, then pre backward from x, from the
// kept projection, and from x without the phi gradient, on backend b (0 the
// reference, 1 CUDA). Each batch mixes repaired and unrepaired tokens.
Outputs RunLayer(Harness& h, int b, const LayerSpec& spec, int64_t m, DType dt,
                 ActTensor& x, ActTensor& dy, ActTensor& dx_next) {
  const int64_t n = spec.n, c = spec.hidden, k = spec.K();
  const int64_t big_n = spec.NumLogits();
  const float scale = 3.0f / std::sqrt(static_cast<float>(k));
  uint64_t seed = 1000;  // the same parameters on both backends
  Pair phi = h.Floats(big_n * k, ++seed, -scale, scale);
  Pair alpha = h.Floats(3, ++seed, 0.5f, 1.5f);
  Pair beta = h.Floats(big_n, ++seed);
  Pair gamma = h.Floats(k, ++seed, 0.5f, 1.5f);
  Pair dh_post = h.Floats(m * n, ++seed);
  Pair dh_res = h.Floats(m * n * n, ++seed);
  Pair xp = h.Input(x.data(), x.bytes.size());
  Pair dyp = h.Input(dy.data(), dy.bytes.size());
  Pair dnp = h.Input(dx_next.data(), dx_next.bytes.size());
  LayerWeights w;
  w.phi = phi.f(b);
  w.alpha = alpha.f(b);
  w.beta = beta.f(b);
  w.gamma = spec.has_gamma ? gamma.f(b) : nullptr;
  auto fetch = [&](Pair& p) {
    return b == 0
               ? std::vector<uint8_t>(p.host.begin(), p.host.begin() + p.bytes)
               : h.Fetch(p);
  };
  Outputs out;
  const bool mhc = spec.kind == LayerKind::kMhc;
  Pair y = h.Output(m * c * DTypeSize(dt)), hp = h.Output(m * n * 4);
  Pair hq = h.Output(m * n * 4), hr = h.Output(m * n * n * 4);
  Pair kh = h.Output(m * big_n * 4), kms = h.Output(m * 4);
  if (mhc) {
    PreForwardParams p{&spec,   m,       dt,      xp.ptr(b), w,       y.ptr(b),
                       hp.f(b), hq.f(b), hr.f(b), kh.f(b),   kms.f(b)};
    EXPECT_TRUE(
        h.backend(b)
            .PreForward(p, h.Scratch(b, OpKind::kPreForward, spec, m, dt))
            .ok());
    out.named = {{"y", Floats(fetch(y), dt)},
                 {"h_pre", Floats(fetch(hp), DType::kF32)},
                 {"h_post", Floats(fetch(hq), DType::kF32)},
                 {"h_res", Floats(fetch(hr), DType::kF32)},
                 {"h", Floats(fetch(kh), DType::kF32)},
                 {"mean_square", Floats(fetch(kms), DType::kF32)}};
  } else {
    HeadForwardParams p{&spec, m, dt, xp.ptr(b), w, y.ptr(b), hp.f(b)};
    EXPECT_TRUE(
        h.backend(b)
            .HeadForward(p, h.Scratch(b, OpKind::kHeadForward, spec, m, dt))
            .ok());
    out.named = {{"y", Floats(fetch(y), dt)},
                 {"mix", Floats(fetch(hp), DType::kF32)}};
  }
  // Pass 0 from x, 1 from the kept projection (mHC layers), 2 from x with
  // no phi gradient asked for: the repair pass, which rides on the dphi
  // reduction, then rides on the one for dgamma (gamma layers) or runs as a
  // kernel of its own (no reduction at all).
  for (int pass = 0; pass < 3; ++pass) {
    const bool kept = pass == 1, no_phi = pass == 2;
    if (kept && !mhc) continue;
    Pair dx = h.Output(m * k * DTypeSize(dt));
    Pair g_phi = h.Floats(big_n * k, 77), g_alpha = h.Floats(3, 78);
    Pair g_beta = h.Floats(big_n, 79), g_gamma = h.Floats(k, 80);
    LayerGrads grads{no_phi ? nullptr : g_phi.f(b), g_alpha.f(b), g_beta.f(b),
                     spec.has_gamma ? g_gamma.f(b) : nullptr, nullptr};
    absl::Status status;
    if (mhc) {
      PreBackwardParams p;
      p.spec = &spec;
      p.tokens = m;
      p.act_dtype = dt;
      p.x = xp.ptr(b);
      p.weights = w;
      p.dy = dyp.ptr(b);
      p.dh_post = dh_post.f(b);
      p.dh_res = dh_res.f(b);
      p.dx_next = dnp.ptr(b);
      p.dx = dx.ptr(b);
      p.grads = grads;
      if (kept) {
        p.h = kh.f(b);
        p.mean_square = kms.f(b);
      }
      status = h.backend(b).PreBackward(
          p, h.Scratch(b, OpKind::kPreBackward, spec, m, dt));
    } else {
      HeadBackwardParams p{&spec, m,          dt,        xp.ptr(b),
                           w,     dyp.ptr(b), dx.ptr(b), grads};
      status = h.backend(b).HeadBackward(
          p, h.Scratch(b, OpKind::kHeadBackward, spec, m, dt));
    }
    EXPECT_TRUE(status.ok()) << status;
    out.named.push_back({"dx", Floats(fetch(dx), dt)});
    if (!no_phi) {
      out.named.push_back({"dphi", Floats(fetch(g_phi), DType::kF32)});
    }
    out.named.push_back({"dbeta", Floats(fetch(g_beta), DType::kF32)});
    if (spec.has_gamma) {
      out.named.push_back({"dgamma", Floats(fetch(g_gamma), DType::kF32)});
    }
  }
  return out;
}

// One fused-op case: a preset with n streams, an activation dtype and a
// width, run over the variants (bit 0: gamma, bit 1: IEEE matmuls) as mHC
// layers, and as head layers when `head`. Width 37 carries the bad (inf /
// NaN) tokens. One gtest instance per case, so that a sanitizer run can be
// split into shards (GTEST_TOTAL_SHARDS / GTEST_SHARD_INDEX).
struct FusedCase {
  std::string preset;
  int n = 4;
  DType dtype = DType::kF32;
  int64_t hidden = 0;
  std::vector<int> variants;
  bool head = false;
  int64_t tokens = 13;
};

void ExpectCase(const FusedCase& c) {
  Harness h;
  for (int variant : c.variants) {
    absl::StatusOr<LayerSpec> base = PresetSpec(c.preset, c.n, c.hidden);
    ASSERT_TRUE(base.ok());
    LayerSpec spec = *base;
    spec.has_gamma = variant & 1;
    spec.matmul_precision =
        variant & 2 ? MatmulPrecision::kIeee : MatmulPrecision::kTf32;
    const bool bad = c.hidden == 37;
    for (LayerKind kind : {LayerKind::kMhc, LayerKind::kHead}) {
      if (kind == LayerKind::kHead && !c.head) continue;
      spec.kind = kind;
      SCOPED_TRACE(absl::StrCat(spec.has_gamma ? "gamma" : "no gamma",
                                variant & 2 ? " ieee" : " tf32",
                                kind == LayerKind::kHead ? " head" : "",
                                bad ? " with inf/NaN tokens" : ""));
      const DType dt = c.dtype;
      const int64_t m = c.tokens;
      ActTensor x = RandomAct(dt, m * spec.K(), FreshSeed());
      MakeOverflowRows(spec, m, bad, FreshSeed(), x);
      ActTensor dy = RandomAct(dt, m * c.hidden, FreshSeed());
      ShrinkUpstreamGradient(c.hidden, dy);
      ActTensor dx_next = RandomAct(dt, m * spec.K(), FreshSeed());
      const Outputs want = RunLayer(h, 0, spec, m, dt, x, dy, dx_next);
      const Outputs got = RunLayer(h, 1, spec, m, dt, x, dy, dx_next);
      ASSERT_EQ(got.named.size(), want.named.size());
      const bool ieee = variant & 2;
      for (size_t o = 0; o < got.named.size(); ++o) {
        const std::string& name = got.named[o].first;
        const bool act16 = dt != DType::kF32 && (name == "y" || name == "dx");
        const bool grad = name[0] == 'd' && name != "dx";
        const double tol = act16  ? 1e-2
                           : grad ? (ieee ? 1e-3 : 1e-2)
                                  : (ieee ? 1e-4 : 2e-3);
        ExpectOverflowContract(spec, bad, name, got.named[o].second,
                               want.named[o].second, tol);
      }
    }
  }
}

// n = 4: the fused mixing kernels (sinkhorn4.cuh's form where it applies),
// every preset, dtype and width, each variant, mHC and head layers.
std::vector<FusedCase> StreamCount4Cases() {
  std::vector<FusedCase> cases;
  for (const std::string& preset : PresetNames()) {
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (int64_t hidden : {37, 1024, 5129}) {
        cases.push_back({preset, 4, dt, hidden, {0, 1, 2, 3}, true});
      }
    }
  }
  return cases;
}

// n other than 4: mHC layers whose Sinkhorn the lane kernels cover run the
// scale and Sinkhorn op kernels (SplitMix in fused_pre.cu), the LOG preset
// and head layers the fused mixing kernels at other register widths. f16
// x never overflows the mean square; fp32 and bf16 do.
std::vector<FusedCase> OtherStreamCountCases() {
  std::vector<FusedCase> cases;
  for (int n : {2, 3, 6, 8}) {
    for (const std::string& preset : PresetNames()) {
      for (DType dt : {DType::kF32, DType::kBF16}) {
        for (int64_t hidden : {37, 1024}) {
          cases.push_back({preset, n, dt, hidden, {1, 2}, hidden == 37});
        }
      }
    }
  }
  return cases;
}

std::string CaseName(const ::testing::TestParamInfo<FusedCase>& info) {
  const FusedCase& c = info.param;
  return absl::StrCat(c.preset, "_n", c.n, "_", DTypeName(c.dtype), "_C",
                      c.hidden);
}

class CudaOverflowFusedTest : public ::testing::TestWithParam<FusedCase> {};

TEST_P(CudaOverflowFusedTest, MatchesReference) {
  MHC_SKIP_WITHOUT_GPU();
  ExpectCase(GetParam());
}

INSTANTIATE_TEST_SUITE_P(StreamCount4, CudaOverflowFusedTest,
                         ::testing::ValuesIn(StreamCount4Cases()), CaseName);
INSTANTIATE_TEST_SUITE_P(OtherStreamCounts, CudaOverflowFusedTest,
                         ::testing::ValuesIn(OtherStreamCountCases()),
                         CaseName);

// The pre backward's repair pass inside the n = 4 warpgroup dx kernel of a
// one-chunk batch, at a token count whose chunk splits over four CTAs: the
// pass of the last to finish rewrites dx rows the others stored.
TEST(CudaOverflowTest, RepairInTheSplitDxKernel) {
  FusedCase c{"deepseek_v4", 4, DType::kBF16, 1024, {0, 1}};
  c.tokens = 200;
  LayerSpec spec = PresetSpec(c.preset, c.n, c.hidden).value();
  spec.matmul_precision = MatmulPrecision::kTf32;
  cuda::DxTerms terms;
  terms.aggregate = terms.residual = true;
  const cuda::ProjectionBackwardPlan plan =
      cuda::PlanProjectionBackward(spec, c.dtype, c.tokens, {}, terms);
  ASSERT_EQ(plan.variant, cuda::ProjectionBackwardVariant::kWgmmaN4Terms);
  ASSERT_TRUE(plan.grads_in_kernel);
  ASSERT_EQ(plan.chunk_ctas, 4);
  MHC_SKIP_WITHOUT_GPU();
  ExpectCase(c);
}

// The projection op alone: tokens whose fp32 sum of squares overflows while
// their mean square fits fp32 (fp32 x near 4e18) get the float64 values,
// as do the tokens of the overflow case; inf / NaN tokens stay non-finite.
// The finish kernel repairs them in CTAs of whole tokens: 13 tokens span
// two CTAs at n = 4 (25 elements a token) and one at n = 3; n = 16 rows
// (289 elements) take a CTA each.
TEST(CudaOverflowTest, ProjectionOpMatchesReference) {
  MHC_SKIP_WITHOUT_GPU();
  Harness h;
  for (int n : {4, 3, 16}) {
    for (DType dt : {DType::kF32, DType::kBF16}) {
      for (int window = 0; window < 2; ++window) {
        if (window == 1 && dt != DType::kF32) continue;
        absl::StatusOr<LayerSpec> base = PresetSpec("deepseek_v4", n, 1024);
        ASSERT_TRUE(base.ok());
        LayerSpec spec = *base;
        spec.has_gamma = true;
        const bool bad = window == 0;
        SCOPED_TRACE(absl::StrCat("n=", n, " ", DTypeName(dt),
                                  window ? " mean square near 1e37" : ""));
        const int64_t m = 13, k = spec.K(), big_n = spec.NumLogits();
        ActTensor x = RandomAct(dt, m * k, FreshSeed());
        if (window == 1) {
          for (int64_t e = 0; e < x.size(); ++e) {
            if (KindOf(e / k, false) == TokenKind::kNormal) continue;
            StoreActivation(x.data(), dt, e, x.values[e] * 4e18f);
            x.values[e] = LoadActivation(x.data(), dt, e);
          }
        } else {
          MakeOverflowRows(spec, m, bad, FreshSeed(), x);
        }
        const float scale = 3.0f / std::sqrt(static_cast<float>(k));
        Pair phi = h.Floats(big_n * k, 11, -scale, scale);
        Pair gamma = h.Floats(k, 12, 0.5f, 1.5f);
        Pair xp = h.Input(x.data(), x.bytes.size());
        std::vector<float> outs[2][2];
        for (int b : {0, 1}) {
          Pair hv = h.Output(m * big_n * 4), ms = h.Output(m * 4);
          LayerWeights w;
          w.phi = phi.f(b);
          w.gamma = gamma.f(b);
          ProjectionForwardParams p{&spec, m,       dt,     xp.ptr(b),
                                    w,     hv.f(b), ms.f(b)};
          const absl::Status status = h.backend(b).ProjectionForward(
              p, h.Scratch(b, OpKind::kProjectionForward, spec, m, dt));
          EXPECT_TRUE(status.ok()) << status;
          auto fetch = [&](Pair& q) {
            return b == 0 ? std::vector<uint8_t>(q.host.begin(),
                                                 q.host.begin() + q.bytes)
                          : h.Fetch(q);
          };
          outs[b][0] = Floats(fetch(hv), DType::kF32);
          outs[b][1] = Floats(fetch(ms), DType::kF32);
        }
        ExpectOverflowContract(spec, bad, "h", outs[1][0], outs[0][0], 1e-4);
        ExpectOverflowContract(spec, bad, "mean_square", outs[1][1], outs[0][1],
                               1e-4);
      }
    }
  }
}

// The projection op's backward alone, with the dh and dms a caller passes
// for huge x (MakeProjectionGradients): fp32 x up to 1e30 and bf16 x up to
// its largest finite value, with and without inf / NaN tokens, and x near
// 2^63 (mean square near the fp32 maximum, dms near the smallest normal
// float). n = 4, 3, 8 and 12 with widths 37 and 1024 take the mma, wgmma_n4,
// wgmma_n8 and wide dx kernels, each with its own dms term. dx token by
// token (a huge token's dx is far below a normal token's), the parameter
// gradients over the whole tensor.
TEST(CudaOverflowTest, ProjectionOpBackwardMatchesReference) {
  MHC_SKIP_WITHOUT_GPU();
  for (int n : {4, 3, 8, 12}) {
    Harness h;  // its buffers freed after each n
    for (DType dt : {DType::kF32, DType::kBF16}) {
      for (int64_t hidden : {37, 1024}) {
        for (int variant = 0; variant < 8; ++variant) {
          LayerSpec spec = PresetSpec("deepseek_v4", n, hidden).value();
          spec.has_gamma = variant & 1;
          const bool ieee = variant & 2;
          spec.matmul_precision =
              ieee ? MatmulPrecision::kIeee : MatmulPrecision::kTf32;
          spec.kind = variant & 4 ? LayerKind::kHead : LayerKind::kMhc;
          for (int window = 0; window < 3; ++window) {
            const bool bad = window == 0;
            SCOPED_TRACE(absl::StrCat(
                "n=", n, " ", DTypeName(dt), " C=", hidden,
                spec.has_gamma ? " gamma" : "", ieee ? " ieee" : " tf32",
                variant & 4 ? " head" : "", bad ? " with inf/NaN tokens" : "",
                window == 2 ? " x near 2^63" : ""));
            const int64_t m = 13, k = spec.K(), big_n = spec.NumLogits();
            ActTensor x = RandomAct(dt, m * k, FreshSeed());
            if (window == 2) {
              for (int64_t e = 0; e < x.size(); ++e) {
                if (KindOf(e / k, false) == TokenKind::kNormal) continue;
                StoreActivation(x.data(), dt, e, std::ldexp(x.values[e], 63));
                x.values[e] = LoadActivation(x.data(), dt, e);
              }
            } else {
              MakeOverflowRows(spec, m, bad, FreshSeed(), x);
            }
            std::vector<float> dh = RandomFloats(m * big_n, FreshSeed());
            std::vector<float> dms = RandomFloats(m, FreshSeed());
            MakeProjectionGradients(spec, m, bad, FreshSeed(), x, dh, dms);
            const float scale = 3.0f / std::sqrt(static_cast<float>(k));
            Pair phi = h.Floats(big_n * k, 11, -scale, scale);
            Pair gamma = h.Floats(k, 12, 0.5f, 1.5f);
            Pair xp = h.Input(x.data(), x.bytes.size());
            Pair dhp = h.Input(dh.data(), dh.size() * 4);
            Pair dmsp = h.Input(dms.data(), dms.size() * 4);
            std::vector<std::pair<std::string, std::vector<float>>> outs[2];
            for (int b : {0, 1}) {
              Pair dx = h.Output(m * k * DTypeSize(dt));
              Pair g_phi = h.Floats(big_n * k, 77), g_gamma = h.Floats(k, 80);
              LayerWeights w;
              w.phi = phi.f(b);
              w.gamma = spec.has_gamma ? gamma.f(b) : nullptr;
              LayerGrads grads;
              grads.phi = g_phi.f(b);
              grads.gamma = spec.has_gamma ? g_gamma.f(b) : nullptr;
              ProjectionBackwardParams p{&spec,     m,         dt,
                                         xp.ptr(b), w,         dhp.f(b),
                                         dmsp.f(b), dx.ptr(b), grads};
              const absl::Status status = h.backend(b).ProjectionBackward(
                  p, h.Scratch(b, OpKind::kProjectionBackward, spec, m, dt));
              EXPECT_TRUE(status.ok()) << status;
              auto fetch = [&](Pair& q, DType type) {
                return Floats(
                    b == 0 ? std::vector<uint8_t>(q.host.begin(),
                                                  q.host.begin() + q.bytes)
                           : h.Fetch(q),
                    type);
              };
              outs[b] = {{"dx", fetch(dx, dt)},
                         {"dphi", fetch(g_phi, DType::kF32)}};
              if (spec.has_gamma) {
                outs[b].push_back({"dgamma", fetch(g_gamma, DType::kF32)});
              }
            }
            for (size_t o = 0; o < outs[0].size(); ++o) {
              const std::string& name = outs[0][o].first;
              const bool is_dx = name == "dx";
              const double tol = is_dx && dt != DType::kF32 ? 1e-2
                                 : is_dx ? (ieee ? 1e-4 : 2e-3)
                                         : (ieee ? 1e-3 : 1e-2);
              ExpectOverflowContract(spec, bad, name, outs[1][o].second,
                                     outs[0][o].second, tol);
              if (is_dx) {
                // Each of the N products of a subnormal dx may round.
                ExpectTokensClose(spec, bad, name, outs[1][o].second,
                                  outs[0][o].second, tol,
                                  SubnormalStep(dt) * big_n);
              }
            }
          }
        }
      }
    }
  }
}

// The scale op backward alone (it sees h and the mean square, not x): tokens
// whose mean square is far above the fused ops' repair threshold, up to the
// fp32 maximum, with h of its order's square root, take the scaled form
// (scale.cu); dms, about ms_dot / ms^1.5, came out denormal or 0 in fp32.
// n = 4 runs the n = 4 kernels, n = 3 the generic one; every per-token
// output within 1e-5 of the reference token by token, dms against its
// terms' magnitude where that is larger.
TEST(CudaOverflowTest, ScaleOpLargeMeanSquare) {
  MHC_SKIP_WITHOUT_GPU();
  Harness h;
  const std::vector<float> mean_squares = {1.5f,  1e19f, 0x1p64f, 2e25f,
                                           1e27f, 1e29f, 1e31f,   1e34f,
                                           1e37f, 3e38f, 0x1p66f};
  const int64_t m = static_cast<int64_t>(mean_squares.size());
  for (const char* preset : {"deepseek_v4", "megatron"}) {
    for (int n : {4, 3}) {
      for (LayerKind kind : {LayerKind::kMhc, LayerKind::kHead}) {
        LayerSpec spec = PresetSpec(preset, n, 64).value();
        spec.kind = kind;
        const bool mhc = kind == LayerKind::kMhc;
        const int64_t big_n = spec.NumLogits(), a = spec.NumAlpha();
        SCOPED_TRACE(absl::StrCat(preset, " n=", n, mhc ? "" : " head"));
        std::vector<float> hv = RandomFloats(m * big_n, FreshSeed());
        for (int64_t t = 0; t < m; ++t) {
          for (int64_t g = 0; g < big_n; ++g) {
            hv[t * big_n + g] *= std::sqrt(mean_squares[t]);
          }
        }
        // The inputs, then their magnitudes (the terms of dms).
        std::vector<float> in[2][6] = {
            {hv, RandomFloats(a, FreshSeed(), 0.5f, 1.5f),
             RandomFloats(big_n, FreshSeed()), RandomFloats(m * n, FreshSeed()),
             RandomFloats(m * n, FreshSeed()),
             RandomFloats(m * n * n, FreshSeed())}};
        for (int i = 0; i < 6; ++i) {
          in[1][i] = in[0][i];
          for (float& v : in[1][i]) v = std::fabs(v);
        }
        std::vector<float> ms(mean_squares);
        std::vector<float> outs[3][2];  // CUDA, reference, terms: dh, dms
        for (int run = 0; run < 3; ++run) {
          const int b = run == 0 ? 1 : 0;
          const std::vector<float>* v = in[run == 2 ? 1 : 0];
          Pair hp = h.Input(v[0].data(), v[0].size() * 4);
          Pair msp = h.Input(ms.data(), ms.size() * 4);
          Pair alpha = h.Input(v[1].data(), v[1].size() * 4);
          Pair beta = h.Input(v[2].data(), v[2].size() * 4);
          Pair dhp = h.Input(v[3].data(), v[3].size() * 4);
          Pair dhq = h.Input(v[4].data(), v[4].size() * 4);
          Pair dlg = h.Input(v[5].data(), v[5].size() * 4);
          Pair dh = h.Output(m * big_n * 4), dms = h.Output(m * 4);
          ScaleBackwardParams q;
          q.spec = &spec;
          q.tokens = m;
          q.h = hp.f(b);
          q.mean_square = msp.f(b);
          q.weights.alpha = alpha.f(b);
          q.weights.beta = beta.f(b);
          q.dh_pre = dhp.f(b);
          q.dh_post = mhc ? dhq.f(b) : nullptr;
          q.dlogits = mhc ? dlg.f(b) : nullptr;
          q.dh = dh.f(b);
          q.dmean_square = dms.f(b);
          const absl::Status status = h.backend(b).ScaleBackward(
              q, h.Scratch(b, OpKind::kScaleBackward, spec, m, DType::kF32));
          ASSERT_TRUE(status.ok()) << status;
          auto fetch = [&](Pair& p) {
            return Floats(b == 0 ? std::vector<uint8_t>(
                                       p.host.begin(), p.host.begin() + p.bytes)
                                 : h.Fetch(p),
                          DType::kF32);
          };
          outs[run][0] = fetch(dh);
          outs[run][1] = fetch(dms);
        }
        for (int o = 0; o < 2; ++o) {
          const int64_t per = o == 0 ? big_n : 1;
          SCOPED_TRACE(o == 0 ? "dh" : "dms");
          for (int64_t t = 0; t < m; ++t) {
            SCOPED_TRACE(absl::StrCat("mean square ", mean_squares[t]));
            double scale = 0.0, err = 0.0;
            for (int64_t e = t * per; e < (t + 1) * per; ++e) {
              const float want = outs[1][o][e];
              ASSERT_TRUE(std::isfinite(want));
              scale = std::max(scale, std::fabs(double{want}));
              if (o == 1) {
                ASSERT_NE(want, 0.0f);
                scale = std::max(scale, std::fabs(double{outs[2][o][e]}));
              }
              err = std::max(err, std::fabs(double{outs[0][o][e]} - want));
            }
            // A subnormal dms is only as fine as the subnormal spacing.
            EXPECT_LE(err, std::max(1e-5 * scale, SubnormalStep(DType::kF32)))
                << outs[0][o][t * per] << " vs " << outs[1][o][t * per];
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace mhc::testing
