// Finite-difference checks of the single-op reference backward: projection,
// scale, aggregate, post, expand. Every gradient of every op, both layouts,
// n in {1, 2, 4, 5}, against float64 central differences to 1e-6 relative.
#include <cmath>
#include <tuple>
#include <vector>

#include "cpu/reference/reference_math.h"
#include "gtest/gtest.h"
#include "reference_test_util.h"

namespace mhc::testing {
namespace {

constexpr int64_t kTokens = 2;
constexpr int64_t kHidden = 3;

class OpsGradTest : public ::testing::TestWithParam<std::tuple<int, Layout>> {
 protected:
  LayerSpec Spec() const {
    return SmallSpec(std::get<0>(GetParam()), kHidden, std::get<1>(GetParam()));
  }
};

TEST_P(OpsGradTest, Projection) {
  for (LayerKind kind : {LayerKind::kMhc, LayerKind::kHead}) {
    for (bool has_gamma : {false, true}) {
      LayerSpec spec = Spec();
      spec.kind = kind;
      spec.has_gamma = has_gamma;
      const std::string name = SpecName(spec) +
                               (kind == LayerKind::kHead ? " head" : " mhc") +
                               (has_gamma ? " gamma" : "");
      const int64_t rows = spec.NumLogits();
      std::vector<double> x = RandomDoubles(kTokens * spec.K());
      DoubleParams params = DoubleParams::Random(spec);
      const std::vector<double> wh = RandomDoubles(kTokens * rows);
      const std::vector<double> wms = RandomDoubles(kTokens);
      auto loss = [&] {
        std::vector<double> h(kTokens * rows), ms(kTokens);
        reference::ProjectionForward(spec, kTokens, x.data(), params.View(),
                                     h.data(), ms.data());
        return Dot(h, wh) + Dot(ms, wms);
      };
      DoubleParams grads = params.ZerosLike();
      std::vector<double> dx(x.size());
      reference::ProjectionBackward(spec, kTokens, x.data(), params.View(),
                                    wh.data(), wms.data(), dx.data(),
                                    grads.GradView());
      ExpectGradientsMatch(dx, NumericGradient(x, loss), name + " dx");
      ExpectGradientsMatch(grads.phi, NumericGradient(params.phi, loss),
                           name + " dphi");
      if (has_gamma) {
        ExpectGradientsMatch(grads.gamma, NumericGradient(params.gamma, loss),
                             name + " dgamma");
      }
      // The mean-square path alone (dh = 0) reaches x through 2 v / K.
      const std::vector<double> zeros(kTokens * rows, 0.0);
      auto ms_loss = [&] {
        std::vector<double> h(kTokens * rows), ms(kTokens);
        reference::ProjectionForward(spec, kTokens, x.data(), params.View(),
                                     h.data(), ms.data());
        return Dot(ms, wms);
      };
      reference::ProjectionBackward(spec, kTokens, x.data(), params.View(),
                                    zeros.data(), wms.data(), dx.data(), {});
      ExpectGradientsMatch(dx, NumericGradient(x, ms_loss),
                           name + " dx (ms path)");
    }
  }
}

TEST_P(OpsGradTest, Scale) {
  struct Variant {
    LayerKind kind;
    bool dynamic;
    EpsPlacement placement;
  };
  const Variant variants[] = {
      {LayerKind::kMhc, true, EpsPlacement::kInside},
      {LayerKind::kMhc, true, EpsPlacement::kOutside},
      {LayerKind::kMhc, false, EpsPlacement::kInside},
      {LayerKind::kHead, true, EpsPlacement::kInside},
      {LayerKind::kHead, true, EpsPlacement::kOutside},
  };
  for (const Variant& variant : variants) {
    LayerSpec spec = Spec();
    spec.kind = variant.kind;
    spec.dynamic = variant.dynamic;
    spec.eps_placement = variant.placement;
    spec.eps_rms = 0.1f;  // large enough that the placement matters
    spec.eps_pre = 0.01f;
    spec.post_mult = 2.0f;
    const bool mhc = variant.kind == LayerKind::kMhc;
    const std::string name =
        SpecName(spec) + (mhc ? " mhc" : " head") +
        (variant.dynamic ? "" : " static") +
        (variant.placement == EpsPlacement::kInside ? " inside" : " outside");
    const int n = spec.n;
    const int64_t rows = spec.NumLogits();
    std::vector<double> h = RandomDoubles(kTokens * rows, -2.0, 2.0);
    std::vector<double> ms = RandomDoubles(kTokens, 0.2, 2.0);
    DoubleParams params = DoubleParams::Random(spec);
    const std::vector<double> w_pre = RandomDoubles(kTokens * n);
    const std::vector<double> w_post = RandomDoubles(mhc ? kTokens * n : 0);
    const std::vector<double> w_logits =
        RandomDoubles(mhc ? kTokens * n * n : 0);
    auto loss = [&] {
      std::vector<double> h_pre(kTokens * n), h_post(w_post.size()),
          logits(w_logits.size());
      reference::ScaleForward(spec, kTokens, h.data(), ms.data(), params.View(),
                              h_pre.data(), h_post.data(), logits.data());
      return Dot(h_pre, w_pre) + Dot(h_post, w_post) + Dot(logits, w_logits);
    };
    DoubleParams grads = params.ZerosLike();
    std::vector<double> dh(h.size()), dms(ms.size());
    reference::ScaleBackward(spec, kTokens, h.data(), ms.data(), params.View(),
                             w_pre.data(), w_post.data(), w_logits.data(),
                             dh.data(), dms.data(), grads.GradView());
    ExpectGradientsMatch(grads.beta, NumericGradient(params.beta, loss),
                         name + " dbeta");
    if (variant.dynamic) {
      ExpectGradientsMatch(dh, NumericGradient(h, loss), name + " dh");
      ExpectGradientsMatch(dms, NumericGradient(ms, loss), name + " dms");
      ExpectGradientsMatch(grads.alpha, NumericGradient(params.alpha, loss),
                           name + " dalpha");
    }
  }
}

// OUTSIDE placement at ms = 0 (a token whose x is all zeros): the derivative
// of sqrt is unbounded there, the gradient must still be finite.
TEST_P(OpsGradTest, ScaleOutsideAtZeroMeanSquareIsFinite) {
  LayerSpec spec = Spec();
  spec.eps_placement = EpsPlacement::kOutside;
  const int n = spec.n;
  const int64_t rows = spec.NumLogits();
  std::vector<double> h = RandomDoubles(kTokens * rows);
  for (int64_t g = 0; g < rows; ++g) h[g] = 0.0;  // token 0: v = 0 => h = 0
  std::vector<double> ms = {0.0, 0.5};
  DoubleParams params = DoubleParams::Random(spec);
  const std::vector<double> w_pre = RandomDoubles(kTokens * n);
  const std::vector<double> w_post = RandomDoubles(kTokens * n);
  const std::vector<double> w_logits = RandomDoubles(kTokens * n * n);
  DoubleParams grads = params.ZerosLike();
  std::vector<double> dh(h.size()), dms(ms.size());
  reference::ScaleBackward(spec, kTokens, h.data(), ms.data(), params.View(),
                           w_pre.data(), w_post.data(), w_logits.data(),
                           dh.data(), dms.data(), grads.GradView());
  EXPECT_EQ(dms[0], 0.0);
  EXPECT_TRUE(std::isfinite(dms[1]));
  for (double value : dh) EXPECT_TRUE(std::isfinite(value));
  for (double value : grads.alpha) EXPECT_TRUE(std::isfinite(value));
  EXPECT_EQ(reference::RmsFactorDerivative(spec, 0.0), 0.0);
}

TEST_P(OpsGradTest, Aggregate) {
  const LayerSpec spec = Spec();
  const int n = spec.n;
  std::vector<double> x = RandomDoubles(kTokens * spec.K());
  std::vector<double> h_pre = RandomDoubles(kTokens * n, 0.1, 1.0);
  const std::vector<double> wy = RandomDoubles(kTokens * spec.hidden);
  auto loss = [&] {
    std::vector<double> y(wy.size());
    reference::AggregateForward(spec, kTokens, x.data(), h_pre.data(),
                                y.data());
    return Dot(y, wy);
  };
  std::vector<double> dx(x.size()), dh_pre(h_pre.size());
  reference::AggregateBackward(spec, kTokens, x.data(), h_pre.data(), wy.data(),
                               dx.data(), dh_pre.data());
  ExpectGradientsMatch(dx, NumericGradient(x, loss), SpecName(spec) + " dx");
  ExpectGradientsMatch(dh_pre, NumericGradient(h_pre, loss),
                       SpecName(spec) + " dH_pre");
}

TEST_P(OpsGradTest, Post) {
  for (Orientation orientation :
       {Orientation::kSourceRows, Orientation::kDestRows}) {
    for (bool has_bias : {false, true}) {
      LayerSpec spec = Spec();
      spec.orientation = orientation;
      spec.has_post_bias = has_bias;
      const std::string name =
          SpecName(spec) +
          (orientation == Orientation::kSourceRows ? " source_rows"
                                                   : " dest_rows") +
          (has_bias ? " bias" : "");
      const int n = spec.n;
      std::vector<double> f = RandomDoubles(kTokens * spec.hidden);
      std::vector<double> x = RandomDoubles(kTokens * spec.K());
      std::vector<double> h_post = RandomDoubles(kTokens * n, 0.0, 2.0);
      std::vector<double> h_res = RandomDoubles(kTokens * n * n, 0.0, 1.0);
      DoubleParams params = DoubleParams::Random(spec);
      const std::vector<double> wn = RandomDoubles(kTokens * spec.K());
      auto loss = [&] {
        std::vector<double> x_next(wn.size());
        reference::PostForward(spec, kTokens, f.data(), x.data(), h_post.data(),
                               h_res.data(), params.View(), x_next.data());
        return Dot(x_next, wn);
      };
      DoubleParams grads = params.ZerosLike();
      std::vector<double> df(f.size()), dx(x.size()), dh_post(h_post.size()),
          dh_res(h_res.size());
      reference::PostBackward(spec, kTokens, wn.data(), f.data(), x.data(),
                              h_post.data(), h_res.data(), params.View(),
                              df.data(), dx.data(), dh_post.data(),
                              dh_res.data(), grads.GradView());
      ExpectGradientsMatch(df, NumericGradient(f, loss), name + " df");
      ExpectGradientsMatch(dx, NumericGradient(x, loss), name + " dx");
      ExpectGradientsMatch(dh_post, NumericGradient(h_post, loss),
                           name + " dH_post");
      ExpectGradientsMatch(dh_res, NumericGradient(h_res, loss),
                           name + " dH_res");
      if (has_bias) {
        ExpectGradientsMatch(grads.bias, NumericGradient(params.bias, loss),
                             name + " dbias");
      }
    }
  }
}

TEST_P(OpsGradTest, Expand) {
  const LayerSpec spec = Spec();
  std::vector<double> e = RandomDoubles(kTokens * spec.hidden);
  const std::vector<double> wx = RandomDoubles(kTokens * spec.K());
  auto loss = [&] {
    std::vector<double> x(wx.size());
    reference::ExpandForward(spec, kTokens, e.data(), x.data());
    return Dot(x, wx);
  };
  std::vector<double> de(e.size());
  reference::ExpandBackward(spec, kTokens, wx.data(), de.data());
  ExpectGradientsMatch(de, NumericGradient(e, loss), SpecName(spec) + " de");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, OpsGradTest,
    ::testing::Combine(::testing::Values(1, 2, 4, 5),
                       ::testing::Values(Layout::kStreamMajor,
                                         Layout::kStreamMinor)),
    [](const ::testing::TestParamInfo<OpsGradTest::ParamType>& info) {
      return "n" + std::to_string(std::get<0>(info.param)) + "_" +
             std::string(LayoutName(std::get<1>(info.param)));
    });

}  // namespace
}  // namespace mhc::testing
