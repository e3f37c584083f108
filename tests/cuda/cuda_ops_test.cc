// Every single CUDA op, forward and backward, against the float64 reference
// through the Backend interface, for every preset x dtype over the sampled
// shapes and variants of cuda_cases.h. Skips without a GPU.
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_cases.h"
#include "cuda/cuda_harness.h"
#include "gtest/gtest.h"

namespace mhc::testing {
namespace {

using CudaOpsTest = CudaPresetDtypeTest;

TEST_P(CudaOpsTest, ElementwiseOps) {
  const DType dt = dtype();
  const size_t es = DTypeSize(dt);
  const auto& shapes = SampledShapes();
  for (size_t ci = 0; ci < shapes.size(); ++ci) {
    const LayerSpec spec = CaseSpec(preset(), shapes[ci], static_cast<int>(ci));
    const int64_t M = shapes[ci].tokens, C = spec.hidden, K = spec.K();
    const int64_t n = spec.n;
    const std::string name = CaseName(spec, M, dt);
    SCOPED_TRACE(name);
    Harness h;
    Pair x = h.Act(dt, M * K, FreshSeed());
    Pair f = h.Act(dt, M * C, FreshSeed());
    Pair dy = h.Act(dt, M * C, FreshSeed());
    Pair dxn = h.Act(dt, M * K, FreshSeed());
    Pair hpre = h.Floats(M * n, FreshSeed(), 0.0f, 1.0f);
    Pair hpost = h.Floats(M * n, FreshSeed(), 0.0f, 2.0f);
    Pair hres = h.Floats(M * n * n, FreshSeed(), 0.0f, 1.0f);
    Pair bias = h.Floats(C, FreshSeed());
    Pair gbias = h.Floats(C, FreshSeed());

    {  // aggregate forward
      Pair y = h.Output(M * C * es);
      AggregateForwardParams p[2];
      for (int b = 0; b < 2; ++b) {
        p[b].spec = &spec;
        p[b].tokens = M;
        p[b].act_dtype = dt;
        p[b].x = x.ptr(b);
        p[b].h_pre = hpre.f(b);
        p[b].y = y.ptr(b);
      }
      MHC_RUN_BOTH(AggregateForward, p, OpKind::kAggregateForward, spec, M);
      ExpectClose(h, y, dt, M * C, ForwardTol(dt), true, "aggregate y");
    }
    {  // aggregate backward
      Pair dx = h.Output(M * K * es);
      Pair dhp = h.Output(M * n * 4);
      AggregateBackwardParams p[2];
      for (int b = 0; b < 2; ++b) {
        p[b].spec = &spec;
        p[b].tokens = M;
        p[b].act_dtype = dt;
        p[b].x = x.ptr(b);
        p[b].h_pre = hpre.f(b);
        p[b].dy = dy.ptr(b);
        p[b].dx = dx.ptr(b);
        p[b].dh_pre = dhp.f(b);
      }
      MHC_RUN_BOTH(AggregateBackward, p, OpKind::kAggregateBackward, spec, M);
      ExpectClose(h, dx, dt, M * K, ForwardTol(dt), true, "aggregate dx");
      ExpectClose(h, dhp, DType::kF32, M * n, kMixTol, false,
                  "aggregate dh_pre");
    }
    {  // post forward
      Pair xn = h.Output(M * K * es);
      PostForwardParams p[2];
      for (int b = 0; b < 2; ++b) {
        p[b].spec = &spec;
        p[b].tokens = M;
        p[b].act_dtype = dt;
        p[b].f = f.ptr(b);
        p[b].x = x.ptr(b);
        p[b].h_post = hpost.f(b);
        p[b].h_res = hres.f(b);
        p[b].weights.bias = bias.f(b);
        p[b].x_next = xn.ptr(b);
      }
      MHC_RUN_BOTH(PostForward, p, OpKind::kPostForward, spec, M);
      ExpectClose(h, xn, dt, M * K, ForwardTol(dt), true, "post x_next");
    }
    for (bool with_dx : {true, false}) {  // post backward
      Pair df = h.Output(M * C * es);
      Pair dx = h.Output(M * K * es);
      Pair dhp = h.Output(M * n * 4);
      Pair dhr = h.Output(M * n * n * 4);
      std::vector<float> init = RandomFloats(C, 7);
      Pair gb = h.Input(init.data(), init.size() * 4);
      PostBackwardParams p[2];
      for (int b = 0; b < 2; ++b) {
        p[b].spec = &spec;
        p[b].tokens = M;
        p[b].act_dtype = dt;
        p[b].dx_next = dxn.ptr(b);
        p[b].f = f.ptr(b);
        p[b].x = x.ptr(b);
        p[b].h_post = hpost.f(b);
        p[b].h_res = hres.f(b);
        p[b].weights.bias = bias.f(b);
        p[b].df = df.ptr(b);
        p[b].dx = with_dx ? dx.ptr(b) : nullptr;
        p[b].dh_post = dhp.f(b);
        p[b].dh_res = dhr.f(b);
        p[b].grads.bias = gb.f(b);
      }
      MHC_RUN_BOTH(PostBackward, p, OpKind::kPostBackward, spec, M);
      ExpectClose(h, df, dt, M * C, ForwardTol(dt), true, "post df");
      if (with_dx) {
        ExpectClose(h, dx, dt, M * K, ForwardTol(dt), true, "post dx");
      }
      ExpectClose(h, dhp, DType::kF32, M * n, kMixTol, false, "post dh_post");
      ExpectClose(h, dhr, DType::kF32, M * n * n, kMixTol, false,
                  "post dh_res");
      if (spec.has_post_bias) {
        ExpectClose(h, gb, DType::kF32, C, kMixTol, false, "post dbias");
      }
    }
    {  // expand forward and backward
      Pair xo = h.Output(M * K * es);
      Pair de = h.Output(M * C * es);
      ExpandForwardParams pf[2];
      ExpandBackwardParams pb[2];
      for (int b = 0; b < 2; ++b) {
        pf[b].spec = pb[b].spec = &spec;
        pf[b].tokens = pb[b].tokens = M;
        pf[b].act_dtype = pb[b].act_dtype = dt;
        pf[b].e = f.ptr(b);
        pf[b].x = xo.ptr(b);
        pb[b].dx = dxn.ptr(b);
        pb[b].de = de.ptr(b);
      }
      MHC_RUN_BOTH(ExpandForward, pf, OpKind::kExpandForward, spec, M);
      MHC_RUN_BOTH(ExpandBackward, pb, OpKind::kExpandBackward, spec, M);
      ExpectClose(h, xo, dt, M * K, 0.0, true, "expand x");
      ExpectClose(h, de, dt, M * C, ForwardTol(dt), true, "expand de");
    }
  }
}

TEST_P(CudaOpsTest, MixingOps) {
  const DType dt = dtype();
  const size_t es = DTypeSize(dt);
  const auto& shapes = SampledShapes();
  for (size_t ci = 0; ci < shapes.size(); ++ci) {
    for (LayerKind kind : {LayerKind::kMhc, LayerKind::kHead}) {
      LayerSpec spec = CaseSpec(preset(), shapes[ci], static_cast<int>(ci));
      spec.kind = kind;
      if (kind == LayerKind::kHead) spec.has_post_bias = false;
      const bool mhc = kind == LayerKind::kMhc;
      const int64_t M = shapes[ci].tokens, K = spec.K(), n = spec.n;
      const int64_t N = spec.NumLogits();
      const std::string name = CaseName(spec, M, dt) + (mhc ? " mhc" : " head");
      SCOPED_TRACE(name);
      Harness h;
      Pair x = h.Act(dt, M * K, FreshSeed());
      const float phi_scale = 1.0f / std::sqrt(static_cast<float>(K));
      Pair phi = h.Floats(N * K, FreshSeed(), -phi_scale, phi_scale);
      Pair gamma = h.Floats(K, FreshSeed(), 0.5f, 1.5f);
      Pair alpha = h.Floats(3, FreshSeed(), 0.5f, 1.5f);
      Pair beta = h.Floats(N, FreshSeed());
      LayerWeights w[2];
      for (int b = 0; b < 2; ++b) {
        w[b].phi = phi.f(b);
        w[b].alpha = alpha.f(b);
        w[b].beta = beta.f(b);
        w[b].gamma = gamma.f(b);
      }
      // projection
      Pair hh = h.Output(M * N * 4);
      Pair ms = h.Output(M * 4);
      {
        ProjectionForwardParams p[2];
        for (int b = 0; b < 2; ++b) {
          p[b].spec = &spec;
          p[b].tokens = M;
          p[b].act_dtype = dt;
          p[b].x = x.ptr(b);
          p[b].weights = w[b];
          p[b].h = hh.f(b);
          p[b].mean_square = ms.f(b);
        }
        MHC_RUN_BOTH(ProjectionForward, p, OpKind::kProjectionForward, spec, M);
        ExpectClose(h, hh, DType::kF32, M * N, kMixTol, false, "proj h");
        ExpectClose(h, ms, DType::kF32, M, kMixTol, false, "proj ms");
      }
      {
        Pair dh = h.Floats(M * N, FreshSeed());
        Pair dms = h.Floats(M, FreshSeed());
        Pair dx = h.Output(M * K * es);
        std::vector<float> init_phi = RandomFloats(N * K, 3);
        std::vector<float> init_gamma = RandomFloats(K, 4);
        Pair gphi = h.Input(init_phi.data(), init_phi.size() * 4);
        Pair ggamma = h.Input(init_gamma.data(), init_gamma.size() * 4);
        ProjectionBackwardParams p[2];
        for (int b = 0; b < 2; ++b) {
          p[b].spec = &spec;
          p[b].tokens = M;
          p[b].act_dtype = dt;
          p[b].x = x.ptr(b);
          p[b].weights = w[b];
          p[b].dh = dh.f(b);
          p[b].dmean_square = dms.f(b);
          p[b].dx = dx.ptr(b);
          p[b].grads.phi = gphi.f(b);
          p[b].grads.gamma = ggamma.f(b);
        }
        MHC_RUN_BOTH(ProjectionBackward, p, OpKind::kProjectionBackward, spec,
                     M);
        ExpectClose(h, dx, dt, M * K, BackwardTol(dt), false, "proj dx");
        ExpectClose(h, gphi, DType::kF32, N * K, kMixTol, false, "proj dphi");
        ExpectClose(h, ggamma, DType::kF32, K, kMixTol, false, "proj dgamma");
      }
      // scale (static and dynamic) on a positive mean square
      for (bool dynamic : {true, false}) {
        if (!dynamic && !mhc) continue;  // head layers are always dynamic
        LayerSpec sspec = spec;
        sspec.dynamic = dynamic;
        sspec.has_gamma = dynamic && spec.has_gamma;  // static: no phi
        Pair sh = h.Floats(M * N, FreshSeed());
        Pair sms = h.Floats(M, FreshSeed(), 0.25f, 2.0f);
        Pair hp = h.Output(M * n * 4);
        Pair hq = h.Output(M * n * 4);
        Pair lg = h.Output(M * n * n * 4);
        ScaleForwardParams p[2];
        for (int b = 0; b < 2; ++b) {
          p[b].spec = &sspec;
          p[b].tokens = M;
          p[b].h = sh.f(b);
          p[b].mean_square = sms.f(b);
          p[b].weights = w[b];
          p[b].h_pre = hp.f(b);
          p[b].h_post = mhc ? hq.f(b) : nullptr;
          p[b].logits = mhc ? lg.f(b) : nullptr;
        }
        MHC_RUN_BOTH(ScaleForward, p, OpKind::kScaleForward, sspec, M);
        ExpectClose(h, hp, DType::kF32, M * n, 1e-5, false, "scale h_pre");
        if (mhc) {
          ExpectClose(h, hq, DType::kF32, M * n, 1e-5, false, "scale h_post");
          ExpectClose(h, lg, DType::kF32, M * n * n, 1e-5, false,
                      "scale logits");
        }
        Pair dhp = h.Floats(M * n, FreshSeed());
        Pair dhq = h.Floats(M * n, FreshSeed());
        Pair dlg = h.Floats(M * n * n, FreshSeed());
        Pair dh = h.Output(M * N * 4);
        Pair dms = h.Output(M * 4);
        std::vector<float> init = RandomFloats(N + 3, 5);
        Pair galpha = h.Input(init.data(), 3 * 4);
        Pair gbeta = h.Input(init.data() + 3, N * 4);
        ScaleBackwardParams q[2];
        for (int b = 0; b < 2; ++b) {
          q[b].spec = &sspec;
          q[b].tokens = M;
          q[b].h = sh.f(b);
          q[b].mean_square = sms.f(b);
          q[b].weights = w[b];
          q[b].dh_pre = dhp.f(b);
          q[b].dh_post = mhc ? dhq.f(b) : nullptr;
          q[b].dlogits = mhc ? dlg.f(b) : nullptr;
          q[b].dh = dh.f(b);
          q[b].dmean_square = dms.f(b);
          q[b].grads.alpha = galpha.f(b);
          q[b].grads.beta = gbeta.f(b);
        }
        MHC_RUN_BOTH(ScaleBackward, q, OpKind::kScaleBackward, sspec, M);
        if (dynamic) {
          ExpectClose(h, dh, DType::kF32, M * N, 1e-5, false, "scale dh");
          // dms sums N terms that can cancel: the backward bound.
          ExpectClose(h, dms, DType::kF32, M, BackwardTol(DType::kF32), false,
                      "scale dms");
          ExpectClose(h, galpha, DType::kF32, spec.NumAlpha(),
                      BackwardTol(DType::kF32), false, "scale dalpha");
        }
        ExpectClose(h, gbeta, DType::kF32, N, BackwardTol(DType::kF32), false,
                    "scale dbeta");
      }
      if (!mhc) continue;
      // Sinkhorn
      Pair lg = h.Floats(M * n * n, FreshSeed(), -2.0f, 2.0f);
      Pair hres = h.Output(M * n * n * 4);
      Pair dhres = h.Floats(M * n * n, FreshSeed());
      Pair dlg = h.Output(M * n * n * 4);
      SinkhornForwardParams sf[2];
      SinkhornBackwardParams sb[2];
      for (int b = 0; b < 2; ++b) {
        sf[b].spec = sb[b].spec = &spec;
        sf[b].tokens = sb[b].tokens = M;
        sf[b].logits = sb[b].logits = lg.f(b);
        sf[b].h_res = hres.f(b);
        sb[b].dh_res = dhres.f(b);
        sb[b].dlogits = dlg.f(b);
      }
      MHC_RUN_BOTH(SinkhornForward, sf, OpKind::kSinkhornForward, spec, M);
      MHC_RUN_BOTH(SinkhornBackward, sb, OpKind::kSinkhornBackward, spec, M);
      ExpectClose(h, hres, DType::kF32, M * n * n, 1e-5, false,
                  "sinkhorn h_res");
      ExpectClose(h, dlg, DType::kF32, M * n * n, 1e-4, false,
                  "sinkhorn dlogits");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(PresetsAndDtypes, CudaOpsTest,
                         ::testing::Combine(::testing::ValuesIn(PresetNames()),
                                            ::testing::Values(DType::kBF16,
                                                              DType::kF16,
                                                              DType::kF32)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" +
                                  std::string(
                                      DTypeName(std::get<1>(info.param)));
                         });

// Sinkhorn over stream counts (the lane kernels for n = 2 / 4 / 8 / 16, the
// one-thread path for the rest), T = 1 and 20, LINEAR and LOG, odd token
// counts; then batch invariance: a slice of the batch starting at an odd
// token gives bitwise the same H_res and dlogits.
TEST(CudaSinkhornTest, ShapesModesAndBatchInvariance) {
  MHC_SKIP_WITHOUT_GPU();
  for (const char* preset : {"deepseek_v4", "transformer_engine"}) {
    for (int n : {1, 2, 3, 4, 8, 16}) {
      for (int T : {1, 20}) {
        for (int64_t M : {0, 1, 13, 137}) {
          LayerSpec spec = PresetSpec(preset, n, 8).value();
          spec.sinkhorn_iterations = T;
          const int64_t nn = n * n;
          SCOPED_TRACE(absl::StrCat(preset, " n=", n, " T=", T, " M=", M));
          Harness h;
          Pair lg = h.Floats(M * nn, FreshSeed(), -2.0f, 2.0f);
          Pair dhres = h.Floats(M * nn, FreshSeed());
          Pair hres = h.Output(M * nn * 4);
          Pair dlg = h.Output(M * nn * 4);
          for (int b = 0; b < 2; ++b) {
            SinkhornForwardParams f;
            f.spec = &spec;
            f.tokens = M;
            f.logits = lg.f(b);
            f.h_res = hres.f(b);
            Workspace ws =
                h.Scratch(b, OpKind::kSinkhornForward, spec, M, DType::kF32);
            ASSERT_TRUE(h.backend(b).SinkhornForward(f, ws).ok());
            SinkhornBackwardParams g;
            g.spec = &spec;
            g.tokens = M;
            g.logits = lg.f(b);
            g.dh_res = dhres.f(b);
            g.dlogits = dlg.f(b);
            ws = h.Scratch(b, OpKind::kSinkhornBackward, spec, M, DType::kF32);
            ASSERT_TRUE(h.backend(b).SinkhornBackward(g, ws).ok());
          }
          ASSERT_TRUE(h.cuda().Synchronize().ok());
          ExpectClose(h, hres, DType::kF32, M * nn, 1e-5, false, "h_res");
          ExpectClose(h, dlg, DType::kF32, M * nn, 1e-4, false, "dlogits");
          if (M != 137) continue;
          const int64_t first = 37, count = 50;
          Pair part_h = h.Output(count * nn * 4);
          Pair part_d = h.Output(count * nn * 4);
          SinkhornForwardParams f;
          f.spec = &spec;
          f.tokens = count;
          f.logits = lg.f(1) + first * nn;
          f.h_res = part_h.f(1);
          ASSERT_TRUE(h.cuda().SinkhornForward(f, Workspace{}).ok());
          SinkhornBackwardParams g;
          g.spec = &spec;
          g.tokens = count;
          g.logits = lg.f(1) + first * nn;
          g.dh_res = dhres.f(1) + first * nn;
          g.dlogits = part_d.f(1);
          ASSERT_TRUE(h.cuda().SinkhornBackward(g, Workspace{}).ok());
          ASSERT_TRUE(h.cuda().Synchronize().ok());
          const std::vector<uint8_t> full_h = h.Fetch(hres);
          const std::vector<uint8_t> full_d = h.Fetch(dlg);
          EXPECT_EQ(std::memcmp(full_h.data() + first * nn * 4,
                                h.Fetch(part_h).data(), count * nn * 4),
                    0)
              << "h_res not batch invariant";
          EXPECT_EQ(std::memcmp(full_d.data() + first * nn * 4,
                                h.Fetch(part_d).data(), count * nn * 4),
                    0)
              << "dlogits not batch invariant";
        }
      }
    }
  }
}

}  // namespace
}  // namespace mhc::testing
