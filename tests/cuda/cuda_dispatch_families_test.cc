// The kernel plans of the op families besides the projection on the device
// (kernels/cuda/plans/): for every row of the scale, Sinkhorn, row access,
// post and fused tables, the row's example launch, its tensors placed at the
// row's alignment, reaches that row's variant (the plan with the tensors'
// real alignment, and the variant the CUDA backend reports), and its
// results match the float64 reference. Skips without a GPU.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_cases.h"
#include "cuda/cuda_harness.h"
#include "cuda/cuda_placed.h"
#include "gtest/gtest.h"
#include "plans/fused.h"
#include "plans/post.h"
#include "plans/row_access.h"
#include "plans/scale.h"
#include "plans/sinkhorn.h"

namespace mhc::testing {
namespace {

using cuda::LayerExample;
using cuda::LeastAlignment;

constexpr int64_t kTokens = 137;

std::string RowName(size_t i, const LayerExample& e,
                    absl::string_view variant) {
  return absl::StrCat("row ", i + 1, " (", variant, "): ", e.preset, " ",
                      CaseName(e.Spec(), kTokens, e.dtype), " aligned ",
                      e.alignment);
}

// Runs params[0] on the reference and params[1] on CUDA, each with its own
// workspace, then waits for the GPU.
template <typename Params, typename Run>
void RunBoth(Harness& h, Params (&p)[2], OpKind op, const LayerSpec& spec,
             DType dtype, Run run) {
  for (int b = 0; b < 2; ++b) {
    Workspace ws = h.Scratch(b, op, spec, kTokens, dtype);
    const absl::Status st = run(h.backend(b), p[b], ws);
    ASSERT_TRUE(st.ok()) << (b ? "cuda: " : "ref: ") << st;
  }
  ASSERT_TRUE(h.cuda().Synchronize().ok());
}

// ---- Scale: both directions of every row, for the row's mHC layer and
// its HEAD layer (the n = 4 kernels' 6 and 1 quarters per token).

TEST(CudaDispatchTest, EveryScaleRowRunsItsVariant) {
  MHC_SKIP_WITHOUT_GPU();
  const auto& rows = cuda::ScaleRows();
  for (size_t i = 0; i < rows.size(); ++i) {
    const LayerExample& e = rows[i].example;
    const std::string want(cuda::ToString(rows[i].variant));
    for (LayerKind kind : {LayerKind::kMhc, LayerKind::kHead}) {
      LayerSpec spec = e.Spec();
      spec.kind = kind;
      const bool mhc = kind == LayerKind::kMhc;
      SCOPED_TRACE(absl::StrCat(RowName(i, e, want), mhc ? "" : " HEAD"));
      const int64_t M = kTokens, N = spec.NumLogits(), n = spec.n;
      const int64_t A = spec.NumAlpha();
      Harness h;
      Placed sh = PlaceFloats(h, M * N, e.alignment);
      Pair sms = h.Floats(M, FreshSeed(), 0.25f, 2.0f);
      Pair alpha = h.Floats(A, FreshSeed(), 0.5f, 1.5f);
      Pair beta = h.Floats(N, FreshSeed());
      Placed hp = PlaceOutput(h, M * n * 4, e.alignment);
      Placed hq = PlaceOutput(h, M * n * 4, e.alignment);
      Placed lg = PlaceOutput(h, M * n * n * 4, e.alignment);
      Placed dhp = PlaceFloats(h, M * n, e.alignment);
      Placed dhq = PlaceFloats(h, M * n, e.alignment);
      Placed dlg = PlaceFloats(h, M * n * n, e.alignment);
      Placed dh = PlaceOutput(h, M * N * 4, e.alignment);
      Pair dms = h.Output(M * 4);
      const std::vector<float> init = RandomFloats(N + A, 5);
      Pair galpha = h.Input(init.data(), A * 4);
      Pair gbeta = h.Input(init.data() + A, N * 4);
      ScaleForwardParams f[2];
      ScaleBackwardParams g[2];
      for (int b = 0; b < 2; ++b) {
        f[b].spec = g[b].spec = &spec;
        f[b].tokens = g[b].tokens = M;
        f[b].h = g[b].h = sh.f(b);
        f[b].mean_square = g[b].mean_square = sms.f(b);
        f[b].weights.alpha = g[b].weights.alpha = alpha.f(b);
        f[b].weights.beta = g[b].weights.beta = beta.f(b);
        f[b].h_pre = hp.f(b);
        f[b].h_post = mhc ? hq.f(b) : nullptr;
        f[b].logits = mhc ? lg.f(b) : nullptr;
        g[b].dh_pre = dhp.f(b);
        g[b].dh_post = mhc ? dhq.f(b) : nullptr;
        g[b].dlogits = mhc ? dlg.f(b) : nullptr;
        g[b].dh = dh.f(b);
        g[b].dmean_square = dms.f(b);
        g[b].grads.alpha = galpha.f(b);
        g[b].grads.beta = gbeta.f(b);
      }
      const int forward_alignment =
          LeastAlignment({f[1].h, f[1].h_pre, f[1].h_post, f[1].logits});
      const int backward_alignment = LeastAlignment(
          {g[1].h, g[1].dh, g[1].dh_pre, g[1].dh_post, g[1].dlogits});
      EXPECT_EQ(forward_alignment, e.alignment);
      EXPECT_EQ(backward_alignment, e.alignment);
      const cuda::ScalePlan fp = cuda::PlanScale(spec, forward_alignment);
      const cuda::ScalePlan bp = cuda::PlanScale(spec, backward_alignment);
      EXPECT_EQ(fp.row, static_cast<int>(i));
      EXPECT_EQ(bp.row, static_cast<int>(i));
      if (rows[i].variant != cuda::ScaleVariant::kThread) {
        EXPECT_EQ(fp.quarters, mhc ? 6 : 1);
      }
      EXPECT_EQ(h.cuda().KernelVariant(f[1]), want);
      EXPECT_EQ(h.cuda().KernelVariant(g[1]), want);
      RunBoth(h, f, OpKind::kScaleForward, spec, DType::kF32,
              [](Backend& be, const ScaleForwardParams& p, Workspace ws) {
                return be.ScaleForward(p, ws);
              });
      RunBoth(h, g, OpKind::kScaleBackward, spec, DType::kF32,
              [](Backend& be, const ScaleBackwardParams& p, Workspace ws) {
                return be.ScaleBackward(p, ws);
              });
      ExpectPlacedClose(h, hp, DType::kF32, M * n, 1e-5, false, "h_pre");
      if (mhc) {
        ExpectPlacedClose(h, hq, DType::kF32, M * n, 1e-5, false, "h_post");
        ExpectPlacedClose(h, lg, DType::kF32, M * n * n, 1e-5, false, "logits");
      }
      ExpectPlacedClose(h, dh, DType::kF32, M * N, 1e-5, false, "dh");
      // dms sums N terms that can cancel far below them: held against the
      // terms, ~ sum_g |dh_g h_g| / 2 ms (as the ops test).
      double dms_floor = 0.0;
      for (int64_t t = 0; t < M; ++t) {
        double terms = 0.0;
        for (int64_t k = 0; k < N; ++k) {
          terms += std::fabs(double{dh.f(0)[t * N + k]} * sh.f(0)[t * N + k]);
        }
        dms_floor = std::max(dms_floor, terms / (2.0 * sms.f(0)[t]));
      }
      ExpectCloseWithFloor(h, dms, M, dms_floor, BackwardTol(DType::kF32),
                           "dms");
      ExpectAccumulated(h, galpha, init.data(), A, BackwardTol(DType::kF32),
                        "dalpha");
      ExpectAccumulated(h, gbeta, init.data() + A, N, BackwardTol(DType::kF32),
                        "dbeta");
    }
  }
}

// ---- Sinkhorn: both directions of every row.

TEST(CudaDispatchTest, EverySinkhornRowRunsItsVariant) {
  MHC_SKIP_WITHOUT_GPU();
  const auto& rows = cuda::SinkhornRows();
  for (size_t i = 0; i < rows.size(); ++i) {
    const LayerExample& e = rows[i].example;
    const LayerSpec spec = e.Spec();
    const std::string want(cuda::ToString(rows[i].variant));
    SCOPED_TRACE(RowName(i, e, want));
    const int64_t M = kTokens, nn = int64_t{spec.n} * spec.n;
    Harness h;
    Placed lg = PlaceFloats(h, M * nn, e.alignment, -2.0f, 2.0f);
    Placed hres = PlaceOutput(h, M * nn * 4, e.alignment);
    Placed dhres = PlaceFloats(h, M * nn, e.alignment);
    Placed dlg = PlaceOutput(h, M * nn * 4, e.alignment);
    SinkhornForwardParams f[2];
    SinkhornBackwardParams g[2];
    for (int b = 0; b < 2; ++b) {
      f[b].spec = g[b].spec = &spec;
      f[b].tokens = g[b].tokens = M;
      f[b].logits = g[b].logits = lg.f(b);
      f[b].h_res = hres.f(b);
      g[b].dh_res = dhres.f(b);
      g[b].dlogits = dlg.f(b);
    }
    const int forward_alignment = LeastAlignment({f[1].logits, f[1].h_res});
    const int backward_alignment =
        LeastAlignment({g[1].logits, g[1].dh_res, g[1].dlogits});
    EXPECT_EQ(forward_alignment, e.alignment);
    EXPECT_EQ(backward_alignment, e.alignment);
    const cuda::SinkhornPlan fp =
        cuda::PlanSinkhornForward(spec, forward_alignment);
    const cuda::SinkhornPlan bp =
        cuda::PlanSinkhornBackward(spec, backward_alignment);
    EXPECT_EQ(fp.row, static_cast<int>(i));
    EXPECT_EQ(bp.row, static_cast<int>(i));
    EXPECT_EQ(h.cuda().KernelVariant(f[1]), want);
    EXPECT_EQ(h.cuda().KernelVariant(g[1]), want);
    RunBoth(h, f, OpKind::kSinkhornForward, spec, DType::kF32,
            [](Backend& be, const SinkhornForwardParams& p, Workspace ws) {
              return be.SinkhornForward(p, ws);
            });
    RunBoth(h, g, OpKind::kSinkhornBackward, spec, DType::kF32,
            [](Backend& be, const SinkhornBackwardParams& p, Workspace ws) {
              return be.SinkhornBackward(p, ws);
            });
    ExpectPlacedClose(h, hres, DType::kF32, M * nn, 1e-5, false, "h_res");
    // dlogits rows sum terms of dh_res times entries of P <= 1 that can
    // cancel far below dh_res: measured against dh_res's scale.
    ExpectPlacedClose(h, dlg, DType::kF32, M * nn, 1e-4, false, "dlogits",
                      PlacedMaxAbs(dhres, DType::kF32, M * nn));
  }
}

// ---- Row access: the aggregate and the expand, both directions.

TEST(CudaDispatchTest, EveryRowAccessRowRunsItsVariant) {
  MHC_SKIP_WITHOUT_GPU();
  using cuda::RowKernel;
  const auto& rows = cuda::RowAccessRows();
  for (size_t i = 0; i < rows.size(); ++i) {
    const LayerExample& e = rows[i].example;
    const LayerSpec spec = e.Spec();
    const DType dt = e.dtype;
    const std::string want(cuda::ToString(rows[i].variant));
    SCOPED_TRACE(RowName(i, e, want));
    const int64_t M = kTokens, C = spec.hidden, K = spec.K(), n = spec.n;
    const size_t es = DTypeSize(dt);
    Harness h;
    Placed x = PlaceAct(h, dt, M * K, e.alignment);
    Placed dy = PlaceAct(h, dt, M * C, e.alignment);
    Placed y = PlaceOutput(h, M * C * es, e.alignment);
    Placed dx = PlaceOutput(h, M * K * es, e.alignment);
    Pair hpre = h.Floats(M * n, FreshSeed(), 0.0f, 1.0f);
    Pair dhpre = h.Output(M * n * 4);
    AggregateForwardParams af[2];
    AggregateBackwardParams ab[2];
    ExpandForwardParams ef[2];
    ExpandBackwardParams eb[2];
    Placed xo = PlaceOutput(h, M * K * es, e.alignment);
    Placed de = PlaceOutput(h, M * C * es, e.alignment);
    for (int b = 0; b < 2; ++b) {
      af[b].spec = ab[b].spec = ef[b].spec = eb[b].spec = &spec;
      af[b].tokens = ab[b].tokens = ef[b].tokens = eb[b].tokens = M;
      af[b].act_dtype = ab[b].act_dtype = ef[b].act_dtype = eb[b].act_dtype =
          dt;
      af[b].x = ab[b].x = x.ptr(b);
      af[b].h_pre = ab[b].h_pre = hpre.f(b);
      af[b].y = y.ptr(b);
      ab[b].dy = dy.ptr(b);
      ab[b].dx = dx.ptr(b);
      ab[b].dh_pre = dhpre.f(b);
      ef[b].e = dy.ptr(b);
      ef[b].x = xo.ptr(b);
      eb[b].dx = x.ptr(b);
      eb[b].de = de.ptr(b);
    }
    auto expect_row = [&](RowKernel kernel, int alignment,
                          absl::string_view variant, const char* op) {
      EXPECT_EQ(alignment, e.alignment) << op;
      EXPECT_EQ(cuda::PlanRowAccess(kernel, spec, dt, alignment).row,
                static_cast<int>(i))
          << op;
      EXPECT_EQ(variant, want) << op;
    };
    expect_row(RowKernel::kAggregateForward, LeastAlignment({af[1].x, af[1].y}),
               h.cuda().KernelVariant(af[1]), "aggregate forward");
    expect_row(RowKernel::kAggregateBackward,
               LeastAlignment({ab[1].x, ab[1].dy, ab[1].dx}),
               h.cuda().KernelVariant(ab[1]), "aggregate backward");
    expect_row(RowKernel::kExpandForward, LeastAlignment({ef[1].e, ef[1].x}),
               h.cuda().KernelVariant(ef[1]), "expand forward");
    expect_row(RowKernel::kExpandBackward, LeastAlignment({eb[1].dx, eb[1].de}),
               h.cuda().KernelVariant(eb[1]), "expand backward");
    RunBoth(h, af, OpKind::kAggregateForward, spec, dt,
            [](Backend& be, const AggregateForwardParams& p, Workspace ws) {
              return be.AggregateForward(p, ws);
            });
    RunBoth(h, ab, OpKind::kAggregateBackward, spec, dt,
            [](Backend& be, const AggregateBackwardParams& p, Workspace ws) {
              return be.AggregateBackward(p, ws);
            });
    RunBoth(h, ef, OpKind::kExpandForward, spec, dt,
            [](Backend& be, const ExpandForwardParams& p, Workspace ws) {
              return be.ExpandForward(p, ws);
            });
    RunBoth(h, eb, OpKind::kExpandBackward, spec, dt,
            [](Backend& be, const ExpandBackwardParams& p, Workspace ws) {
              return be.ExpandBackward(p, ws);
            });
    ExpectPlacedClose(h, y, dt, M * C, ForwardTol(dt), true, "aggregate y");
    ExpectPlacedClose(h, dx, dt, M * K, ForwardTol(dt), true, "aggregate dx");
    ExpectClose(h, dhpre, DType::kF32, M * n, kMixTol, false,
                "aggregate dh_pre");
    ExpectPlacedClose(h, xo, dt, M * K, 0.0, true, "expand x");
    ExpectPlacedClose(h, de, dt, M * C, ForwardTol(dt), true, "expand de");
  }
}

// ---- Post: both directions of every row.

TEST(CudaDispatchTest, EveryPostRowRunsItsVariant) {
  MHC_SKIP_WITHOUT_GPU();
  const auto& rows = cuda::PostRows();
  for (size_t i = 0; i < rows.size(); ++i) {
    const LayerExample& e = rows[i].example;
    const LayerSpec spec = e.Spec();
    const DType dt = e.dtype;
    const std::string want(cuda::ToString(rows[i].variant));
    SCOPED_TRACE(RowName(i, e, want));
    const int64_t M = kTokens, C = spec.hidden, K = spec.K(), n = spec.n;
    const size_t es = DTypeSize(dt);
    Harness h;
    Placed f = PlaceAct(h, dt, M * C, e.alignment);
    Placed x = PlaceAct(h, dt, M * K, e.alignment);
    Placed dxn = PlaceAct(h, dt, M * K, e.alignment);
    Placed xn = PlaceOutput(h, M * K * es, e.alignment);
    Placed df = PlaceOutput(h, M * C * es, e.alignment);
    Placed dx = PlaceOutput(h, M * K * es, e.alignment);
    Pair hpost = h.Floats(M * n, FreshSeed(), 0.0f, 2.0f);
    Pair hres = h.Floats(M * n * n, FreshSeed(), 0.0f, 1.0f);
    Pair dhp = h.Output(M * n * 4);
    Pair dhr = h.Output(M * n * n * 4);
    PostForwardParams pf[2];
    PostBackwardParams pb[2];
    for (int b = 0; b < 2; ++b) {
      pf[b].spec = pb[b].spec = &spec;
      pf[b].tokens = pb[b].tokens = M;
      pf[b].act_dtype = pb[b].act_dtype = dt;
      pf[b].f = pb[b].f = f.ptr(b);
      pf[b].x = pb[b].x = x.ptr(b);
      pf[b].h_post = pb[b].h_post = hpost.f(b);
      pf[b].h_res = pb[b].h_res = hres.f(b);
      pf[b].x_next = xn.ptr(b);
      pb[b].dx_next = dxn.ptr(b);
      pb[b].df = df.ptr(b);
      pb[b].dx = dx.ptr(b);
      pb[b].dh_post = dhp.f(b);
      pb[b].dh_res = dhr.f(b);
    }
    // The examples' layers carry no post bias: only the rows constrain.
    ASSERT_FALSE(spec.has_post_bias);
    cuda::PostAlignment forward;
    forward.rows = LeastAlignment({pf[1].f, pf[1].x, pf[1].x_next});
    cuda::PostAlignment backward;
    backward.rows =
        LeastAlignment({pb[1].dx_next, pb[1].f, pb[1].x, pb[1].df, pb[1].dx});
    EXPECT_EQ(forward.rows, e.alignment);
    EXPECT_EQ(backward.rows, e.alignment);
    EXPECT_EQ(cuda::PlanPost(spec, dt, forward).row, static_cast<int>(i));
    EXPECT_EQ(cuda::PlanPost(spec, dt, backward).row, static_cast<int>(i));
    EXPECT_EQ(h.cuda().KernelVariant(pf[1]), want);
    EXPECT_EQ(h.cuda().KernelVariant(pb[1]), want);
    RunBoth(h, pf, OpKind::kPostForward, spec, dt,
            [](Backend& be, const PostForwardParams& p, Workspace ws) {
              return be.PostForward(p, ws);
            });
    RunBoth(h, pb, OpKind::kPostBackward, spec, dt,
            [](Backend& be, const PostBackwardParams& p, Workspace ws) {
              return be.PostBackward(p, ws);
            });
    ExpectPlacedClose(h, xn, dt, M * K, ForwardTol(dt), true, "post x_next");
    if (dt == DType::kF32) {
      // df and dx sum n products that can cancel: measured against the
      // products' scale.
      const double dxn_scale = PlacedMaxAbs(dxn, dt, M * K);
      ExpectPlacedClose(h, df, dt, M * C, ForwardTol(dt), false, "post df",
                        MaxAbs(hpost, DType::kF32, M * n) * dxn_scale);
      ExpectPlacedClose(h, dx, dt, M * K, ForwardTol(dt), false, "post dx",
                        MaxAbs(hres, DType::kF32, M * n * n) * dxn_scale);
    } else {
      ExpectPlacedClose(h, df, dt, M * C, ForwardTol(dt), true, "post df");
      ExpectPlacedClose(h, dx, dt, M * K, ForwardTol(dt), true, "post dx");
    }
    ExpectClose(h, dhp, DType::kF32, M * n, kMixTol, false, "post dh_post");
    ExpectClose(h, dhr, DType::kF32, M * n * n, kMixTol, false, "post dh_res");
  }
}

// ---- Fused pre: the forward rows forward, the backward rows backward.

// One layer's parameters and the pre op's per-token tensors.
struct PreRun {
  Pair phi, alpha, beta;
  LayerWeights w[2];
  Pair x, dy;
};
PreRun MakePreRun(Harness& h, const LayerSpec& spec, DType dt) {
  const int64_t N = spec.NumLogits(), K = spec.K(), M = kTokens;
  const float scale = 1.0f / std::sqrt(static_cast<float>(K));
  PreRun r;
  r.phi = h.Floats(N * K, FreshSeed(), -scale, scale);
  r.alpha = h.Floats(3, FreshSeed(), 0.5f, 1.5f);
  r.beta = h.Floats(N, FreshSeed());
  for (int b = 0; b < 2; ++b) {
    r.w[b].phi = spec.dynamic ? r.phi.f(b) : nullptr;
    r.w[b].alpha = spec.dynamic ? r.alpha.f(b) : nullptr;
    r.w[b].beta = r.beta.f(b);
  }
  r.x = h.Act(dt, M * K, FreshSeed());
  r.dy = h.Act(dt, M * spec.hidden, FreshSeed());
  return r;
}

// The mixing values come from the projection: under TF32 its operands are
// rounded to 11 bits (the projection tests' 2e-3).
double MixTol(const LayerSpec& spec) {
  return spec.matmul_precision == MatmulPrecision::kIeee ? kMixTol : 2e-3;
}

TEST(CudaDispatchTest, EveryFusedForwardRowRunsItsVariant) {
  MHC_SKIP_WITHOUT_GPU();
  const auto& rows = cuda::FusedForwardRows();
  for (size_t i = 0; i < rows.size(); ++i) {
    const LayerExample& e = rows[i].example;
    const LayerSpec spec = e.Spec();
    const DType dt = e.dtype;
    const std::string want(cuda::ToString(rows[i].variant));
    SCOPED_TRACE(RowName(i, e, want));
    const int64_t M = kTokens, C = spec.hidden, K = spec.K(), n = spec.n;
    Harness h;
    PreRun r = MakePreRun(h, spec, dt);
    Pair y = h.Output(M * C * DTypeSize(dt));
    Pair hp = h.Output(M * n * 4);
    Pair hq = h.Output(M * n * 4);
    Pair hr = h.Output(M * n * n * 4);
    PreForwardParams p[2];
    for (int b = 0; b < 2; ++b) {
      p[b].spec = &spec;
      p[b].tokens = M;
      p[b].act_dtype = dt;
      p[b].x = r.x.ptr(b);
      p[b].weights = r.w[b];
      p[b].y = y.ptr(b);
      p[b].h_pre = hp.f(b);
      p[b].h_post = hq.f(b);
      p[b].h_res = hr.f(b);
    }
    EXPECT_EQ(cuda::PlanFusedForward(spec).row, static_cast<int>(i));
    EXPECT_EQ(h.cuda().KernelVariant(p[1]), want);
    RunBoth(h, p, OpKind::kPreForward, spec, dt,
            [](Backend& be, const PreForwardParams& q, Workspace ws) {
              return be.PreForward(q, ws);
            });
    // y = sum_i h_pre[i] x[i][c] can cancel far below its terms: measured
    // against the scale of x (h_pre <= 1).
    ExpectCloseWithFloor(h, y, dt, M * C, MaxAbs(r.x, dt, M * K),
                         ForwardTol(dt), "pre y");
    ExpectClose(h, hp, DType::kF32, M * n, MixTol(spec), false, "pre h_pre");
    ExpectClose(h, hq, DType::kF32, M * n, MixTol(spec), false, "pre h_post");
    ExpectClose(h, hr, DType::kF32, M * n * n, MixTol(spec), false,
                "pre h_res");
  }
}

TEST(CudaDispatchTest, EveryFusedBackwardRowRunsItsVariant) {
  MHC_SKIP_WITHOUT_GPU();
  const auto& rows = cuda::FusedBackwardRows();
  for (size_t i = 0; i < rows.size(); ++i) {
    const LayerExample& e = rows[i].example;
    const LayerSpec spec = e.Spec();
    const DType dt = e.dtype;
    const std::string want(cuda::ToString(rows[i].variant));
    SCOPED_TRACE(RowName(i, e, want));
    const int64_t M = kTokens, K = spec.K(), n = spec.n;
    const int64_t N = spec.NumLogits();
    Harness h;
    PreRun r = MakePreRun(h, spec, dt);
    Pair dhq = h.Floats(M * n, FreshSeed());
    Pair dhr = h.Floats(M * n * n, FreshSeed());
    Pair dxn = h.Act(dt, M * K, FreshSeed());
    Pair dx = h.Output(M * K * DTypeSize(dt));
    // Accumulators from random values: a sum over tokens that cancels is
    // then measured against them (ExpectAccumulated).
    const std::vector<float> init = RandomFloats(N * K + 3 + N, 11);
    const float* init_phi = init.data();
    const float* init_alpha = init_phi + N * K;
    const float* init_beta = init_alpha + 3;
    Pair gphi = h.Input(init_phi, N * K * 4);
    Pair galpha = h.Input(init_alpha, 3 * 4);
    Pair gbeta = h.Input(init_beta, N * 4);
    PreBackwardParams q[2];
    for (int b = 0; b < 2; ++b) {
      q[b].spec = &spec;
      q[b].tokens = M;
      q[b].act_dtype = dt;
      q[b].x = r.x.ptr(b);
      q[b].weights = r.w[b];
      q[b].dy = r.dy.ptr(b);
      q[b].dh_post = dhq.f(b);
      q[b].dh_res = dhr.f(b);
      q[b].dx_next = dxn.ptr(b);
      q[b].dx = dx.ptr(b);
      q[b].grads.phi = spec.dynamic ? gphi.f(b) : nullptr;
      q[b].grads.alpha = spec.dynamic ? galpha.f(b) : nullptr;
      q[b].grads.beta = gbeta.f(b);
    }
    EXPECT_EQ(cuda::PlanFusedBackward(spec).row, static_cast<int>(i));
    EXPECT_EQ(h.cuda().KernelVariant(q[1]), want);
    RunBoth(h, q, OpKind::kPreBackward, spec, dt,
            [](Backend& be, const PreBackwardParams& p, Workspace ws) {
              return be.PreBackward(p, ws);
            });
    ExpectClose(h, dx, dt, M * K, BackwardTol(dt), false, "pre dx");
    ExpectAccumulated(h, gbeta, init_beta, N, BackwardTol(dt), "dbeta");
    if (spec.dynamic) {
      ExpectAccumulated(h, gphi, init_phi, N * K, BackwardTol(dt), "dphi");
      ExpectAccumulated(h, galpha, init_alpha, spec.NumAlpha(), BackwardTol(dt),
                        "dalpha");
    }
  }
}

}  // namespace
}  // namespace mhc::testing
