// The reference Backend through its public, validated entry points, in every
// activation dtype and both layouts: each output is the float64 reference
// rounded once (double -> float -> dtype), parameter gradients are the float64
// sum over tokens added once to the fp32 accumulators, M = 0 is a no-op.
#include "mhc/backend.h"

#include <cmath>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu/reference/reference_math.h"
#include "gtest/gtest.h"
#include "mhc/dtype.h"
#include "reference_test_util.h"

namespace mhc::testing {
namespace {

constexpr int64_t kTokens = 3;

std::vector<double> Wide(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}
std::vector<double> Wide(const ActTensor& t) { return Wide(t.values); }

// `got` holds exactly `want` rounded once to the dtype.
void ExpectRoundedOnce(ActTensor& got, const std::vector<double>& want,
                       const std::string& what) {
  SyncValues(got);
  ASSERT_EQ(static_cast<size_t>(got.size()), want.size()) << what;
  ActTensor expected = MakeAct(got.dtype, got.size());
  for (int64_t e = 0; e < got.size(); ++e) {
    StoreActivation(expected.data(), got.dtype, e, static_cast<float>(want[e]));
    const float value = LoadActivation(expected.data(), got.dtype, e);
    ASSERT_EQ(UlpDistance(got.dtype, got.values[e], value), 0)
        << what << " [" << e << "] got " << got.values[e] << " want "
        << want[e];
  }
}

void ExpectFloatsRoundedOnce(const std::vector<float>& got,
                             const std::vector<double>& want,
                             const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t e = 0; e < got.size(); ++e) {
    ASSERT_EQ(UlpDistance(DType::kF32, got[e], static_cast<float>(want[e])), 0)
        << what << " [" << e << "] got " << got[e] << " want " << want[e];
  }
}

// fp32 parameters (or gradient accumulators) of one layer.
struct FloatParams {
  std::vector<float> phi, alpha, beta, gamma, bias;

  static FloatParams Random(const LayerSpec& spec) {
    FloatParams p;
    const int64_t rows = spec.NumLogits();
    if (spec.dynamic) {
      p.phi = RandomFloats(rows * spec.K(), FreshSeed(), -0.5f, 0.5f);
      p.alpha = RandomFloats(spec.NumAlpha(), FreshSeed(), 0.5f, 1.5f);
    }
    p.beta = RandomFloats(rows, FreshSeed());
    if (spec.has_gamma)
      p.gamma = RandomFloats(spec.K(), FreshSeed(), 0.5f, 1.5f);
    if (spec.has_post_bias) p.bias = RandomFloats(spec.hidden, FreshSeed());
    return p;
  }
  LayerWeights View() const {
    auto ptr = [](const std::vector<float>& v) {
      return v.empty() ? nullptr : v.data();
    };
    return {ptr(phi), ptr(alpha), ptr(beta), ptr(gamma), ptr(bias)};
  }
  LayerGrads GradView() {
    auto ptr = [](std::vector<float>& v) {
      return v.empty() ? nullptr : v.data();
    };
    return {ptr(phi), ptr(alpha), ptr(beta), ptr(gamma), ptr(bias)};
  }
  DoubleParams Wide() const {
    return {testing::Wide(phi), testing::Wide(alpha), testing::Wide(beta),
            testing::Wide(gamma), testing::Wide(bias)};
  }
};

// accumulators == before + (float)(double sum), slot by slot.
void ExpectGradsAdded(const FloatParams& before, const FloatParams& after,
                      const DoubleParams& sums, const std::string& what) {
  auto check = [&](const std::vector<float>& b, const std::vector<float>& a,
                   const std::vector<double>& s, const char* slot) {
    ASSERT_EQ(a.size(), s.size()) << what << " " << slot;
    for (size_t e = 0; e < a.size(); ++e) {
      const float want = b[e] + static_cast<float>(s[e]);
      ASSERT_EQ(UlpDistance(DType::kF32, a[e], want), 0)
          << what << " " << slot << " [" << e << "]";
    }
  };
  check(before.phi, after.phi, sums.phi, "phi");
  check(before.alpha, after.alpha, sums.alpha, "alpha");
  check(before.beta, after.beta, sums.beta, "beta");
  check(before.gamma, after.gamma, sums.gamma, "gamma");
  check(before.bias, after.bias, sums.bias, "bias");
}

template <typename P, typename = void>
struct HasActDType : std::false_type {};
template <typename P>
struct HasActDType<P, std::void_t<decltype(std::declval<P>().act_dtype)>>
    : std::true_type {};

class ReferenceBackendTest
    : public ::testing::TestWithParam<std::tuple<DType, Layout>> {
 protected:
  void SetUp() override { backend_ = MakeReferenceBackend(); }

  DType dtype() const { return std::get<0>(GetParam()); }
  // n = 4, odd C; the minor layout also switches every other knob.
  LayerSpec Spec() const {
    LayerSpec spec = SmallSpec(4, 5, std::get<1>(GetParam()));
    spec.has_gamma = true;
    spec.has_post_bias = true;
    if (spec.layout == Layout::kStreamMinor) {
      spec.sinkhorn_mode = SinkhornMode::kLog;
      spec.eps_placement = EpsPlacement::kOutside;
      spec.orientation = Orientation::kDestRows;
      spec.sinkhorn_iterations = 7;
    }
    return spec;
  }
  ActTensor Act(int64_t count) const {
    return RandomAct(dtype(), count, FreshSeed());
  }

  std::unique_ptr<Backend> backend_;
};

TEST_P(ReferenceBackendTest, Identity) {
  EXPECT_EQ(backend_->Name(), "reference");
  EXPECT_TRUE(backend_->HostAccessible());
  absl::StatusOr<void*> pointer = backend_->Allocate(100);
  ASSERT_TRUE(pointer.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*pointer) % 64, 0u);
  std::vector<uint8_t> src(100, 7), dst(100, 0);
  ASSERT_TRUE(backend_->CopyToDevice(*pointer, src.data(), 100).ok());
  ASSERT_TRUE(backend_->CopyToHost(dst.data(), *pointer, 100).ok());
  EXPECT_EQ(src, dst);
  ASSERT_TRUE(backend_->Memset(*pointer, 0, 100).ok());
  ASSERT_TRUE(backend_->Synchronize().ok());
  backend_->Free(*pointer);
}

TEST_P(ReferenceBackendTest, ProjectionAndScale) {
  for (LayerKind kind : {LayerKind::kMhc, LayerKind::kHead}) {
    LayerSpec spec = Spec();
    spec.kind = kind;
    if (kind == LayerKind::kHead) spec.has_post_bias = false;
    const int n = spec.n;
    const bool mhc = kind == LayerKind::kMhc;
    const int64_t rows = spec.NumLogits();
    ActTensor x = Act(kTokens * spec.K());
    const FloatParams params = FloatParams::Random(spec);
    const DoubleParams wide = params.Wide();
    std::vector<float> h(kTokens * rows), ms(kTokens);
    ASSERT_TRUE(backend_
                    ->ProjectionForward({&spec, kTokens, dtype(), x.data(),
                                         params.View(), h.data(), ms.data()},
                                        {})
                    .ok());
    std::vector<double> want_h(h.size()), want_ms(ms.size());
    reference::ProjectionForward(spec, kTokens, Wide(x).data(), wide.View(),
                                 want_h.data(), want_ms.data());
    ExpectFloatsRoundedOnce(h, want_h, "h");
    ExpectFloatsRoundedOnce(ms, want_ms, "mean_square");

    const std::vector<float> dh = RandomFloats(h.size(), FreshSeed());
    const std::vector<float> dms = RandomFloats(ms.size(), FreshSeed());
    ActTensor dx = MakeAct(dtype(), x.size());
    const FloatParams before = FloatParams::Random(spec);
    FloatParams after = before;
    ASSERT_TRUE(backend_
                    ->ProjectionBackward(
                        {&spec, kTokens, dtype(), x.data(), params.View(),
                         dh.data(), dms.data(), dx.data(), after.GradView()},
                        {})
                    .ok());
    DoubleParams sums = wide.ZerosLike();
    std::vector<double> want_dx(x.size());
    reference::ProjectionBackward(spec, kTokens, Wide(x).data(), wide.View(),
                                  Wide(dh).data(), Wide(dms).data(),
                                  want_dx.data(), sums.GradView());
    ExpectRoundedOnce(dx, want_dx, "projection dx");
    sums.alpha = Wide(std::vector<float>(before.alpha.size(), 0.0f));
    sums.beta = Wide(std::vector<float>(before.beta.size(), 0.0f));
    sums.bias = Wide(std::vector<float>(before.bias.size(), 0.0f));
    ExpectGradsAdded(before, after, sums, "projection");

    // Scale, from the fp32 h and mean_square above.
    std::vector<float> h_pre(kTokens * n), h_post(mhc ? kTokens * n : 0),
        logits(mhc ? kTokens * n * n : 0);
    ASSERT_TRUE(
        backend_
            ->ScaleForward({&spec, kTokens, h.data(), ms.data(), params.View(),
                            h_pre.data(), mhc ? h_post.data() : nullptr,
                            mhc ? logits.data() : nullptr},
                           {})
            .ok());
    std::vector<double> want_pre(h_pre.size()), want_post(h_post.size()),
        want_logits(logits.size());
    reference::ScaleForward(spec, kTokens, Wide(h).data(), Wide(ms).data(),
                            wide.View(), want_pre.data(), want_post.data(),
                            want_logits.data());
    ExpectFloatsRoundedOnce(h_pre, want_pre, "H_pre");
    ExpectFloatsRoundedOnce(h_post, want_post, "H_post");
    ExpectFloatsRoundedOnce(logits, want_logits, "logits");

    const std::vector<float> dh_pre = RandomFloats(h_pre.size(), FreshSeed());
    const std::vector<float> dh_post = RandomFloats(h_post.size(), FreshSeed());
    const std::vector<float> dlogits = RandomFloats(logits.size(), FreshSeed());
    std::vector<float> out_dh(h.size()), out_dms(ms.size());
    FloatParams after_scale = before;
    ASSERT_TRUE(
        backend_
            ->ScaleBackward({&spec, kTokens, h.data(), ms.data(), params.View(),
                             dh_pre.data(), mhc ? dh_post.data() : nullptr,
                             mhc ? dlogits.data() : nullptr, out_dh.data(),
                             out_dms.data(), after_scale.GradView()},
                            {})
            .ok());
    DoubleParams scale_sums = wide.ZerosLike();
    std::vector<double> want_dh(h.size()), want_dms(ms.size());
    reference::ScaleBackward(
        spec, kTokens, Wide(h).data(), Wide(ms).data(), wide.View(),
        Wide(dh_pre).data(), Wide(dh_post).data(), Wide(dlogits).data(),
        want_dh.data(), want_dms.data(), scale_sums.GradView());
    ExpectFloatsRoundedOnce(out_dh, want_dh, "dh");
    ExpectFloatsRoundedOnce(out_dms, want_dms, "dmean_square");
    ExpectGradsAdded(before, after_scale, scale_sums, "scale");
  }
}

TEST_P(ReferenceBackendTest, StaticScale) {
  LayerSpec spec = Spec();
  spec.dynamic = false;
  spec.has_gamma = false;
  const int n = spec.n;
  const FloatParams params = FloatParams::Random(spec);
  std::vector<float> h_pre(kTokens * n), h_post(kTokens * n),
      logits(kTokens * n * n);
  ASSERT_TRUE(
      backend_
          ->ScaleForward({&spec, kTokens, nullptr, nullptr, params.View(),
                          h_pre.data(), h_post.data(), logits.data()},
                         {})
          .ok());
  for (int64_t m = 0; m < kTokens; ++m) {
    for (int64_t g = 0; g < n * n; ++g) {
      EXPECT_EQ(logits[m * n * n + g], params.beta[2 * n + g]);
    }
  }
  const std::vector<float> dh_pre = RandomFloats(h_pre.size(), FreshSeed());
  const std::vector<float> dh_post = RandomFloats(h_post.size(), FreshSeed());
  const std::vector<float> dlogits = RandomFloats(logits.size(), FreshSeed());
  const FloatParams before = FloatParams::Random(spec);
  FloatParams after = before;
  ASSERT_TRUE(
      backend_
          ->ScaleBackward({&spec, kTokens, nullptr, nullptr, params.View(),
                           dh_pre.data(), dh_post.data(), dlogits.data(),
                           nullptr, nullptr, after.GradView()},
                          {})
          .ok());
  const DoubleParams wide = params.Wide();
  DoubleParams sums = wide.ZerosLike();
  reference::ScaleBackward(spec, kTokens, nullptr, nullptr, wide.View(),
                           Wide(dh_pre).data(), Wide(dh_post).data(),
                           Wide(dlogits).data(), nullptr, nullptr,
                           sums.GradView());
  ExpectGradsAdded(before, after, sums, "static scale");
}

TEST_P(ReferenceBackendTest, Sinkhorn) {
  const LayerSpec spec = Spec();
  const int64_t count = kTokens * spec.n * spec.n;
  const std::vector<float> logits = RandomFloats(count, FreshSeed(), -3, 3);
  std::vector<float> h_res(count), dlogits(count);
  ASSERT_TRUE(
      backend_
          ->SinkhornForward({&spec, kTokens, logits.data(), h_res.data()}, {})
          .ok());
  std::vector<double> want(count), want_d(count);
  reference::SinkhornForward(spec, kTokens, Wide(logits).data(), want.data());
  ExpectFloatsRoundedOnce(h_res, want, "H_res");
  const std::vector<float> dh_res = RandomFloats(count, FreshSeed());
  ASSERT_TRUE(backend_
                  ->SinkhornBackward({&spec, kTokens, logits.data(),
                                      dh_res.data(), dlogits.data()},
                                     {})
                  .ok());
  reference::SinkhornBackward(spec, kTokens, Wide(logits).data(),
                              Wide(dh_res).data(), want_d.data());
  ExpectFloatsRoundedOnce(dlogits, want_d, "dlogits");
}

TEST_P(ReferenceBackendTest, AggregateAndExpand) {
  const LayerSpec spec = Spec();
  const int n = spec.n;
  ActTensor x = Act(kTokens * spec.K());
  const std::vector<float> h_pre = RandomFloats(kTokens * n, FreshSeed(), 0, 1);
  ActTensor y = MakeAct(dtype(), kTokens * spec.hidden);
  ASSERT_TRUE(
      backend_
          ->AggregateForward(
              {&spec, kTokens, dtype(), x.data(), h_pre.data(), y.data()}, {})
          .ok());
  std::vector<double> want_y(y.size());
  reference::AggregateForward(spec, kTokens, Wide(x).data(), Wide(h_pre).data(),
                              want_y.data());
  ExpectRoundedOnce(y, want_y, "y");

  ActTensor dy = Act(kTokens * spec.hidden);
  ActTensor dx = MakeAct(dtype(), x.size());
  std::vector<float> dh_pre(h_pre.size());
  ASSERT_TRUE(
      backend_
          ->AggregateBackward({&spec, kTokens, dtype(), x.data(), h_pre.data(),
                               dy.data(), dx.data(), dh_pre.data()},
                              {})
          .ok());
  std::vector<double> want_dx(x.size()), want_dh(h_pre.size());
  reference::AggregateBackward(spec, kTokens, Wide(x).data(),
                               Wide(h_pre).data(), Wide(dy).data(),
                               want_dx.data(), want_dh.data());
  ExpectRoundedOnce(dx, want_dx, "aggregate dx");
  ExpectFloatsRoundedOnce(dh_pre, want_dh, "dH_pre");

  ActTensor expanded = MakeAct(dtype(), x.size());
  ASSERT_TRUE(backend_
                  ->ExpandForward(
                      {&spec, kTokens, dtype(), dy.data(), expanded.data()}, {})
                  .ok());
  std::vector<double> want_x(x.size());
  reference::ExpandForward(spec, kTokens, Wide(dy).data(), want_x.data());
  ExpectRoundedOnce(expanded, want_x, "expand x");
  ActTensor de = MakeAct(dtype(), dy.size());
  ASSERT_TRUE(
      backend_
          ->ExpandBackward({&spec, kTokens, dtype(), x.data(), de.data()}, {})
          .ok());
  std::vector<double> want_de(dy.size());
  reference::ExpandBackward(spec, kTokens, Wide(x).data(), want_de.data());
  ExpectRoundedOnce(de, want_de, "de");
}

TEST_P(ReferenceBackendTest, Post) {
  const LayerSpec spec = Spec();
  const int n = spec.n;
  ActTensor f = Act(kTokens * spec.hidden);
  ActTensor x = Act(kTokens * spec.K());
  const std::vector<float> h_post =
      RandomFloats(kTokens * n, FreshSeed(), 0, 2);
  const std::vector<float> h_res =
      RandomFloats(kTokens * n * n, FreshSeed(), 0, 1);
  const FloatParams params = FloatParams::Random(spec);
  const DoubleParams wide = params.Wide();
  ActTensor x_next = MakeAct(dtype(), x.size());
  ASSERT_TRUE(backend_
                  ->PostForward({&spec, kTokens, dtype(), f.data(), x.data(),
                                 h_post.data(), h_res.data(), params.View(),
                                 x_next.data()},
                                {})
                  .ok());
  std::vector<double> want(x.size());
  reference::PostForward(spec, kTokens, Wide(f).data(), Wide(x).data(),
                         Wide(h_post).data(), Wide(h_res).data(), wide.View(),
                         want.data());
  ExpectRoundedOnce(x_next, want, "x_next");

  ActTensor dx_next = Act(x.size());
  for (bool with_dx : {true, false}) {
    ActTensor df = MakeAct(dtype(), f.size());
    ActTensor dx = MakeAct(dtype(), x.size());
    std::vector<float> dh_post(h_post.size()), dh_res(h_res.size());
    const FloatParams before = FloatParams::Random(spec);
    FloatParams after = before;
    ASSERT_TRUE(backend_
                    ->PostBackward(
                        {&spec, kTokens, dtype(), dx_next.data(), f.data(),
                         x.data(), h_post.data(), h_res.data(), params.View(),
                         df.data(), with_dx ? dx.data() : nullptr,
                         dh_post.data(), dh_res.data(), after.GradView()},
                        {})
                    .ok());
    DoubleParams sums = wide.ZerosLike();
    std::vector<double> want_df(f.size()), want_dx(x.size()),
        want_dh_post(h_post.size()), want_dh_res(h_res.size());
    reference::PostBackward(spec, kTokens, Wide(dx_next).data(), Wide(f).data(),
                            Wide(x).data(), Wide(h_post).data(),
                            Wide(h_res).data(), wide.View(), want_df.data(),
                            want_dx.data(), want_dh_post.data(),
                            want_dh_res.data(), sums.GradView());
    ExpectRoundedOnce(df, want_df, "df");
    if (with_dx) ExpectRoundedOnce(dx, want_dx, "post dx");
    ExpectFloatsRoundedOnce(dh_post, want_dh_post, "dH_post");
    ExpectFloatsRoundedOnce(dh_res, want_dh_res, "dH_res");
    ExpectGradsAdded(before, after, sums, "post");
  }
}

TEST_P(ReferenceBackendTest, Pre) {
  for (bool dynamic : {true, false}) {
    for (bool with_dx_next : {false, true}) {
      LayerSpec spec = Spec();
      spec.dynamic = dynamic;
      if (!dynamic) spec.has_gamma = false;
      const std::string name = std::string(dynamic ? "dynamic" : "static") +
                               (with_dx_next ? " dx_next" : "");
      const int n = spec.n;
      ActTensor x = Act(kTokens * spec.K());
      const FloatParams params = FloatParams::Random(spec);
      const DoubleParams wide = params.Wide();
      ActTensor y = MakeAct(dtype(), kTokens * spec.hidden);
      std::vector<float> h_pre(kTokens * n), h_post(kTokens * n),
          h_res(kTokens * n * n);
      ASSERT_TRUE(backend_
                      ->PreForward(
                          {&spec, kTokens, dtype(), x.data(), params.View(),
                           y.data(), h_pre.data(), h_post.data(), h_res.data()},
                          {})
                      .ok());
      std::vector<double> want_y(y.size()), want_pre(h_pre.size()),
          want_post(h_post.size()), want_res(h_res.size());
      reference::PreForward(spec, kTokens, Wide(x).data(), wide.View(),
                            want_y.data(), want_pre.data(), want_post.data(),
                            want_res.data());
      ExpectRoundedOnce(y, want_y, name + " y");
      ExpectFloatsRoundedOnce(h_pre, want_pre, name + " H_pre");
      ExpectFloatsRoundedOnce(h_post, want_post, name + " H_post");
      ExpectFloatsRoundedOnce(h_res, want_res, name + " H_res");

      ActTensor dy = Act(y.size());
      ActTensor dx_next = Act(x.size());
      const std::vector<float> dh_post =
          RandomFloats(h_post.size(), FreshSeed());
      const std::vector<float> dh_res = RandomFloats(h_res.size(), FreshSeed());
      ActTensor dx = MakeAct(dtype(), x.size());
      const FloatParams before = FloatParams::Random(spec);
      FloatParams after = before;
      ASSERT_TRUE(
          backend_
              ->PreBackward({&spec, kTokens, dtype(), x.data(), params.View(),
                             dy.data(), dh_post.data(), dh_res.data(),
                             with_dx_next ? dx_next.data() : nullptr, dx.data(),
                             after.GradView()},
                            {})
              .ok());
      DoubleParams sums = wide.ZerosLike();
      std::vector<double> want_dx(x.size());
      reference::PreBackward(spec, kTokens, Wide(x).data(), wide.View(),
                             Wide(dy).data(), Wide(dh_post).data(),
                             Wide(dh_res).data(),
                             with_dx_next ? Wide(dx_next).data() : nullptr,
                             want_dx.data(), sums.GradView());
      ExpectRoundedOnce(dx, want_dx, name + " dx");
      sums.bias = Wide(std::vector<float>(before.bias.size(), 0.0f));
      ExpectGradsAdded(before, after, sums, name);
    }
  }
}

TEST_P(ReferenceBackendTest, Head) {
  LayerSpec spec = Spec();
  spec.kind = LayerKind::kHead;
  spec.has_post_bias = false;
  ActTensor x = Act(kTokens * spec.K());
  const FloatParams params = FloatParams::Random(spec);
  const DoubleParams wide = params.Wide();
  ActTensor y = MakeAct(dtype(), kTokens * spec.hidden);
  std::vector<float> mix(kTokens * spec.n);
  ASSERT_TRUE(backend_
                  ->HeadForward({&spec, kTokens, dtype(), x.data(),
                                 params.View(), y.data(), mix.data()},
                                {})
                  .ok());
  std::vector<double> want_y(y.size()), want_mix(mix.size());
  reference::HeadForward(spec, kTokens, Wide(x).data(), wide.View(),
                         want_y.data(), want_mix.data());
  ExpectRoundedOnce(y, want_y, "head y");
  ExpectFloatsRoundedOnce(mix, want_mix, "mix");

  ActTensor dy = Act(y.size());
  ActTensor dx = MakeAct(dtype(), x.size());
  const FloatParams before = FloatParams::Random(spec);
  FloatParams after = before;
  ASSERT_TRUE(
      backend_
          ->HeadBackward({&spec, kTokens, dtype(), x.data(), params.View(),
                          dy.data(), dx.data(), after.GradView()},
                         {})
          .ok());
  DoubleParams sums = wide.ZerosLike();
  std::vector<double> want_dx(x.size());
  reference::HeadBackward(spec, kTokens, Wide(x).data(), wide.View(),
                          Wide(dy).data(), want_dx.data(), sums.GradView());
  ExpectRoundedOnce(dx, want_dx, "head dx");
  ExpectGradsAdded(before, after, sums, "head");
}

// Null gradient slots are skipped, the others still accumulate.
TEST_P(ReferenceBackendTest, NullGradSlotsAreSkipped) {
  const LayerSpec spec = Spec();
  ActTensor x = Act(kTokens * spec.K());
  const FloatParams params = FloatParams::Random(spec);
  ActTensor dy = Act(kTokens * spec.hidden);
  const std::vector<float> dh_post =
      RandomFloats(kTokens * spec.n, FreshSeed());
  const std::vector<float> dh_res =
      RandomFloats(kTokens * spec.n * spec.n, FreshSeed());
  ActTensor dx = MakeAct(dtype(), x.size());
  std::vector<float> beta_grad(spec.NumLogits(), 0.0f);
  LayerGrads grads;
  grads.beta = beta_grad.data();
  ASSERT_TRUE(backend_
                  ->PreBackward({&spec, kTokens, dtype(), x.data(),
                                 params.View(), dy.data(), dh_post.data(),
                                 dh_res.data(), nullptr, dx.data(), grads},
                                {})
                  .ok());
  bool any_nonzero = false;
  for (float value : beta_grad) any_nonzero |= value != 0.0f;
  EXPECT_TRUE(any_nonzero);
}

// M = 0 through the validated entry points: OK with null tensors, and the
// gradient accumulators are left alone.
TEST_P(ReferenceBackendTest, ZeroTokensIsANoOp) {
  const LayerSpec spec = Spec();
  const DType dt = dtype();
  FloatParams params = FloatParams::Random(spec);
  const FloatParams before = params;
  const LayerWeights w = params.View();
  const LayerGrads g = params.GradView();
  LayerSpec head = spec;
  head.kind = LayerKind::kHead;
  head.has_post_bias = false;
  Backend& b = *backend_;
  // Empty params of each op: spec set, tokens 0, every tensor null.
  auto empty = [&](auto params, const LayerSpec& layer) {
    params.spec = &layer;
    params.tokens = 0;
    if constexpr (HasActDType<decltype(params)>::value) params.act_dtype = dt;
    return params;
  };
  auto with_grads = [&](auto params, const LayerSpec& layer) {
    params = empty(params, layer);
    params.weights = w;
    params.grads = g;
    return params;
  };
  EXPECT_TRUE(
      b.ProjectionForward(empty(ProjectionForwardParams(), spec), {}).ok());
  EXPECT_TRUE(
      b.ProjectionBackward(with_grads(ProjectionBackwardParams(), spec), {})
          .ok());
  EXPECT_TRUE(b.ScaleForward(empty(ScaleForwardParams(), spec), {}).ok());
  EXPECT_TRUE(
      b.ScaleBackward(with_grads(ScaleBackwardParams(), spec), {}).ok());
  EXPECT_TRUE(b.SinkhornForward(empty(SinkhornForwardParams(), spec), {}).ok());
  EXPECT_TRUE(
      b.SinkhornBackward(empty(SinkhornBackwardParams(), spec), {}).ok());
  EXPECT_TRUE(
      b.AggregateForward(empty(AggregateForwardParams(), spec), {}).ok());
  EXPECT_TRUE(
      b.AggregateBackward(empty(AggregateBackwardParams(), spec), {}).ok());
  EXPECT_TRUE(b.PostForward(empty(PostForwardParams(), spec), {}).ok());
  EXPECT_TRUE(b.PostBackward(with_grads(PostBackwardParams(), spec), {}).ok());
  EXPECT_TRUE(b.ExpandForward(empty(ExpandForwardParams(), spec), {}).ok());
  EXPECT_TRUE(b.ExpandBackward(empty(ExpandBackwardParams(), spec), {}).ok());
  EXPECT_TRUE(b.PreForward(empty(PreForwardParams(), spec), {}).ok());
  EXPECT_TRUE(b.PreBackward(with_grads(PreBackwardParams(), spec), {}).ok());
  EXPECT_TRUE(b.HeadForward(empty(HeadForwardParams(), head), {}).ok());
  EXPECT_TRUE(b.HeadBackward(with_grads(HeadBackwardParams(), head), {}).ok());
  EXPECT_EQ(params.phi, before.phi);
  EXPECT_EQ(params.alpha, before.alpha);
  EXPECT_EQ(params.beta, before.beta);
  EXPECT_EQ(params.gamma, before.gamma);
  EXPECT_EQ(params.bias, before.bias);
}

INSTANTIATE_TEST_SUITE_P(
    DTypes, ReferenceBackendTest,
    ::testing::Combine(
        ::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
        ::testing::Values(Layout::kStreamMajor, Layout::kStreamMinor)),
    [](const ::testing::TestParamInfo<ReferenceBackendTest::ParamType>& info) {
      return std::string(DTypeName(std::get<0>(info.param))) + "_" +
             std::string(LayoutName(std::get<1>(info.param)));
    });

}  // namespace
}  // namespace mhc::testing
