// Runs any Backend op on random host data so the fast CPU backend can be
// compared with the fp64 reference (and with itself) through the public
// Backend interface only.
#ifndef MHC_TESTS_CPU_OP_HARNESS_H_
#define MHC_TESTS_CPU_OP_HARNESS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "gtest/gtest.h"
#include "mhc/backend.h"

namespace mhc::testing {

inline constexpr OpKind kAllOps[] = {
    OpKind::kProjectionForward, OpKind::kProjectionBackward,
    OpKind::kScaleForward,      OpKind::kScaleBackward,
    OpKind::kSinkhornForward,   OpKind::kSinkhornBackward,
    OpKind::kAggregateForward,  OpKind::kAggregateBackward,
    OpKind::kPostForward,       OpKind::kPostBackward,
    OpKind::kExpandForward,     OpKind::kExpandBackward,
    OpKind::kPreForward,        OpKind::kPreBackward,
    OpKind::kHeadForward,       OpKind::kHeadBackward};

inline bool IsHeadOp(OpKind op) {
  return op == OpKind::kHeadForward || op == OpKind::kHeadBackward;
}
inline bool IsFusedOp(OpKind op) {
  return op == OpKind::kPreForward || op == OpKind::kPreBackward ||
         IsHeadOp(op);
}
// Ops that need phi (a dynamic layer).
inline bool NeedsDynamic(OpKind op) {
  return op == OpKind::kProjectionForward ||
         op == OpKind::kProjectionBackward || IsHeadOp(op);
}
// Ops that need an MHC (not HEAD) layer.
inline bool NeedsMhc(OpKind op) {
  return op == OpKind::kSinkhornForward || op == OpKind::kSinkhornBackward ||
         op == OpKind::kPostForward || op == OpKind::kPostBackward ||
         op == OpKind::kPreForward || op == OpKind::kPreBackward;
}

// The spec an op runs with, derived from a preset-like base.
inline LayerSpec SpecFor(OpKind op, LayerSpec spec) {
  if (IsHeadOp(op)) {
    spec.kind = LayerKind::kHead;
    spec.has_post_bias = false;
    spec.dynamic = true;
  }
  if (NeedsMhc(op)) spec.kind = LayerKind::kMhc;
  if (NeedsDynamic(op)) spec.dynamic = true;
  if (!spec.dynamic) spec.has_gamma = false;
  return spec;
}

// Every input any op may read, drawn fresh: never zeros.
struct Inputs {
  LayerSpec spec;
  int64_t tokens = 0;
  DType dtype = DType::kF32;
  ActTensor x, f, dy, dx_next, e;
  std::vector<float> phi, alpha, beta, gamma, bias;
  std::vector<float> h, ms, h_pre, h_post, h_res, logits;
  std::vector<float> dh, dms, dh_pre, dh_post, dh_res, dlogits;
  std::vector<float> grad_init;  // starting value of every accumulator
  bool use_dx_next = true;       // PreBackward folds the residual path in
  // Dynamic layers: PreForward also returns its projection, PreBackward
  // takes h / ms as the kept projection instead of recomputing it.
  bool keep_projection = false;
};

inline Inputs MakeInputs(const LayerSpec& spec, int64_t tokens, DType dtype) {
  Inputs in;
  in.spec = spec;
  in.tokens = tokens;
  in.dtype = dtype;
  const int64_t n = spec.n, c = spec.hidden, k = spec.K();
  const int64_t big_n = spec.NumLogits(), m = tokens;
  in.x = RandomAct(dtype, m * k, FreshSeed());
  in.f = RandomAct(dtype, m * c, FreshSeed());
  in.dy = RandomAct(dtype, m * c, FreshSeed());
  in.dx_next = RandomAct(dtype, m * k, FreshSeed());
  in.e = RandomAct(dtype, m * c, FreshSeed());
  // Scaled so the logits are O(1) and Sinkhorn is well conditioned.
  const float phi_scale = 3.0f / std::sqrt(static_cast<float>(k));
  in.phi = RandomFloats(big_n * k, FreshSeed(), -phi_scale, phi_scale);
  in.alpha = RandomFloats(3, FreshSeed(), 0.5f, 1.5f);
  in.beta = RandomFloats(big_n, FreshSeed(), -1.0f, 1.0f);
  in.gamma = RandomFloats(k, FreshSeed(), 0.5f, 1.5f);
  in.bias = RandomFloats(c, FreshSeed(), -1.0f, 1.0f);
  in.h = RandomFloats(m * big_n, FreshSeed(), -1.0f, 1.0f);
  in.ms = RandomFloats(m, FreshSeed(), 0.1f, 2.0f);
  in.h_pre = RandomFloats(m * n, FreshSeed(), 0.1f, 1.0f);
  in.h_post = RandomFloats(m * n, FreshSeed(), 0.0f, 2.0f);
  in.h_res = RandomFloats(m * n * n, FreshSeed(), 0.0f, 1.0f);
  in.logits = RandomFloats(m * n * n, FreshSeed(), -2.0f, 2.0f);
  in.dh = RandomFloats(m * big_n, FreshSeed());
  in.dms = RandomFloats(m, FreshSeed());
  in.dh_pre = RandomFloats(m * n, FreshSeed());
  in.dh_post = RandomFloats(m * n, FreshSeed());
  in.dh_res = RandomFloats(m * n * n, FreshSeed());
  in.dlogits = RandomFloats(m * n * n, FreshSeed());
  in.grad_init = RandomFloats(std::max(big_n * k, std::max(k, c)) + 16,
                              FreshSeed(), -0.1f, 0.1f);
  return in;
}

// One output of an op: activation outputs are compared in ulps (16-bit
// dtypes); the rest are fp32 values.
struct Output {
  std::string name;
  bool activation = false;
  std::vector<float> values;
  std::vector<uint8_t> bits;  // raw bytes, for bitwise comparisons
};

namespace internal {

inline Output FromAct(std::string name, ActTensor& t) {
  SyncValues(t);
  return {std::move(name), true, t.values, t.bytes};
}

inline Output FromFloats(std::string name, const std::vector<float>& v) {
  Output out{std::move(name), false, v, {}};
  out.bits.resize(v.size() * sizeof(float));
  if (!v.empty()) std::memcpy(out.bits.data(), v.data(), out.bits.size());
  return out;
}

}  // namespace internal

// The layer weights of `in`, as its spec uses them.
inline LayerWeights WeightsOf(const Inputs& in) {
  LayerWeights w;
  w.phi = in.phi.data();
  w.alpha = in.alpha.data();
  w.beta = in.beta.data();
  if (in.spec.has_gamma) w.gamma = in.gamma.data();
  if (in.spec.has_post_bias) w.bias = in.bias.data();
  return w;
}

// Runs `op` of `backend` on `in` and returns every output, including the
// parameter gradient accumulators after the op added to them.
inline std::vector<Output> RunOp(Backend& backend, OpKind op,
                                 const Inputs& in) {
  using internal::FromAct;
  using internal::FromFloats;
  const LayerSpec& spec = in.spec;
  const int64_t m = in.tokens, n = spec.n, c = spec.hidden, k = spec.K();
  const int64_t big_n = spec.NumLogits();
  const DType dt = in.dtype;
  std::vector<uint8_t> ws_bytes(
      std::max<size_t>(backend.WorkspaceBytes(op, spec, m, dt), 1) + 64);
  Workspace ws{ws_bytes.data(), ws_bytes.size()};
  const LayerWeights w = WeightsOf(in);
  auto grad = [&](int64_t size) {
    return std::vector<float>(in.grad_init.begin(),
                              in.grad_init.begin() + size);
  };
  std::vector<float> g_phi = grad(big_n * k), g_alpha = grad(3),
                     g_beta = grad(big_n), g_gamma = grad(k), g_bias = grad(c);
  LayerGrads grads;
  grads.phi = spec.dynamic ? g_phi.data() : nullptr;
  grads.alpha = spec.dynamic ? g_alpha.data() : nullptr;
  grads.beta = g_beta.data();
  grads.gamma = spec.has_gamma ? g_gamma.data() : nullptr;
  grads.bias = spec.has_post_bias ? g_bias.data() : nullptr;
  auto grad_outputs = [&](std::vector<Output>& out, bool phi, bool scale,
                          bool bias) {
    if (phi && grads.phi) out.push_back(FromFloats("dphi", g_phi));
    if (phi && grads.gamma) out.push_back(FromFloats("dgamma", g_gamma));
    if (scale && grads.alpha) {
      g_alpha.resize(spec.NumAlpha());
      out.push_back(FromFloats("dalpha", g_alpha));
    }
    if (scale) out.push_back(FromFloats("dbeta", g_beta));
    if (bias && grads.bias) out.push_back(FromFloats("dbias", g_bias));
  };
  std::vector<Output> out;
  absl::Status status;
  switch (op) {
    case OpKind::kProjectionForward: {
      std::vector<float> h(m * big_n), ms(m);
      status = backend.ProjectionForward(
          {&spec, m, dt, in.x.data(), w, h.data(), ms.data()}, ws);
      out = {FromFloats("h", h), FromFloats("mean_square", ms)};
      break;
    }
    case OpKind::kProjectionBackward: {
      ActTensor dx = MakeAct(dt, m * k);
      ProjectionBackwardParams p{&spec,         m,         dt,
                                 in.x.data(),   w,         in.dh.data(),
                                 in.dms.data(), dx.data(), grads};
      status = backend.ProjectionBackward(p, ws);
      out = {FromAct("dx", dx)};
      grad_outputs(out, true, false, false);
      break;
    }
    case OpKind::kScaleForward: {
      std::vector<float> h_pre(m * n), h_post(m * n), logits(m * n * n);
      const bool mhc = spec.kind == LayerKind::kMhc;
      status = backend.ScaleForward(
          {&spec, m, in.h.data(), in.ms.data(), w, h_pre.data(),
           mhc ? h_post.data() : nullptr, mhc ? logits.data() : nullptr},
          ws);
      out = {FromFloats("h_pre", h_pre)};
      if (mhc) {
        out.push_back(FromFloats("h_post", h_post));
        out.push_back(FromFloats("logits", logits));
      }
      break;
    }
    case OpKind::kScaleBackward: {
      std::vector<float> dh(m * big_n), dms(m);
      const bool mhc = spec.kind == LayerKind::kMhc;
      status = backend.ScaleBackward(
          {&spec, m, in.h.data(), in.ms.data(), w, in.dh_pre.data(),
           mhc ? in.dh_post.data() : nullptr, mhc ? in.dlogits.data() : nullptr,
           dh.data(), dms.data(), grads},
          ws);
      if (spec.dynamic) out = {FromFloats("dh", dh), FromFloats("dms", dms)};
      grad_outputs(out, false, true, false);
      break;
    }
    case OpKind::kSinkhornForward: {
      std::vector<float> h_res(m * n * n);
      status = backend.SinkhornForward(
          {&spec, m, in.logits.data(), h_res.data()}, ws);
      out = {FromFloats("h_res", h_res)};
      break;
    }
    case OpKind::kSinkhornBackward: {
      std::vector<float> dlogits(m * n * n);
      status = backend.SinkhornBackward(
          {&spec, m, in.logits.data(), in.dh_res.data(), dlogits.data()}, ws);
      out = {FromFloats("dlogits", dlogits)};
      break;
    }
    case OpKind::kAggregateForward: {
      ActTensor y = MakeAct(dt, m * c);
      status = backend.AggregateForward(
          {&spec, m, dt, in.x.data(), in.h_pre.data(), y.data()}, ws);
      out = {FromAct("y", y)};
      break;
    }
    case OpKind::kAggregateBackward: {
      ActTensor dx = MakeAct(dt, m * k);
      std::vector<float> dh_pre(m * n);
      status =
          backend.AggregateBackward({&spec, m, dt, in.x.data(), in.h_pre.data(),
                                     in.dy.data(), dx.data(), dh_pre.data()},
                                    ws);
      out = {FromAct("dx", dx), FromFloats("dh_pre", dh_pre)};
      break;
    }
    case OpKind::kPostForward: {
      ActTensor x_next = MakeAct(dt, m * k);
      status = backend.PostForward(
          {&spec, m, dt, in.f.data(), in.x.data(), in.h_post.data(),
           in.h_res.data(), w, x_next.data()},
          ws);
      out = {FromAct("x_next", x_next)};
      break;
    }
    case OpKind::kPostBackward: {
      ActTensor df = MakeAct(dt, m * c), dx = MakeAct(dt, m * k);
      std::vector<float> dh_post(m * n), dh_res(m * n * n);
      status = backend.PostBackward(
          {&spec, m, dt, in.dx_next.data(), in.f.data(), in.x.data(),
           in.h_post.data(), in.h_res.data(), w, df.data(), dx.data(),
           dh_post.data(), dh_res.data(), grads},
          ws);
      out = {FromAct("df", df), FromAct("dx", dx),
             FromFloats("dh_post", dh_post), FromFloats("dh_res", dh_res)};
      grad_outputs(out, false, false, true);
      break;
    }
    case OpKind::kExpandForward: {
      ActTensor x = MakeAct(dt, m * k);
      status = backend.ExpandForward({&spec, m, dt, in.e.data(), x.data()}, ws);
      out = {FromAct("x", x)};
      break;
    }
    case OpKind::kExpandBackward: {
      ActTensor de = MakeAct(dt, m * c);
      status = backend.ExpandBackward(
          {&spec, m, dt, in.dx_next.data(), de.data()}, ws);
      out = {FromAct("de", de)};
      break;
    }
    case OpKind::kPreForward: {
      ActTensor y = MakeAct(dt, m * c);
      std::vector<float> h_pre(m * n), h_post(m * n), h_res(m * n * n);
      const bool keep = in.keep_projection && spec.dynamic;
      std::vector<float> h(keep ? m * big_n : 0), ms(keep ? m : 0);
      status = backend.PreForward(
          {&spec, m, dt, in.x.data(), w, y.data(), h_pre.data(), h_post.data(),
           h_res.data(), keep ? h.data() : nullptr, keep ? ms.data() : nullptr},
          ws);
      out = {FromAct("y", y), FromFloats("h_pre", h_pre),
             FromFloats("h_post", h_post), FromFloats("h_res", h_res)};
      if (keep) {
        out.push_back(FromFloats("h", h));
        out.push_back(FromFloats("mean_square", ms));
      }
      break;
    }
    case OpKind::kPreBackward: {
      ActTensor dx = MakeAct(dt, m * k);
      PreBackwardParams p;
      p.spec = &spec;
      p.tokens = m;
      p.act_dtype = dt;
      p.x = in.x.data();
      p.weights = w;
      p.dy = in.dy.data();
      p.dh_post = in.dh_post.data();
      p.dh_res = in.dh_res.data();
      p.dx_next = in.use_dx_next ? in.dx_next.data() : nullptr;
      p.dx = dx.data();
      p.grads = grads;
      if (in.keep_projection && spec.dynamic) {
        p.h = in.h.data();
        p.mean_square = in.ms.data();
      }
      status = backend.PreBackward(p, ws);
      out = {FromAct("dx", dx)};
      grad_outputs(out, true, true, false);
      break;
    }
    case OpKind::kHeadForward: {
      ActTensor y = MakeAct(dt, m * c);
      std::vector<float> mix(m * n);
      status = backend.HeadForward(
          {&spec, m, dt, in.x.data(), w, y.data(), mix.data()}, ws);
      out = {FromAct("y", y), FromFloats("mix", mix)};
      break;
    }
    case OpKind::kHeadBackward: {
      ActTensor dx = MakeAct(dt, m * k);
      status = backend.HeadBackward(
          {&spec, m, dt, in.x.data(), w, in.dy.data(), dx.data(), grads}, ws);
      out = {FromAct("dx", dx)};
      grad_outputs(out, true, true, false);
      break;
    }
  }
  EXPECT_TRUE(status.ok()) << backend.Name() << " " << OpFamilyName(op) << " "
                           << OpDirectionName(op) << ": " << status;
  return out;
}

// Normwise relative error max_i |a_i - b_i| / max_i |b_i| (b = reference):
// one large-magnitude scale per tensor, so elements that cancel to nearly
// zero are judged against the tensor's scale, as fp32-vs-fp64 accumulation
// error is. NaN anywhere in exactly one of the two gives infinity.
inline double NormwiseError(const std::vector<float>& a,
                            const std::vector<float>& b) {
  double max_ref = 0.0, max_err = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) != std::isnan(b[i])) return INFINITY;
    if (std::isnan(a[i])) continue;
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(b[i])));
    max_err = std::max(max_err, std::fabs(static_cast<double>(a[i]) - b[i]));
  }
  return max_ref == 0.0 ? max_err : max_err / max_ref;
}

// Elements further than 1 ulp of `dtype` from the reference, not counting
// elements whose absolute error is below `floor` (near-total cancellation,
// where fp32 accumulation cannot decide the 16-bit rounding).
inline int64_t UlpViolations(DType dtype, const std::vector<float>& a,
                             const std::vector<float>& b, double floor) {
  int64_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (UlpDistance(dtype, a[i], b[i]) <= 1) continue;
    if (std::fabs(static_cast<double>(a[i]) - b[i]) <= floor) continue;
    ++bad;
  }
  return bad;
}

inline double MaxAbs(const std::vector<float>& v) {
  double m = 0.0;
  for (float x : v) m = std::max(m, std::fabs(static_cast<double>(x)));
  return m;
}

// Token `m` of `in` alone (M = 1), every per-token tensor sliced.
inline Inputs TokenSlice(const Inputs& in, int64_t m) {
  Inputs one = in;
  one.tokens = 1;
  auto act = [m](const ActTensor& t, int64_t per_token) {
    ActTensor out = MakeAct(t.dtype, per_token);
    const size_t bytes = per_token * DTypeSize(t.dtype);
    std::memcpy(out.data(), t.bytes.data() + m * bytes, bytes);
    SyncValues(out);
    return out;
  };
  auto floats = [m](const std::vector<float>& v, int64_t per_token) {
    return std::vector<float>(v.begin() + m * per_token,
                              v.begin() + (m + 1) * per_token);
  };
  const int64_t n = in.spec.n, c = in.spec.hidden, k = in.spec.K();
  const int64_t big_n = in.spec.NumLogits();
  one.x = act(in.x, k);
  one.f = act(in.f, c);
  one.dy = act(in.dy, c);
  one.dx_next = act(in.dx_next, k);
  one.e = act(in.e, c);
  one.h = floats(in.h, big_n);
  one.ms = floats(in.ms, 1);
  one.h_pre = floats(in.h_pre, n);
  one.h_post = floats(in.h_post, n);
  one.h_res = floats(in.h_res, n * n);
  one.logits = floats(in.logits, n * n);
  one.dh = floats(in.dh, big_n);
  one.dms = floats(in.dms, 1);
  one.dh_pre = floats(in.dh_pre, n);
  one.dh_post = floats(in.dh_post, n);
  one.dh_res = floats(in.dh_res, n * n);
  one.dlogits = floats(in.dlogits, n * n);
  return one;
}

inline bool IsParameterGradient(const std::string& name) {
  return name == "dphi" || name == "dgamma" || name == "dalpha" ||
         name == "dbeta" || name == "dbias";
}

// For each parameter-gradient output of `op`: the accumulator's starting
// magnitude plus the sum over tokens of |that token's contribution|, from
// the reference run token by token. A sum over tokens can cancel far below
// its terms; fp32 error is proportional to the terms, so this is the scale
// a parameter gradient's error is measured against.
//
// The scale ops' per-token sums of terms of both signs (the H_res logits
// beta + alpha h r, dms = sum over the logits of dz alpha h dr/dms) cancel
// the same way within one token: a token of n = 1 left 1e-4 to 6e-3 of a
// logit's value, 1e-7 of its terms (one run in a few hundred at M = 1).
// Their scale is the reference's result on the inputs' magnitudes, which
// adds the terms' magnitudes (within the gates' slopes for dms).
inline bool SumsOfSignedTerms(const std::string& name) {
  return name == "logits" || name == "dms";
}
inline std::vector<std::vector<double>> ErrorScales(
    Backend& reference, OpKind op, const Inputs& in,
    const std::vector<Output>& outputs) {
  std::vector<std::vector<double>> scales(outputs.size());
  bool signed_sums = false;
  for (size_t o = 0; o < outputs.size(); ++o) {
    signed_sums = signed_sums || SumsOfSignedTerms(outputs[o].name);
    if (!IsParameterGradient(outputs[o].name)) continue;
    scales[o].resize(outputs[o].values.size());
    for (size_t i = 0; i < scales[o].size(); ++i) {
      scales[o][i] = std::fabs(in.grad_init[i]);
    }
  }
  for (int64_t m = 0; m < in.tokens; ++m) {
    const std::vector<Output> one = RunOp(reference, op, TokenSlice(in, m));
    for (size_t o = 0; o < outputs.size(); ++o) {
      for (size_t i = 0; i < scales[o].size(); ++i) {
        scales[o][i] +=
            std::fabs(static_cast<double>(one[o].values[i]) - in.grad_init[i]);
      }
    }
  }
  if (!signed_sums) return scales;
  Inputs magnitudes = in;
  for (std::vector<float>* v :
       {&magnitudes.h, &magnitudes.alpha, &magnitudes.beta, &magnitudes.dh_pre,
        &magnitudes.dh_post, &magnitudes.dlogits}) {
    for (float& e : *v) e = std::fabs(e);
  }
  const std::vector<Output> terms = RunOp(reference, op, magnitudes);
  for (size_t o = 0; o < outputs.size(); ++o) {
    if (!SumsOfSignedTerms(outputs[o].name)) continue;
    scales[o].resize(outputs[o].values.size());
    for (size_t i = 0; i < scales[o].size(); ++i) {
      scales[o][i] = std::fabs(static_cast<double>(terms[o].values[i]));
    }
  }
  return scales;
}

// max_i |a_i - b_i| / max_i scale_i.
inline double ScaledError(const std::vector<float>& a,
                          const std::vector<float>& b,
                          const std::vector<double>& scale) {
  double max_scale = 0.0, max_err = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) != std::isnan(b[i])) return INFINITY;
    if (std::isnan(a[i])) continue;
    max_scale = std::max(max_scale, scale[i]);
    max_err = std::max(max_err, std::fabs(static_cast<double>(a[i]) - b[i]));
  }
  return max_scale == 0.0 ? max_err : max_err / max_scale;
}

// docs/SPEC.md section 7 tolerances (see cpu_vs_reference_test.cc). `scales`,
// when given (ErrorScales), measures parameter gradients and the scale ops'
// signed sums against their terms' magnitudes instead of against their
// (possibly cancelled) values.
inline void ExpectMatchesReference(
    OpKind op, DType dtype, const std::vector<Output>& got,
    const std::vector<Output>& ref,
    const std::vector<std::vector<double>>* scales = nullptr) {
  ASSERT_EQ(got.size(), ref.size());
  for (size_t o = 0; o < got.size(); ++o) {
    SCOPED_TRACE(got[o].name);
    ASSERT_EQ(got[o].values.size(), ref[o].values.size());
    const bool act16 = got[o].activation && dtype != DType::kF32;
    if (act16 && !IsFusedOp(op)) {
      const double floor = 1e-6 * MaxAbs(ref[o].values);
      EXPECT_EQ(UlpViolations(dtype, got[o].values, ref[o].values, floor), 0);
    } else {
      // dalpha is one scalar per gate group summed over M * |group| terms of
      // both signs, each a product with h (an fp32 dot product of length K):
      // even measured against the terms' magnitudes (scales) its fp32 error
      // exceeds 1e-5 at large K, so it gets 1e-4.
      const double tol = act16 ? 1e-2 : got[o].name == "dalpha" ? 1e-4 : 1e-5;
      const bool scaled = scales != nullptr && !(*scales)[o].empty();
      EXPECT_LE(scaled ? ScaledError(got[o].values, ref[o].values, (*scales)[o])
                       : NormwiseError(got[o].values, ref[o].values),
                tol);
    }
  }
}

}  // namespace mhc::testing

#endif  // MHC_TESTS_CPU_OP_HARNESS_H_
