// Finite-difference checks of the fused reference ops: pre (with and without
// the post's dx_next folded in, dynamic and static) and head. Every input and
// parameter gradient, both layouts, n in {1, 2, 3, 4, 5}.
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/reference/reference_math.h"
#include "gtest/gtest.h"
#include "reference_test_util.h"

namespace mhc::testing {
namespace {

constexpr int64_t kTokens = 2;
constexpr int64_t kHidden = 3;

// The knobs that change the pre's math, beyond n and the layout.
struct PreVariant {
  const char* name;
  SinkhornMode mode;
  EpsPlacement placement;
  Orientation orientation;
  bool has_gamma;
  bool has_bias;
};

constexpr PreVariant kPreVariants[] = {
    {"linear_inside_source", SinkhornMode::kLinear, EpsPlacement::kInside,
     Orientation::kSourceRows, true, false},
    {"log_outside_dest", SinkhornMode::kLog, EpsPlacement::kOutside,
     Orientation::kDestRows, true, true},
    {"linear_outside_nogamma", SinkhornMode::kLinear, EpsPlacement::kOutside,
     Orientation::kSourceRows, false, true},
};

class FusedGradTest : public ::testing::TestWithParam<std::tuple<int, Layout>> {
 protected:
  LayerSpec Spec(const PreVariant& v) const {
    LayerSpec spec =
        SmallSpec(std::get<0>(GetParam()), kHidden, std::get<1>(GetParam()));
    spec.sinkhorn_mode = v.mode;
    spec.eps_placement = v.placement;
    spec.orientation = v.orientation;
    spec.has_gamma = v.has_gamma;
    spec.has_post_bias = v.has_bias;
    spec.eps_rms = 0.05f;
    spec.eps_pre = 0.01f;
    return spec;
  }
};

// The pre's own outputs: L = <y, wy> + <H_post, wp> + <H_res, wr>.
TEST_P(FusedGradTest, PreBackward) {
  for (const PreVariant& variant : kPreVariants) {
    for (bool dynamic : {true, false}) {
      LayerSpec spec = Spec(variant);
      spec.dynamic = dynamic;
      if (!dynamic) spec.has_gamma = false;
      const std::string name =
          SpecName(spec) + " " + variant.name + (dynamic ? "" : " static");
      const int n = spec.n;
      std::vector<double> x = RandomDoubles(kTokens * spec.K());
      DoubleParams params = DoubleParams::Random(spec);
      const std::vector<double> wy = RandomDoubles(kTokens * spec.hidden);
      const std::vector<double> wp = RandomDoubles(kTokens * n);
      const std::vector<double> wr = RandomDoubles(kTokens * n * n);
      auto loss = [&] {
        std::vector<double> y(wy.size()), h_post(wp.size()), h_res(wr.size());
        reference::PreForward(spec, kTokens, x.data(), params.View(), y.data(),
                              nullptr, h_post.data(), h_res.data());
        return Dot(y, wy) + Dot(h_post, wp) + Dot(h_res, wr);
      };
      DoubleParams grads = params.ZerosLike();
      std::vector<double> dx(x.size());
      reference::PreBackward(spec, kTokens, x.data(), params.View(), wy.data(),
                             wp.data(), wr.data(), nullptr, dx.data(),
                             grads.GradView());
      ExpectGradientsMatch(dx, NumericGradient(x, loss), name + " dx");
      ExpectGradientsMatch(grads.beta, NumericGradient(params.beta, loss),
                           name + " dbeta");
      if (!dynamic) continue;
      ExpectGradientsMatch(grads.phi, NumericGradient(params.phi, loss),
                           name + " dphi");
      ExpectGradientsMatch(grads.alpha, NumericGradient(params.alpha, loss),
                           name + " dalpha");
      if (spec.has_gamma) {
        ExpectGradientsMatch(grads.gamma, NumericGradient(params.gamma, loss),
                             name + " dgamma");
      }
    }
  }
}

// The whole layer with F's output f held fixed: L = <y, wy> + <x_next, wn>,
// x_next = post(f, x, H_post(x), H_res(x)). The analytic side is the post
// backward (dH_post, dH_res, no dx) followed by the pre backward with dx_next,
// which folds the residual path into dx.
TEST_P(FusedGradTest, LayerBackwardWithDxNext) {
  for (const PreVariant& variant : kPreVariants) {
    for (bool dynamic : {true, false}) {
      LayerSpec spec = Spec(variant);
      spec.dynamic = dynamic;
      if (!dynamic) spec.has_gamma = false;
      const std::string name =
          SpecName(spec) + " " + variant.name + (dynamic ? "" : " static");
      const int n = spec.n;
      std::vector<double> x = RandomDoubles(kTokens * spec.K());
      std::vector<double> f = RandomDoubles(kTokens * spec.hidden);
      DoubleParams params = DoubleParams::Random(spec);
      const std::vector<double> wy = RandomDoubles(kTokens * spec.hidden);
      const std::vector<double> wn = RandomDoubles(kTokens * spec.K());
      auto loss = [&] {
        std::vector<double> y(wy.size()), h_post(kTokens * n),
            h_res(kTokens * n * n), x_next(wn.size());
        reference::PreForward(spec, kTokens, x.data(), params.View(), y.data(),
                              nullptr, h_post.data(), h_res.data());
        reference::PostForward(spec, kTokens, f.data(), x.data(), h_post.data(),
                               h_res.data(), params.View(), x_next.data());
        return Dot(y, wy) + Dot(x_next, wn);
      };
      std::vector<double> y(wy.size()), h_post(kTokens * n),
          h_res(kTokens * n * n);
      reference::PreForward(spec, kTokens, x.data(), params.View(), y.data(),
                            nullptr, h_post.data(), h_res.data());
      DoubleParams grads = params.ZerosLike();
      std::vector<double> df(f.size()), dh_post(h_post.size()),
          dh_res(h_res.size()), dx(x.size());
      reference::PostBackward(spec, kTokens, wn.data(), f.data(), x.data(),
                              h_post.data(), h_res.data(), params.View(),
                              df.data(), nullptr, dh_post.data(), dh_res.data(),
                              grads.GradView());
      reference::PreBackward(spec, kTokens, x.data(), params.View(), wy.data(),
                             dh_post.data(), dh_res.data(), wn.data(),
                             dx.data(), grads.GradView());
      ExpectGradientsMatch(dx, NumericGradient(x, loss), name + " dx");
      ExpectGradientsMatch(df, NumericGradient(f, loss), name + " df");
      ExpectGradientsMatch(grads.beta, NumericGradient(params.beta, loss),
                           name + " dbeta");
      if (spec.has_post_bias) {
        ExpectGradientsMatch(grads.bias, NumericGradient(params.bias, loss),
                             name + " dbias");
      }
      if (!dynamic) continue;
      ExpectGradientsMatch(grads.phi, NumericGradient(params.phi, loss),
                           name + " dphi");
      ExpectGradientsMatch(grads.alpha, NumericGradient(params.alpha, loss),
                           name + " dalpha");
      if (spec.has_gamma) {
        ExpectGradientsMatch(grads.gamma, NumericGradient(params.gamma, loss),
                             name + " dgamma");
      }
    }
  }
}

TEST_P(FusedGradTest, HeadBackward) {
  for (EpsPlacement placement :
       {EpsPlacement::kInside, EpsPlacement::kOutside}) {
    for (bool has_gamma : {false, true}) {
      LayerSpec spec =
          SmallSpec(std::get<0>(GetParam()), kHidden, std::get<1>(GetParam()));
      spec.kind = LayerKind::kHead;
      spec.eps_placement = placement;
      spec.eps_rms = 0.05f;
      spec.eps_pre = 0.01f;
      spec.has_gamma = has_gamma;
      const std::string name =
          SpecName(spec) + " head" +
          (placement == EpsPlacement::kInside ? " inside" : " outside") +
          (has_gamma ? " gamma" : "");
      std::vector<double> x = RandomDoubles(kTokens * spec.K());
      DoubleParams params = DoubleParams::Random(spec);
      const std::vector<double> wy = RandomDoubles(kTokens * spec.hidden);
      auto loss = [&] {
        std::vector<double> y(wy.size());
        reference::HeadForward(spec, kTokens, x.data(), params.View(), y.data(),
                               nullptr);
        return Dot(y, wy);
      };
      DoubleParams grads = params.ZerosLike();
      std::vector<double> dx(x.size());
      reference::HeadBackward(spec, kTokens, x.data(), params.View(), wy.data(),
                              dx.data(), grads.GradView());
      ExpectGradientsMatch(dx, NumericGradient(x, loss), name + " dx");
      ExpectGradientsMatch(grads.phi, NumericGradient(params.phi, loss),
                           name + " dphi");
      ExpectGradientsMatch(grads.alpha, NumericGradient(params.alpha, loss),
                           name + " ds");
      ExpectGradientsMatch(grads.beta, NumericGradient(params.beta, loss),
                           name + " db");
      if (has_gamma) {
        ExpectGradientsMatch(grads.gamma, NumericGradient(params.gamma, loss),
                             name + " dgamma");
      }
    }
  }
}

// OUTSIDE placement at a token whose x is all zeros (ms = 0): the sqrt has an
// unbounded derivative there, but z = alpha (phi' v) r(ms) + beta is
// differentiable in v with derivative alpha phi' r(0), which is what the
// reference returns (dms is defined as 0). A symmetric difference with a tiny
// step sees r(ms(+h)) = r(ms(-h)), so it converges to the same value.
TEST_P(FusedGradTest, PreOutsideAtZeroMeanSquare) {
  LayerSpec spec = Spec(kPreVariants[0]);
  spec.eps_placement = EpsPlacement::kOutside;
  spec.eps_rms = 0.25f;
  std::vector<double> x = RandomDoubles(kTokens * spec.K());
  for (int64_t k = 0; k < spec.K(); ++k) x[k] = 0.0;  // token 0
  DoubleParams params = DoubleParams::Random(spec);
  const int n = spec.n;
  const std::vector<double> wy = RandomDoubles(kTokens * spec.hidden);
  const std::vector<double> wp = RandomDoubles(kTokens * n);
  const std::vector<double> wr = RandomDoubles(kTokens * n * n);
  auto loss = [&] {
    std::vector<double> y(wy.size()), h_post(wp.size()), h_res(wr.size());
    reference::PreForward(spec, kTokens, x.data(), params.View(), y.data(),
                          nullptr, h_post.data(), h_res.data());
    return Dot(y, wy) + Dot(h_post, wp) + Dot(h_res, wr);
  };
  DoubleParams grads = params.ZerosLike();
  std::vector<double> dx(x.size());
  reference::PreBackward(spec, kTokens, x.data(), params.View(), wy.data(),
                         wp.data(), wr.data(), nullptr, dx.data(),
                         grads.GradView());
  for (double value : dx) ASSERT_TRUE(std::isfinite(value));
  for (double value : grads.phi) ASSERT_TRUE(std::isfinite(value));
  for (double value : grads.alpha) ASSERT_TRUE(std::isfinite(value));
  // Token 0 only, two-point symmetric difference with a tiny step: the kink
  // of r at 0 makes the error O(h).
  std::vector<double> numeric(spec.K());
  for (int64_t k = 0; k < spec.K(); ++k) {
    const double h = 1e-8;
    x[k] = h;
    const double plus = loss();
    x[k] = -h;
    const double minus = loss();
    x[k] = 0.0;
    numeric[k] = (plus - minus) / (2 * h);
  }
  ExpectGradientsMatch(std::vector<double>(dx.begin(), dx.begin() + spec.K()),
                       numeric, SpecName(spec) + " dx at ms = 0", 1e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, FusedGradTest,
    ::testing::Combine(::testing::Values(1, 2, 3, 4, 5),
                       ::testing::Values(Layout::kStreamMajor,
                                         Layout::kStreamMinor)),
    [](const ::testing::TestParamInfo<FusedGradTest::ParamType>& info) {
      return "n" + std::to_string(std::get<0>(info.param)) + "_" +
             std::string(LayoutName(std::get<1>(info.param)));
    });

}  // namespace
}  // namespace mhc::testing
