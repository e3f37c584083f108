// Algebraic properties of the reference: the fused pre equals its
// composition, STREAM_MINOR equals STREAM_MAJOR after the column permutation,
// every preset runs, M = 0 is a no-op, NaN/Inf in x reach y.
#include <cmath>
#include <string>
#include <vector>

#include "cpu/reference/reference_math.h"
#include "gtest/gtest.h"
#include "mhc/backend.h"
#include "reference_test_util.h"

namespace mhc::testing {
namespace {

void ExpectClose(const std::vector<double>& want,
                 const std::vector<double>& got, const std::string& what,
                 double tolerance = 1e-12) {
  ASSERT_EQ(want.size(), got.size()) << what;
  double scale = 0.0;
  for (double value : want) scale = std::max(scale, std::fabs(value));
  for (size_t e = 0; e < want.size(); ++e) {
    EXPECT_NEAR(want[e], got[e], tolerance * std::max(scale, 1.0))
        << what << " [" << e << "]";
  }
}

// STREAM_MAJOR -> STREAM_MINOR order of `rows` vectors of length K = n*C.
std::vector<double> ToMinor(const std::vector<double>& major, int n,
                            int64_t hidden) {
  const int64_t k_size = n * hidden;
  std::vector<double> minor(major.size());
  for (size_t base = 0; base < major.size(); base += k_size) {
    for (int i = 0; i < n; ++i) {
      for (int64_t c = 0; c < hidden; ++c) {
        minor[base + c * n + i] = major[base + i * hidden + c];
      }
    }
  }
  return minor;
}

TEST(ReferencePropertiesTest, FusedPreEqualsComposition) {
  for (int n : {1, 3, 4}) {
    for (bool dynamic : {true, false}) {
      LayerSpec spec = SmallSpec(n, 7, Layout::kStreamMinor);
      spec.dynamic = dynamic;
      spec.has_gamma = dynamic;
      const int64_t tokens = 5;
      const int64_t rows = spec.NumLogits();
      const std::vector<double> x = RandomDoubles(tokens * spec.K());
      const DoubleParams params = DoubleParams::Random(spec);
      // Composition.
      std::vector<double> h(tokens * rows), ms(tokens), h_pre(tokens * n),
          h_post(tokens * n), logits(tokens * n * n), h_res(tokens * n * n),
          y(tokens * spec.hidden);
      if (dynamic) {
        reference::ProjectionForward(spec, tokens, x.data(), params.View(),
                                     h.data(), ms.data());
      }
      reference::ScaleForward(spec, tokens, h.data(), ms.data(), params.View(),
                              h_pre.data(), h_post.data(), logits.data());
      reference::SinkhornForward(spec, tokens, logits.data(), h_res.data());
      reference::AggregateForward(spec, tokens, x.data(), h_pre.data(),
                                  y.data());
      // Fused.
      std::vector<double> fy(y.size()), fh_pre(h_pre.size()),
          fh_post(h_post.size()), fh_res(h_res.size());
      reference::PreForward(spec, tokens, x.data(), params.View(), fy.data(),
                            fh_pre.data(), fh_post.data(), fh_res.data());
      ExpectClose(y, fy, "y", 0.0);
      ExpectClose(h_pre, fh_pre, "H_pre", 0.0);
      ExpectClose(h_post, fh_post, "H_post", 0.0);
      ExpectClose(h_res, fh_res, "H_res", 0.0);

      // Backward, composed in reverse.
      const std::vector<double> dy = RandomDoubles(y.size());
      const std::vector<double> dh_post = RandomDoubles(h_post.size());
      const std::vector<double> dh_res = RandomDoubles(h_res.size());
      DoubleParams grads = params.ZerosLike();
      std::vector<double> dx(x.size()), dh_pre(h_pre.size()),
          dlogits(logits.size()), dh(h.size()), dms(ms.size()),
          dx_projection(x.size());
      reference::AggregateBackward(spec, tokens, x.data(), h_pre.data(),
                                   dy.data(), dx.data(), dh_pre.data());
      reference::SinkhornBackward(spec, tokens, logits.data(), dh_res.data(),
                                  dlogits.data());
      reference::ScaleBackward(spec, tokens, h.data(), ms.data(), params.View(),
                               dh_pre.data(), dh_post.data(), dlogits.data(),
                               dh.data(), dms.data(), grads.GradView());
      if (dynamic) {
        reference::ProjectionBackward(spec, tokens, x.data(), params.View(),
                                      dh.data(), dms.data(),
                                      dx_projection.data(), grads.GradView());
        for (size_t e = 0; e < dx.size(); ++e) dx[e] += dx_projection[e];
      }
      DoubleParams fused_grads = params.ZerosLike();
      std::vector<double> fdx(x.size());
      reference::PreBackward(spec, tokens, x.data(), params.View(), dy.data(),
                             dh_post.data(), dh_res.data(), nullptr, fdx.data(),
                             fused_grads.GradView());
      ExpectClose(dx, fdx, "dx");
      ExpectClose(grads.phi, fused_grads.phi, "dphi");
      ExpectClose(grads.alpha, fused_grads.alpha, "dalpha");
      ExpectClose(grads.beta, fused_grads.beta, "dbeta");
      ExpectClose(grads.gamma, fused_grads.gamma, "dgamma");
    }
  }
}

// STREAM_MINOR with x, phi columns and gamma permuted gives the STREAM_MAJOR
// results (docs/SPEC.md section 1: converting a layer's weights is a
// permutation).
TEST(ReferencePropertiesTest, LayoutsAreEquivalent) {
  for (int n : {1, 2, 4, 5}) {
    LayerSpec major = SmallSpec(n, 6, Layout::kStreamMajor);
    major.has_gamma = true;
    major.has_post_bias = true;
    LayerSpec minor = major;
    minor.layout = Layout::kStreamMinor;
    const int64_t tokens = 3;
    const int64_t hidden = major.hidden;
    const std::vector<double> x = RandomDoubles(tokens * major.K());
    const std::vector<double> x_minor = ToMinor(x, n, hidden);
    const DoubleParams params = DoubleParams::Random(major);
    DoubleParams params_minor = params;
    params_minor.phi = ToMinor(params.phi, n, hidden);
    params_minor.gamma = ToMinor(params.gamma, n, hidden);

    // Pre forward.
    std::vector<double> y(tokens * hidden), h_post(tokens * n),
        h_res(tokens * n * n);
    auto y2 = y, h_post2 = h_post, h_res2 = h_res;
    reference::PreForward(major, tokens, x.data(), params.View(), y.data(),
                          nullptr, h_post.data(), h_res.data());
    reference::PreForward(minor, tokens, x_minor.data(), params_minor.View(),
                          y2.data(), nullptr, h_post2.data(), h_res2.data());
    ExpectClose(y, y2, "y");
    ExpectClose(h_post, h_post2, "H_post");
    ExpectClose(h_res, h_res2, "H_res");

    // Post forward and backward.
    const std::vector<double> f = RandomDoubles(tokens * hidden);
    const std::vector<double> dx_next = RandomDoubles(x.size());
    const std::vector<double> dx_next_minor = ToMinor(dx_next, n, hidden);
    std::vector<double> x_next(x.size()), x_next2(x.size());
    reference::PostForward(major, tokens, f.data(), x.data(), h_post.data(),
                           h_res.data(), params.View(), x_next.data());
    reference::PostForward(minor, tokens, f.data(), x_minor.data(),
                           h_post.data(), h_res.data(), params_minor.View(),
                           x_next2.data());
    ExpectClose(ToMinor(x_next, n, hidden), x_next2, "x_next");
    std::vector<double> df(f.size()), dh_post(h_post.size()),
        dh_res(h_res.size());
    auto df2 = df, dh_post2 = dh_post, dh_res2 = dh_res;
    DoubleParams grads = params.ZerosLike(), grads2 = params.ZerosLike();
    reference::PostBackward(major, tokens, dx_next.data(), f.data(), x.data(),
                            h_post.data(), h_res.data(), params.View(),
                            df.data(), nullptr, dh_post.data(), dh_res.data(),
                            grads.GradView());
    reference::PostBackward(minor, tokens, dx_next_minor.data(), f.data(),
                            x_minor.data(), h_post.data(), h_res.data(),
                            params_minor.View(), df2.data(), nullptr,
                            dh_post2.data(), dh_res2.data(), grads2.GradView());
    ExpectClose(df, df2, "df");
    ExpectClose(dh_post, dh_post2, "dH_post");
    ExpectClose(dh_res, dh_res2, "dH_res");
    ExpectClose(grads.bias, grads2.bias, "dbias");

    // Pre backward with dx_next.
    const std::vector<double> dy = RandomDoubles(y.size());
    std::vector<double> dx(x.size()), dx2(x.size());
    reference::PreBackward(major, tokens, x.data(), params.View(), dy.data(),
                           dh_post.data(), dh_res.data(), dx_next.data(),
                           dx.data(), grads.GradView());
    reference::PreBackward(minor, tokens, x_minor.data(), params_minor.View(),
                           dy.data(), dh_post.data(), dh_res.data(),
                           dx_next_minor.data(), dx2.data(), grads2.GradView());
    ExpectClose(ToMinor(dx, n, hidden), dx2, "dx");
    ExpectClose(ToMinor(grads.phi, n, hidden), grads2.phi, "dphi");
    ExpectClose(ToMinor(grads.gamma, n, hidden), grads2.gamma, "dgamma");
    ExpectClose(grads.alpha, grads2.alpha, "dalpha");
    ExpectClose(grads.beta, grads2.beta, "dbeta");

    // Expand and head.
    std::vector<double> e_x(x.size()), e_x2(x.size());
    reference::ExpandForward(major, tokens, f.data(), e_x.data());
    reference::ExpandForward(minor, tokens, f.data(), e_x2.data());
    ExpectClose(ToMinor(e_x, n, hidden), e_x2, "expand");
    std::vector<double> de(f.size()), de2(f.size());
    reference::ExpandBackward(major, tokens, dx_next.data(), de.data());
    reference::ExpandBackward(minor, tokens, dx_next_minor.data(), de2.data());
    ExpectClose(de, de2, "de");

    LayerSpec head = major;
    head.kind = LayerKind::kHead;
    head.has_post_bias = false;
    LayerSpec head_minor = head;
    head_minor.layout = Layout::kStreamMinor;
    const DoubleParams hp = DoubleParams::Random(head);
    DoubleParams hp_minor = hp;
    hp_minor.phi = ToMinor(hp.phi, n, hidden);
    hp_minor.gamma = ToMinor(hp.gamma, n, hidden);
    std::vector<double> hy(y.size()), hy2(y.size());
    reference::HeadForward(head, tokens, x.data(), hp.View(), hy.data(),
                           nullptr);
    reference::HeadForward(head_minor, tokens, x_minor.data(), hp_minor.View(),
                           hy2.data(), nullptr);
    ExpectClose(hy, hy2, "head y");
    DoubleParams hg = hp.ZerosLike(), hg2 = hp.ZerosLike();
    std::vector<double> hdx(x.size()), hdx2(x.size());
    reference::HeadBackward(head, tokens, x.data(), hp.View(), dy.data(),
                            hdx.data(), hg.GradView());
    reference::HeadBackward(head_minor, tokens, x_minor.data(), hp_minor.View(),
                            dy.data(), hdx2.data(), hg2.GradView());
    ExpectClose(ToMinor(hdx, n, hidden), hdx2, "head dx");
    ExpectClose(ToMinor(hg.phi, n, hidden), hg2.phi, "head dphi");
    ExpectClose(hg.alpha, hg2.alpha, "head ds");
    ExpectClose(hg.beta, hg2.beta, "head db");
  }
}

// Every preset: the layer's gradient checks out, and a full layer (pre, post,
// post backward, pre backward with dx_next) runs through the Backend with
// finite results and doubly stochastic H_res.
TEST(ReferencePropertiesTest, EveryPresetRuns) {
  for (const std::string& name : PresetNames()) {
    SCOPED_TRACE(name);
    absl::StatusOr<LayerSpec> small = PresetSpec(name, 4, 3);
    ASSERT_TRUE(small.ok()) << small.status();
    LayerSpec spec = *small;
    spec.has_gamma = true;
    std::vector<double> x = RandomDoubles(2 * spec.K());
    const DoubleParams params = DoubleParams::Random(spec);
    const std::vector<double> wy = RandomDoubles(2 * spec.hidden);
    const std::vector<double> wr = RandomDoubles(2 * spec.n * spec.n);
    auto loss = [&] {
      std::vector<double> y(wy.size()), h_post(2 * spec.n), h_res(wr.size());
      reference::PreForward(spec, 2, x.data(), params.View(), y.data(), nullptr,
                            h_post.data(), h_res.data());
      return Dot(y, wy) + Dot(h_res, wr);
    };
    const std::vector<double> zeros(2 * spec.n, 0.0);
    DoubleParams grads = params.ZerosLike();
    std::vector<double> dx(x.size());
    reference::PreBackward(spec, 2, x.data(), params.View(), wy.data(),
                           zeros.data(), wr.data(), nullptr, dx.data(),
                           grads.GradView());
    ExpectGradientsMatch(dx, NumericGradient(x, loss), name + " dx");

    absl::StatusOr<LayerSpec> big = PresetSpec(name, 4, 64);
    ASSERT_TRUE(big.ok());
    LayerSpec layer = *big;
    layer.has_gamma = true;
    layer.has_post_bias = true;
    const int64_t tokens = 13;
    const int n = layer.n;
    const DType dtype = DType::kBF16;
    auto backend = MakeReferenceBackend();
    ActTensor ax = RandomAct(dtype, tokens * layer.K(), FreshSeed());
    ActTensor af = RandomAct(dtype, tokens * layer.hidden, FreshSeed());
    ActTensor ady = RandomAct(dtype, tokens * layer.hidden, FreshSeed());
    ActTensor adn = RandomAct(dtype, tokens * layer.K(), FreshSeed());
    std::vector<float> phi =
        RandomFloats(layer.NumLogits() * layer.K(), FreshSeed(), -0.02f, 0.02f);
    std::vector<float> alpha(3, 0.01f);
    std::vector<float> beta(layer.NumLogits(), 0.0f);
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) beta[2 * n + i * n + j] = i == j ? 0.f : -8.f;
    }
    std::vector<float> gamma(layer.K(), 1.0f);
    std::vector<float> bias = RandomFloats(layer.hidden, FreshSeed());
    LayerWeights w{phi.data(), alpha.data(), beta.data(), gamma.data(),
                   bias.data()};
    ActTensor y = MakeAct(dtype, tokens * layer.hidden);
    ActTensor x_next = MakeAct(dtype, tokens * layer.K());
    ActTensor df = MakeAct(dtype, tokens * layer.hidden);
    ActTensor dx_layer = MakeAct(dtype, tokens * layer.K());
    std::vector<float> h_post(tokens * n), h_res(tokens * n * n),
        dh_post(tokens * n), dh_res(tokens * n * n);
    std::vector<float> g_phi(phi.size()), g_alpha(3), g_beta(beta.size()),
        g_gamma(gamma.size()), g_bias(bias.size());
    LayerGrads g{g_phi.data(), g_alpha.data(), g_beta.data(), g_gamma.data(),
                 g_bias.data()};
    ASSERT_TRUE(backend
                    ->PreForward({&layer, tokens, dtype, ax.data(), w, y.data(),
                                  nullptr, h_post.data(), h_res.data()},
                                 {})
                    .ok());
    ASSERT_TRUE(
        backend
            ->PostForward({&layer, tokens, dtype, af.data(), ax.data(),
                           h_post.data(), h_res.data(), w, x_next.data()},
                          {})
            .ok());
    ASSERT_TRUE(backend
                    ->PostBackward(
                        {&layer, tokens, dtype, adn.data(), af.data(),
                         ax.data(), h_post.data(), h_res.data(), w, df.data(),
                         nullptr, dh_post.data(), dh_res.data(), g},
                        {})
                    .ok());
    ASSERT_TRUE(backend
                    ->PreBackward({&layer, tokens, dtype, ax.data(), w,
                                   ady.data(), dh_post.data(), dh_res.data(),
                                   adn.data(), dx_layer.data(), g},
                                  {})
                    .ok());
    for (ActTensor* t : {&y, &x_next, &df, &dx_layer}) {
      SyncValues(*t);
      for (float value : t->values) ASSERT_TRUE(std::isfinite(value));
    }
    for (const auto* v : {&h_post, &dh_post, &dh_res, &g_phi, &g_alpha, &g_beta,
                          &g_gamma, &g_bias}) {
      for (float value : *v) ASSERT_TRUE(std::isfinite(value));
    }
    for (int64_t m = 0; m < tokens; ++m) {
      for (int j = 0; j < n; ++j) {
        double sum = 0.0;
        for (int i = 0; i < n; ++i) sum += h_res[m * n * n + i * n + j];
        EXPECT_NEAR(sum, 1.0, 1e-5);
      }
    }
  }
}

TEST(ReferencePropertiesTest, ZeroTokensIsANoOp) {
  LayerSpec spec = SmallSpec(4, 5, Layout::kStreamMajor);
  spec.has_gamma = true;
  spec.has_post_bias = true;
  const DoubleParams params = DoubleParams::Random(spec);
  DoubleParams grads = params;  // sentinel values that must not change
  const reference::Grads g = grads.GradView();
  reference::ProjectionForward(spec, 0, nullptr, params.View(), nullptr,
                               nullptr);
  reference::ProjectionBackward(spec, 0, nullptr, params.View(), nullptr,
                                nullptr, nullptr, g);
  reference::ScaleForward(spec, 0, nullptr, nullptr, params.View(), nullptr,
                          nullptr, nullptr);
  reference::ScaleBackward(spec, 0, nullptr, nullptr, params.View(), nullptr,
                           nullptr, nullptr, nullptr, nullptr, g);
  reference::SinkhornForward(spec, 0, nullptr, nullptr);
  reference::SinkhornBackward(spec, 0, nullptr, nullptr, nullptr);
  reference::AggregateForward(spec, 0, nullptr, nullptr, nullptr);
  reference::AggregateBackward(spec, 0, nullptr, nullptr, nullptr, nullptr,
                               nullptr);
  reference::PostForward(spec, 0, nullptr, nullptr, nullptr, nullptr,
                         params.View(), nullptr);
  reference::PostBackward(spec, 0, nullptr, nullptr, nullptr, nullptr, nullptr,
                          params.View(), nullptr, nullptr, nullptr, nullptr, g);
  reference::ExpandForward(spec, 0, nullptr, nullptr);
  reference::ExpandBackward(spec, 0, nullptr, nullptr);
  reference::PreForward(spec, 0, nullptr, params.View(), nullptr, nullptr,
                        nullptr, nullptr);
  reference::PreBackward(spec, 0, nullptr, params.View(), nullptr, nullptr,
                         nullptr, nullptr, nullptr, g);
  LayerSpec head = spec;
  head.kind = LayerKind::kHead;
  head.has_post_bias = false;
  reference::HeadForward(head, 0, nullptr, params.View(), nullptr, nullptr);
  reference::HeadBackward(head, 0, nullptr, params.View(), nullptr, nullptr, g);
  EXPECT_EQ(grads.phi, params.phi);
  EXPECT_EQ(grads.alpha, params.alpha);
  EXPECT_EQ(grads.beta, params.beta);
  EXPECT_EQ(grads.gamma, params.gamma);
  EXPECT_EQ(grads.bias, params.bias);
}

// A NaN or Inf anywhere in a token's x makes that token's y non-finite (it
// reaches every logit through the projection and the RMS), and leaves the
// other tokens alone.
TEST(ReferencePropertiesTest, NonFiniteXPropagatesToY) {
  for (double bad : {static_cast<double>(NAN), static_cast<double>(INFINITY),
                     -static_cast<double>(INFINITY)}) {
    for (Layout layout : {Layout::kStreamMajor, Layout::kStreamMinor}) {
      for (bool dynamic : {true, false}) {
        LayerSpec spec = SmallSpec(4, 5, layout);
        spec.dynamic = dynamic;
        const int64_t tokens = 2;
        std::vector<double> x = RandomDoubles(tokens * spec.K());
        x[spec.XIndex(2, 3)] = bad;  // token 0
        const DoubleParams params = DoubleParams::Random(spec);
        std::vector<double> y(tokens * spec.hidden), h_post(tokens * spec.n),
            h_res(tokens * spec.n * spec.n);
        reference::PreForward(spec, tokens, x.data(), params.View(), y.data(),
                              nullptr, h_post.data(), h_res.data());
        if (dynamic) {
          for (int64_t c = 0; c < spec.hidden; ++c) {
            EXPECT_FALSE(std::isfinite(y[c])) << "c=" << c;
          }
        } else {
          // Static mixing: only the channel holding the bad value is hit.
          EXPECT_FALSE(std::isfinite(y[3]));
        }
        for (int64_t c = spec.hidden; c < 2 * spec.hidden; ++c) {
          EXPECT_TRUE(std::isfinite(y[c]));
        }

        // Same through the Backend in bf16.
        auto backend = MakeReferenceBackend();
        ActTensor ax = RandomAct(DType::kBF16, x.size(), FreshSeed());
        StoreActivation(ax.data(), DType::kBF16, spec.XIndex(2, 3),
                        static_cast<float>(bad));
        std::vector<float> phi(params.phi.begin(), params.phi.end());
        std::vector<float> alpha(params.alpha.begin(), params.alpha.end());
        std::vector<float> beta(params.beta.begin(), params.beta.end());
        ActTensor ay = MakeAct(DType::kBF16, y.size());
        std::vector<float> fh_post(h_post.size()), fh_res(h_res.size());
        LayerWeights w{dynamic ? phi.data() : nullptr,
                       dynamic ? alpha.data() : nullptr, beta.data(), nullptr,
                       nullptr};
        ASSERT_TRUE(backend
                        ->PreForward(
                            {&spec, tokens, DType::kBF16, ax.data(), w,
                             ay.data(), nullptr, fh_post.data(), fh_res.data()},
                            {})
                        .ok());
        SyncValues(ay);
        EXPECT_FALSE(std::isfinite(ay.values[3]));
        for (int64_t c = spec.hidden; c < 2 * spec.hidden; ++c) {
          EXPECT_TRUE(std::isfinite(ay.values[c]));
        }
      }
    }
  }
}

}  // namespace
}  // namespace mhc::testing
