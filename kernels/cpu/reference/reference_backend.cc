// The reference Backend: host memory, every op computed by the float64 math
// of reference_math.h. Activations are read exactly into double, parameters
// and mixing values widened from fp32, and every output is rounded once
// (double -> float -> activation dtype). Parameter gradients are summed over
// the request's tokens in double and added to the fp32 accumulators once.
// Single threaded, trivially deterministic and batch invariant; speed is
// irrelevant, so temporaries are allocated per call and no workspace is used.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cpu/reference/reference_math.h"
#include "mhc/backend.h"
#include "mhc/dtype.h"

namespace mhc {
namespace {

constexpr size_t kAlignment = 64;

std::vector<double> ActToDouble(const void* data, DType dtype, int64_t count) {
  std::vector<double> out(count);
  for (int64_t e = 0; e < count; ++e) out[e] = LoadActivation(data, dtype, e);
  return out;
}

// Null in, empty out: optional inputs stay optional.
std::vector<double> FloatToDouble(const float* data, int64_t count) {
  if (data == nullptr) return {};
  return std::vector<double>(data, data + count);
}

const double* OrNull(const std::vector<double>& v) {
  return v.empty() ? nullptr : v.data();
}
double* OrNull(std::vector<double>& v) {
  return v.empty() ? nullptr : v.data();
}

void StoreAct(const std::vector<double>& values, DType dtype, void* out) {
  for (size_t e = 0; e < values.size(); ++e) {
    StoreActivation(out, dtype, static_cast<int64_t>(e),
                    static_cast<float>(values[e]));
  }
}

void StoreFloat(const std::vector<double>& values, float* out) {
  if (out == nullptr) return;
  for (size_t e = 0; e < values.size(); ++e) {
    out[e] = static_cast<float>(values[e]);
  }
}

// A layer's fp32 parameters widened to double; absent slots stay null.
class DoubleWeights {
 public:
  DoubleWeights(const LayerSpec& spec, const LayerWeights& w) {
    const int64_t rows = spec.NumLogits();
    if (spec.dynamic) {
      phi_ = FloatToDouble(w.phi, rows * spec.K());
      alpha_ = FloatToDouble(w.alpha, spec.NumAlpha());
    }
    beta_ = FloatToDouble(w.beta, rows);
    if (spec.has_gamma) gamma_ = FloatToDouble(w.gamma, spec.K());
    if (spec.has_post_bias) bias_ = FloatToDouble(w.bias, spec.hidden);
    view_ = {OrNull(phi_), OrNull(alpha_), OrNull(beta_), OrNull(gamma_),
             OrNull(bias_)};
  }
  DoubleWeights(const DoubleWeights&) = delete;
  DoubleWeights& operator=(const DoubleWeights&) = delete;
  const reference::Weights& view() const { return view_; }

 private:
  std::vector<double> phi_, alpha_, beta_, gamma_, bias_;
  reference::Weights view_;
};

// Double sums for every requested gradient slot, added to the fp32
// accumulators once by Flush.
class DoubleGrads {
 public:
  DoubleGrads(const LayerSpec& spec, const LayerGrads& g) : target_(g) {
    const int64_t rows = spec.NumLogits();
    Init(g.phi, spec.dynamic ? rows * spec.K() : 0, phi_, view_.phi);
    Init(g.alpha, spec.dynamic ? spec.NumAlpha() : 0, alpha_, view_.alpha);
    Init(g.beta, rows, beta_, view_.beta);
    Init(g.gamma, spec.has_gamma ? spec.K() : 0, gamma_, view_.gamma);
    Init(g.bias, spec.has_post_bias ? spec.hidden : 0, bias_, view_.bias);
  }
  DoubleGrads(const DoubleGrads&) = delete;
  DoubleGrads& operator=(const DoubleGrads&) = delete;
  const reference::Grads& view() const { return view_; }

  void Flush() const {
    Add(phi_, target_.phi);
    Add(alpha_, target_.alpha);
    Add(beta_, target_.beta);
    Add(gamma_, target_.gamma);
    Add(bias_, target_.bias);
  }

 private:
  static void Init(float* target, int64_t count, std::vector<double>& sums,
                   double*& view) {
    if (target == nullptr || count == 0) return;
    sums.assign(count, 0.0);
    view = sums.data();
  }
  static void Add(const std::vector<double>& sums, float* target) {
    for (size_t e = 0; e < sums.size(); ++e) {
      target[e] += static_cast<float>(sums[e]);
    }
  }

  LayerGrads target_;
  std::vector<double> phi_, alpha_, beta_, gamma_, bias_;
  reference::Grads view_;
};

class ReferenceBackend final : public Backend {
 public:
  std::string Name() const override { return "reference"; }
  std::string DeviceDescription() const override {
    return "cpu (float64 reference, 1 thread)";
  }
  bool HostAccessible() const override { return true; }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    // aligned_alloc wants a multiple of the alignment, and a zero-byte
    // request still gets a unique pointer.
    const size_t rounded =
        (bytes == 0 ? kAlignment
                    : (bytes + kAlignment - 1) / kAlignment * kAlignment);
    if (rounded < bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("reference allocate: ", bytes, " bytes is too large"));
    }
    void* pointer = std::aligned_alloc(kAlignment, rounded);
    if (pointer == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "reference allocate: out of host memory for ", bytes, " bytes"));
    }
    return pointer;
  }
  void Free(void* pointer) override { std::free(pointer); }
  absl::Status CopyToDevice(void* dst, const void* host_src,
                            size_t bytes) override {
    if (bytes != 0) std::memcpy(dst, host_src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* host_dst, const void* src,
                          size_t bytes) override {
    if (bytes != 0) std::memcpy(host_dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Memset(void* dst, int value, size_t bytes) override {
    if (bytes != 0) std::memset(dst, value, bytes);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }
  size_t WorkspaceBytes(OpKind, const LayerSpec&, int64_t,
                        DType) const override {
    return 0;
  }

 protected:
  absl::Status RunProjectionForward(const ProjectionForwardParams& p,
                                    Workspace) override {
    const LayerSpec& spec = *p.spec;
    const int64_t m = p.tokens;
    const auto x = ActToDouble(p.x, p.act_dtype, m * spec.K());
    const DoubleWeights w(spec, p.weights);
    std::vector<double> h(m * spec.NumLogits()), ms(m);
    reference::ProjectionForward(spec, m, x.data(), w.view(), h.data(),
                                 ms.data());
    StoreFloat(h, p.h);
    StoreFloat(ms, p.mean_square);
    return absl::OkStatus();
  }

  absl::Status RunProjectionBackward(const ProjectionBackwardParams& p,
                                     Workspace) override {
    const LayerSpec& spec = *p.spec;
    const int64_t m = p.tokens;
    const auto x = ActToDouble(p.x, p.act_dtype, m * spec.K());
    const DoubleWeights w(spec, p.weights);
    const auto dh = FloatToDouble(p.dh, m * spec.NumLogits());
    const auto dms = FloatToDouble(p.dmean_square, m);
    const DoubleGrads grads(spec, p.grads);
    std::vector<double> dx(m * spec.K());
    reference::ProjectionBackward(spec, m, x.data(), w.view(), dh.data(),
                                  dms.data(), dx.data(), grads.view());
    StoreAct(dx, p.act_dtype, p.dx);
    grads.Flush();
    return absl::OkStatus();
  }

  absl::Status RunScaleForward(const ScaleForwardParams& p,
                               Workspace) override {
    const LayerSpec& spec = *p.spec;
    const int64_t m = p.tokens;
    const int64_t n = spec.n;
    const bool mhc = spec.kind == LayerKind::kMhc;
    const auto h = spec.dynamic ? FloatToDouble(p.h, m * spec.NumLogits())
                                : std::vector<double>();
    const auto ms =
        spec.dynamic ? FloatToDouble(p.mean_square, m) : std::vector<double>();
    const DoubleWeights w(spec, p.weights);
    std::vector<double> h_pre(m * n), h_post(mhc ? m * n : 0),
        logits(mhc ? m * n * n : 0);
    reference::ScaleForward(spec, m, OrNull(h), OrNull(ms), w.view(),
                            h_pre.data(), OrNull(h_post), OrNull(logits));
    StoreFloat(h_pre, p.h_pre);
    if (mhc) {
      StoreFloat(h_post, p.h_post);
      StoreFloat(logits, p.logits);
    }
    return absl::OkStatus();
  }

  absl::Status RunScaleBackward(const ScaleBackwardParams& p,
                                Workspace) override {
    const LayerSpec& spec = *p.spec;
    const int64_t m = p.tokens;
    const int64_t n = spec.n;
    const bool mhc = spec.kind == LayerKind::kMhc;
    const int64_t rows = spec.NumLogits();
    const auto h =
        spec.dynamic ? FloatToDouble(p.h, m * rows) : std::vector<double>();
    const auto ms =
        spec.dynamic ? FloatToDouble(p.mean_square, m) : std::vector<double>();
    const DoubleWeights w(spec, p.weights);
    const auto dh_pre = FloatToDouble(p.dh_pre, m * n);
    const auto dh_post =
        mhc ? FloatToDouble(p.dh_post, m * n) : std::vector<double>();
    const auto dlogits =
        mhc ? FloatToDouble(p.dlogits, m * n * n) : std::vector<double>();
    const DoubleGrads grads(spec, p.grads);
    std::vector<double> dh(spec.dynamic ? m * rows : 0),
        dms(spec.dynamic ? m : 0);
    reference::ScaleBackward(spec, m, OrNull(h), OrNull(ms), w.view(),
                             dh_pre.data(), OrNull(dh_post), OrNull(dlogits),
                             OrNull(dh), OrNull(dms), grads.view());
    if (spec.dynamic) {
      StoreFloat(dh, p.dh);
      StoreFloat(dms, p.dmean_square);
    }
    grads.Flush();
    return absl::OkStatus();
  }

  absl::Status RunSinkhornForward(const SinkhornForwardParams& p,
                                  Workspace) override {
    const int64_t count = p.tokens * p.spec->n * p.spec->n;
    const auto logits = FloatToDouble(p.logits, count);
    std::vector<double> h_res(count);
    reference::SinkhornForward(*p.spec, p.tokens, logits.data(), h_res.data());
    StoreFloat(h_res, p.h_res);
    return absl::OkStatus();
  }

  absl::Status RunSinkhornBackward(const SinkhornBackwardParams& p,
                                   Workspace) override {
    const int64_t count = p.tokens * p.spec->n * p.spec->n;
    const auto logits = FloatToDouble(p.logits, count);
    const auto dh_res = FloatToDouble(p.dh_res, count);
    std::vector<double> dlogits(count);
    reference::SinkhornBackward(*p.spec, p.tokens, logits.data(), dh_res.data(),
                                dlogits.data());
    StoreFloat(dlogits, p.dlogits);
    return absl::OkStatus();
  }

  absl::Status RunAggregateForward(const AggregateForwardParams& p,
                                   Workspace) override {
    const LayerSpec& spec = *p.spec;
    const int64_t m = p.tokens;
    const auto x = ActToDouble(p.x, p.act_dtype, m * spec.K());
    const auto h_pre = FloatToDouble(p.h_pre, m * spec.n);
    std::vector<double> y(m * spec.hidden);
    reference::AggregateForward(spec, m, x.data(), h_pre.data(), y.data());
    StoreAct(y, p.act_dtype, p.y);
    return absl::OkStatus();
  }

  absl::Status RunAggregateBackward(const AggregateBackwardParams& p,
                                    Workspace) override {
    const LayerSpec& spec = *p.spec;
    const int64_t m = p.tokens;
    const auto x = ActToDouble(p.x, p.act_dtype, m * spec.K());
    const auto h_pre = FloatToDouble(p.h_pre, m * spec.n);
    const auto dy = ActToDouble(p.dy, p.act_dtype, m * spec.hidden);
    std::vector<double> dx(m * spec.K()), dh_pre(m * spec.n);
    reference::AggregateBackward(spec, m, x.data(), h_pre.data(), dy.data(),
                                 dx.data(), dh_pre.data());
    StoreAct(dx, p.act_dtype, p.dx);
    StoreFloat(dh_pre, p.dh_pre);
    return absl::OkStatus();
  }

  absl::Status RunPostForward(const PostForwardParams& p, Workspace) override {
    const LayerSpec& spec = *p.spec;
    const int64_t m = p.tokens;
    const int64_t n = spec.n;
    const auto f = ActToDouble(p.f, p.act_dtype, m * spec.hidden);
    const auto x = ActToDouble(p.x, p.act_dtype, m * spec.K());
    const auto h_post = FloatToDouble(p.h_post, m * n);
    const auto h_res = FloatToDouble(p.h_res, m * n * n);
    const DoubleWeights w(spec, p.weights);
    std::vector<double> x_next(m * spec.K());
    reference::PostForward(spec, m, f.data(), x.data(), h_post.data(),
                           h_res.data(), w.view(), x_next.data());
    StoreAct(x_next, p.act_dtype, p.x_next);
    return absl::OkStatus();
  }

  absl::Status RunPostBackward(const PostBackwardParams& p,
                               Workspace) override {
    const LayerSpec& spec = *p.spec;
    const int64_t m = p.tokens;
    const int64_t n = spec.n;
    const auto dx_next = ActToDouble(p.dx_next, p.act_dtype, m * spec.K());
    const auto f = ActToDouble(p.f, p.act_dtype, m * spec.hidden);
    const auto x = ActToDouble(p.x, p.act_dtype, m * spec.K());
    const auto h_post = FloatToDouble(p.h_post, m * n);
    const auto h_res = FloatToDouble(p.h_res, m * n * n);
    const DoubleWeights w(spec, p.weights);
    const DoubleGrads grads(spec, p.grads);
    std::vector<double> df(m * spec.hidden), dx(p.dx ? m * spec.K() : 0),
        dh_post(m * n), dh_res(m * n * n);
    reference::PostBackward(spec, m, dx_next.data(), f.data(), x.data(),
                            h_post.data(), h_res.data(), w.view(), df.data(),
                            OrNull(dx), dh_post.data(), dh_res.data(),
                            grads.view());
    StoreAct(df, p.act_dtype, p.df);
    if (p.dx != nullptr) StoreAct(dx, p.act_dtype, p.dx);
    StoreFloat(dh_post, p.dh_post);
    StoreFloat(dh_res, p.dh_res);
    grads.Flush();
    return absl::OkStatus();
  }

  absl::Status RunExpandForward(const ExpandForwardParams& p,
                                Workspace) override {
    const LayerSpec& spec = *p.spec;
    const auto e = ActToDouble(p.e, p.act_dtype, p.tokens * spec.hidden);
    std::vector<double> x(p.tokens * spec.K());
    reference::ExpandForward(spec, p.tokens, e.data(), x.data());
    StoreAct(x, p.act_dtype, p.x);
    return absl::OkStatus();
  }

  absl::Status RunExpandBackward(const ExpandBackwardParams& p,
                                 Workspace) override {
    const LayerSpec& spec = *p.spec;
    const auto dx = ActToDouble(p.dx, p.act_dtype, p.tokens * spec.K());
    std::vector<double> de(p.tokens * spec.hidden);
    reference::ExpandBackward(spec, p.tokens, dx.data(), de.data());
    StoreAct(de, p.act_dtype, p.de);
    return absl::OkStatus();
  }

  absl::Status RunPreForward(const PreForwardParams& p, Workspace) override {
    const LayerSpec& spec = *p.spec;
    const int64_t m = p.tokens;
    const int64_t n = spec.n;
    const auto x = ActToDouble(p.x, p.act_dtype, m * spec.K());
    const DoubleWeights w(spec, p.weights);
    std::vector<double> y(m * spec.hidden), h_pre(m * n), h_post(m * n),
        h_res(m * n * n);
    const bool keep = p.h != nullptr;
    std::vector<double> h(keep ? m * spec.NumLogits() : 0),
        mean_square(keep ? m : 0);
    reference::PreForward(spec, m, x.data(), w.view(), y.data(), h_pre.data(),
                          h_post.data(), h_res.data(), OrNull(h),
                          OrNull(mean_square));
    StoreAct(y, p.act_dtype, p.y);
    StoreFloat(h_pre, p.h_pre);
    StoreFloat(h_post, p.h_post);
    StoreFloat(h_res, p.h_res);
    StoreFloat(h, p.h);
    StoreFloat(mean_square, p.mean_square);
    return absl::OkStatus();
  }

  absl::Status RunPreBackward(const PreBackwardParams& p, Workspace) override {
    const LayerSpec& spec = *p.spec;
    const int64_t m = p.tokens;
    const int64_t n = spec.n;
    const auto x = ActToDouble(p.x, p.act_dtype, m * spec.K());
    const DoubleWeights w(spec, p.weights);
    const auto dy = ActToDouble(p.dy, p.act_dtype, m * spec.hidden);
    const auto dh_post = FloatToDouble(p.dh_post, m * n);
    const auto dh_res = FloatToDouble(p.dh_res, m * n * n);
    const auto dx_next =
        p.dx_next == nullptr
            ? std::vector<double>()
            : ActToDouble(p.dx_next, p.act_dtype, m * spec.K());
    const DoubleGrads grads(spec, p.grads);
    const auto kept_h = FloatToDouble(p.h, m * spec.NumLogits());
    const auto kept_mean_square = FloatToDouble(p.mean_square, m);
    std::vector<double> dx(m * spec.K());
    reference::PreBackward(spec, m, x.data(), w.view(), dy.data(),
                           dh_post.data(), dh_res.data(), OrNull(dx_next),
                           dx.data(), grads.view(), OrNull(kept_h),
                           OrNull(kept_mean_square));
    StoreAct(dx, p.act_dtype, p.dx);
    grads.Flush();
    return absl::OkStatus();
  }

  absl::Status RunHeadForward(const HeadForwardParams& p, Workspace) override {
    const LayerSpec& spec = *p.spec;
    const int64_t m = p.tokens;
    const auto x = ActToDouble(p.x, p.act_dtype, m * spec.K());
    const DoubleWeights w(spec, p.weights);
    std::vector<double> y(m * spec.hidden), mix(m * spec.n);
    reference::HeadForward(spec, m, x.data(), w.view(), y.data(), mix.data());
    StoreAct(y, p.act_dtype, p.y);
    StoreFloat(mix, p.mix);
    return absl::OkStatus();
  }

  absl::Status RunHeadBackward(const HeadBackwardParams& p,
                               Workspace) override {
    const LayerSpec& spec = *p.spec;
    const int64_t m = p.tokens;
    const auto x = ActToDouble(p.x, p.act_dtype, m * spec.K());
    const DoubleWeights w(spec, p.weights);
    const auto dy = ActToDouble(p.dy, p.act_dtype, m * spec.hidden);
    const DoubleGrads grads(spec, p.grads);
    std::vector<double> dx(m * spec.K());
    reference::HeadBackward(spec, m, x.data(), w.view(), dy.data(), dx.data(),
                            grads.view());
    StoreAct(dx, p.act_dtype, p.dx);
    grads.Flush();
    return absl::OkStatus();
  }

  // The norm over every block in (block, element) order, then each block's
  // update in double; values and state are rounded to fp32 once per step.
  absl::Status RunOptimizerStep(const OptimizerStepParams& p,
                                Workspace) override {
    const int slot_count = OptimizerSlotCount(p.hyper.algorithm);
    double clip_scale = 1.0;
    if (NeedsGradNorm(p)) {
      double sum = 0.0;
      for (int64_t i = 0; i < p.num_tensors; ++i) {
        const OptimizerTensor& t = p.tensors[i];
        const auto grads = FloatToDouble(t.grads, t.count);
        sum += reference::SquaredNorm(grads.data(), t.count);
      }
      const double norm = std::sqrt(sum);
      if (p.grad_norm != nullptr) *p.grad_norm = norm;
      clip_scale = reference::ClipScale(norm, p.hyper.max_grad_norm);
    }
    for (int64_t i = 0; i < p.num_tensors; ++i) {
      const OptimizerTensor& t = p.tensors[i];
      if (t.count == 0) continue;
      const auto grads = FloatToDouble(t.grads, t.count);
      auto values = FloatToDouble(t.values, t.count);
      auto slots = FloatToDouble(t.slots, slot_count * t.count);
      reference::OptimizerUpdate(p.hyper, t.step, clip_scale, t.count,
                                 grads.data(), values.data(), slots.data());
      StoreFloat(values, t.values);
      StoreFloat(slots, t.slots);
      if (p.zero_grads) {
        std::memset(t.grads, 0, static_cast<size_t>(t.count) * sizeof(float));
      }
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<Backend> MakeReferenceBackend() {
  return std::make_unique<ReferenceBackend>();
}

}  // namespace mhc
