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

// Sinkhorn forward (logits -> h_res) then backward (dh_res -> dlogits) of M
// tokens on one backend; the op needs no workspace.
absl::Status RunSinkhorn(Backend& be, const LayerSpec& spec, int64_t M,
                         const float* logits, float* h_res, const float* dh_res,
                         float* dlogits) {
  SinkhornForwardParams f;
  f.spec = &spec;
  f.tokens = M;
  f.logits = logits;
  f.h_res = h_res;
  if (absl::Status st = be.SinkhornForward(f, Workspace{}); !st.ok()) {
    return st;
  }
  SinkhornBackwardParams g;
  g.spec = &spec;
  g.tokens = M;
  g.logits = logits;
  g.dh_res = dh_res;
  g.dlogits = dlogits;
  return be.SinkhornBackward(g, Workspace{});
}

// The Sinkhorn forward and backward of M tokens with logits lg and a fresh
// dh_res on both backends, CUDA's h_res and dlogits checked against the
// reference's; the pairs stay with the caller for further checks.
struct SinkhornPairs {
  Pair dhres, hres, dlg;
};
SinkhornPairs CheckSinkhorn(Harness& h, const LayerSpec& spec, int64_t M,
                            Pair& lg) {
  const int64_t nn = int64_t{spec.n} * spec.n;
  SinkhornPairs r{h.Floats(M * nn, FreshSeed()), h.Output(M * nn * 4),
                  h.Output(M * nn * 4)};
  for (int b = 0; b < 2; ++b) {
    const absl::Status st = RunSinkhorn(h.backend(b), spec, M, lg.f(b),
                                        r.hres.f(b), r.dhres.f(b), r.dlg.f(b));
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) return r;
  }
  EXPECT_TRUE(h.cuda().Synchronize().ok());
  ExpectClose(h, r.hres, DType::kF32, M * nn, 1e-5, false, "h_res");
  ExpectClose(h, r.dlg, DType::kF32, M * nn, 1e-4, false, "dlogits");
  return r;
}

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
      if (dt == DType::kF32) {
        // df and dx sum n products that can cancel (a single element at C =
        // 1): measured against the products' scale.
        const double dxn_scale = MaxAbs(dxn, dt, M * K);
        ExpectCloseWithFloor(h, df, M * C,
                             MaxAbs(hpost, DType::kF32, M * n) * dxn_scale,
                             ForwardTol(dt), "post df");
        if (with_dx) {
          ExpectCloseWithFloor(h, dx, M * K,
                               MaxAbs(hres, DType::kF32, M * n * n) * dxn_scale,
                               ForwardTol(dt), "post dx");
        }
      } else {
        ExpectClose(h, df, dt, M * C, ForwardTol(dt), true, "post df");
        if (with_dx) {
          ExpectClose(h, dx, dt, M * K, ForwardTol(dt), true, "post dx");
        }
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
          // dms = -(r / 2 sqrt(ms)) sum_g dh_g h_g sums N terms that can
          // cancel far below them (one token alone: nothing else sets the
          // scale), so it is held to the backward bound relative to its
          // terms, ~ sum_g |dh_g h_g| / 2 ms, the reference's dh.
          double dms_floor = 0.0;
          for (int64_t t = 0; t < M; ++t) {
            double terms = 0.0;
            for (int64_t g = 0; g < N; ++g) {
              terms +=
                  std::fabs(double{dh.f(0)[t * N + g]} * sh.f(0)[t * N + g]);
            }
            dms_floor = std::max(dms_floor, terms / (2.0 * sms.f(0)[t]));
          }
          ExpectCloseWithFloor(h, dms, M, dms_floor, BackwardTol(DType::kF32),
                               "scale dms");
          ExpectAccumulated(h, galpha, init.data(), spec.NumAlpha(),
                            BackwardTol(DType::kF32), "scale dalpha");
        }
        ExpectAccumulated(h, gbeta, init.data() + 3, N,
                          BackwardTol(DType::kF32), "scale dbeta");
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
      // dlogits rows sum terms of dh_res times entries of P <= 1 that can
      // cancel far below dh_res (one token, n = 2: a handful of values).
      ExpectCloseWithFloor(
          h, dlg, M * n * n,
          MaxAbs(reinterpret_cast<const float*>(dhres.host.data()), M * n * n),
          1e-4, "sinkhorn dlogits");
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

// Sinkhorn over stream counts (LINEAR: the lane kernels for n = 2 / 4 / 8 /
// 16 and, padded into those blocks, n = 3 / 5 / 6 / 12; LOG and n = 1: the
// one-thread path), T = 1 and 20, odd token counts; then batch invariance: a
// slice of the batch starting at an odd token gives bitwise the same H_res
// and dlogits.
TEST(CudaSinkhornTest, ShapesModesAndBatchInvariance) {
  MHC_SKIP_WITHOUT_GPU();
  for (const char* preset : {"deepseek_v4", "transformer_engine"}) {
    for (int n : {1, 2, 3, 4, 5, 6, 8, 12, 16}) {
      for (int T : {1, 20}) {
        for (int64_t M : {0, 1, 13, 137}) {
          LayerSpec spec = PresetSpec(preset, n, 8).value();
          spec.sinkhorn_iterations = T;
          const int64_t nn = n * n;
          SCOPED_TRACE(absl::StrCat(preset, " n=", n, " T=", T, " M=", M));
          Harness h;
          Pair lg = h.Floats(M * nn, FreshSeed(), -2.0f, 2.0f);
          auto [dhres, hres, dlg] = CheckSinkhorn(h, spec, M, lg);
          if (::testing::Test::HasFailure()) return;
          if (M != 137) continue;
          const int64_t first = 37, count = 50;
          Pair part_h = h.Output(count * nn * 4);
          Pair part_d = h.Output(count * nn * 4);
          ASSERT_TRUE(RunSinkhorn(h.cuda(), spec, count, lg.f(1) + first * nn,
                                  part_h.f(1), dhres.f(1) + first * nn,
                                  part_d.f(1))
                          .ok());
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

// A device copy of `src` (count floats) that starts 4 bytes past a 16-byte
// boundary, so kernels must take their scalar-access form.
float* Unaligned(Harness& h, const Pair& src, int64_t count, Pair& keep) {
  keep = h.Output((count + 1) * 4);
  float* p = keep.f(1) + 1;
  if (count > 0) {
    EXPECT_TRUE(h.cuda().CopyToDevice(p, src.host.data(), count * 4).ok());
  }
  return p;
}

std::vector<uint8_t> FetchFloats(Harness& h, const float* p, int64_t count) {
  std::vector<uint8_t> out(count * 4);
  if (count > 0) {
    EXPECT_TRUE(h.cuda().CopyToHost(out.data(), p, out.size()).ok());
  }
  return out;
}

// The n = 4 scale kernels over many token tiles (the one-launch dalpha /
// dbeta reduction, including more partial rows than one pass of its final
// sum reads): against the reference, bitwise the same on a second run on the
// same backend (whose arrival counter the first run must have reset), and
// the same per-token bits when every pointer is unaligned.
// n = 4 (the tile kernels) and n = 6 (a thread per token, whose warp rows
// at M = 70001 span three chunks of the column sums).
TEST(CudaScaleTest, ManyTilesRepeatableAndAlignmentInvariant) {
  MHC_SKIP_WITHOUT_GPU();
  for (const char* kind : {"mhc", "head", "mhc_n6"}) {
    for (int64_t M : {int64_t{3001}, int64_t{70001}}) {
      const bool n6 = std::string(kind) == "mhc_n6";
      LayerSpec spec = PresetSpec("deepseek_v4", n6 ? 6 : 4, 8).value();
      if (std::string(kind) == "head") spec.kind = LayerKind::kHead;
      const bool mhc = spec.kind == LayerKind::kMhc;
      const int64_t n = spec.n, N = spec.NumLogits(), A = spec.NumAlpha();
      SCOPED_TRACE(absl::StrCat(kind, " M=", M));
      Harness h;
      Pair hh = h.Floats(M * N, FreshSeed());
      Pair ms = h.Floats(M, FreshSeed(), 0.25f, 2.0f);
      Pair alpha = h.Floats(A, FreshSeed(), 0.5f, 1.5f);
      Pair beta = h.Floats(N, FreshSeed());
      Pair dhp = h.Floats(M * n, FreshSeed());
      Pair dhq = h.Floats(M * n, FreshSeed());
      Pair dlg = h.Floats(M * n * n, FreshSeed());
      std::vector<float> init = RandomFloats(A + N, FreshSeed());
      Pair galpha = h.Input(init.data(), A * 4);
      Pair gbeta = h.Input(init.data() + A, N * 4);
      Pair dh = h.Output(M * N * 4), dms = h.Output(M * 4);
      ScaleBackwardParams q[2];
      for (int b = 0; b < 2; ++b) {
        q[b].spec = &spec;
        q[b].tokens = M;
        q[b].h = hh.f(b);
        q[b].mean_square = ms.f(b);
        q[b].weights.alpha = alpha.f(b);
        q[b].weights.beta = beta.f(b);
        q[b].dh_pre = dhp.f(b);
        q[b].dh_post = mhc ? dhq.f(b) : nullptr;
        q[b].dlogits = mhc ? dlg.f(b) : nullptr;
        q[b].dh = dh.f(b);
        q[b].dmean_square = dms.f(b);
        q[b].grads.alpha = galpha.f(b);
        q[b].grads.beta = gbeta.f(b);
        Workspace ws =
            h.Scratch(b, OpKind::kScaleBackward, spec, M, DType::kF32);
        ASSERT_TRUE(h.backend(b).ScaleBackward(q[b], ws).ok());
      }
      ASSERT_TRUE(h.cuda().Synchronize().ok());
      ExpectClose(h, dh, DType::kF32, M * N, 1e-5, false, "dh");
      ExpectClose(h, dms, DType::kF32, M, 1e-4, false, "dms");
      ExpectClose(h, galpha, DType::kF32, A, 1e-4, false, "dalpha");
      ExpectClose(h, gbeta, DType::kF32, N, 1e-4, false, "dbeta");

      // Again from the same starting gradients: every bit repeats.
      const std::vector<uint8_t> dh1 = h.Fetch(dh), dms1 = h.Fetch(dms);
      const std::vector<uint8_t> ga1 = h.Fetch(galpha), gb1 = h.Fetch(gbeta);
      ASSERT_TRUE(h.cuda().CopyToDevice(galpha.dev, init.data(), A * 4).ok());
      ASSERT_TRUE(
          h.cuda().CopyToDevice(gbeta.dev, init.data() + A, N * 4).ok());
      Workspace ws = h.Scratch(1, OpKind::kScaleBackward, spec, M, DType::kF32);
      ASSERT_TRUE(h.cuda().ScaleBackward(q[1], ws).ok());
      ASSERT_TRUE(h.cuda().Synchronize().ok());
      EXPECT_EQ(h.Fetch(dh), dh1);
      EXPECT_EQ(h.Fetch(dms), dms1);
      EXPECT_EQ(h.Fetch(galpha), ga1) << "dalpha not deterministic";
      EXPECT_EQ(h.Fetch(gbeta), gb1) << "dbeta not deterministic";

      // Unaligned copies of every per-token tensor: the same per-token bits.
      Pair k1, k2, k3, k4;
      ScaleBackwardParams u = q[1];
      u.h = Unaligned(h, hh, M * N, k1);
      u.dh_pre = Unaligned(h, dhp, M * n, k2);
      if (mhc) {
        u.dh_post = Unaligned(h, dhq, M * n, k3);
        u.dlogits = Unaligned(h, dlg, M * n * n, k4);
      }
      Pair dh_u = h.Output((M * N + 1) * 4);
      u.dh = dh_u.f(1) + 1;
      ASSERT_TRUE(h.cuda().ScaleBackward(u, ws).ok());
      ASSERT_TRUE(h.cuda().Synchronize().ok());
      EXPECT_EQ(FetchFloats(h, u.dh, M * N), dh1) << "dh depends on alignment";
      EXPECT_EQ(h.Fetch(dms), dms1) << "dms depends on alignment";

      Pair hp = h.Output(M * n * 4), hq = h.Output(M * n * 4),
           lg = h.Output(M * n * n * 4);
      ScaleForwardParams f;
      f.spec = &spec;
      f.tokens = M;
      f.h = hh.f(1);
      f.mean_square = ms.f(1);
      f.weights = q[1].weights;
      f.h_pre = hp.f(1);
      f.h_post = mhc ? hq.f(1) : nullptr;
      f.logits = mhc ? lg.f(1) : nullptr;
      ASSERT_TRUE(h.cuda().ScaleForward(f, Workspace{}).ok());
      Pair hp_u = h.Output((M * n + 1) * 4), hq_u = h.Output((M * n + 1) * 4),
           lg_u = h.Output((M * n * n + 1) * 4);
      ScaleForwardParams fu = f;
      fu.h = u.h;
      fu.h_pre = hp_u.f(1) + 1;
      fu.h_post = mhc ? hq_u.f(1) + 1 : nullptr;
      fu.logits = mhc ? lg_u.f(1) + 1 : nullptr;
      ASSERT_TRUE(h.cuda().ScaleForward(fu, Workspace{}).ok());
      ASSERT_TRUE(h.cuda().Synchronize().ok());
      EXPECT_EQ(FetchFloats(h, fu.h_pre, M * n), h.Fetch(hp));
      if (mhc) {
        EXPECT_EQ(FetchFloats(h, fu.h_post, M * n), h.Fetch(hq));
        EXPECT_EQ(FetchFloats(h, fu.logits, M * n * n), h.Fetch(lg));
      }
    }
  }
}

// The n = 4 Sinkhorn kernels at T = 10 and 20 over many warps: against the
// reference, and the same bits through unaligned pointers (scalar form).
TEST(CudaSinkhornTest, N4AlignmentInvariant) {
  MHC_SKIP_WITHOUT_GPU();
  for (int T : {10, 20}) {
    LayerSpec spec = PresetSpec("deepseek_v4", 4, 8).value();
    spec.sinkhorn_iterations = T;
    const int64_t M = 4099, nn = 16;
    SCOPED_TRACE(absl::StrCat("T=", T));
    Harness h;
    Pair lg = h.Floats(M * nn, FreshSeed(), -4.0f, 4.0f);
    auto [dhres, hres, dlg] = CheckSinkhorn(h, spec, M, lg);
    if (::testing::Test::HasFailure()) return;

    Pair k1, k2;
    Pair hres_u = h.Output((M * nn + 1) * 4),
         dlg_u = h.Output((M * nn + 1) * 4);
    float* h_res_u = hres_u.f(1) + 1;
    float* dlogits_u = dlg_u.f(1) + 1;
    ASSERT_TRUE(RunSinkhorn(h.cuda(), spec, M, Unaligned(h, lg, M * nn, k1),
                            h_res_u, Unaligned(h, dhres, M * nn, k2), dlogits_u)
                    .ok());
    ASSERT_TRUE(h.cuda().Synchronize().ok());
    EXPECT_EQ(FetchFloats(h, h_res_u, M * nn), h.Fetch(hres));
    EXPECT_EQ(FetchFloats(h, dlogits_u, M * nn), h.Fetch(dlg));
  }
}

// The n = 4 Sinkhorn kernels with logits spread so wide that whole columns
// sit at eps, including tokens whose rows all peak in one column (one
// column sum near 4, the others near 4 eps, scales up to 1 / (4 eps)), at
// eps_sk from the presets' 1e-6 down to 1e-30: against the reference.
TEST(CudaSinkhornTest, N4WideLogitsAndSmallEps) {
  MHC_SKIP_WITHOUT_GPU();
  const int64_t M = 1031, nn = 16;
  std::vector<float> logits = RandomFloats(M * nn, FreshSeed(), -30.0f, 30.0f);
  for (int64_t m = 0; m < 64; ++m) {
    for (int e = 0; e < nn; ++e) {
      logits[m * nn + e] = e % 4 == m % 4 ? 0.0f : -30.0f - 3.0f * m;
    }
  }
  for (float eps_sk : {1e-6f, 1e-12f, 1e-30f}) {
    LayerSpec spec = PresetSpec("deepseek_v4", 4, 8).value();
    spec.eps_sk = eps_sk;
    SCOPED_TRACE(absl::StrCat("eps_sk=", eps_sk));
    Harness h;
    Pair lg = h.Input(logits.data(), logits.size() * sizeof(float));
    CheckSinkhorn(h, spec, M, lg);
  }
}

}  // namespace
}  // namespace mhc::testing
