// The cases of the GPU benchmark (bench/gpu_bench.cc): every tensor an op
// reads or writes, what each case runs through the Backend interface, the
// bytes per token it must move and the outputs checked against the
// reference.
#ifndef MHC_BENCH_GPU_CASES_H_
#define MHC_BENCH_GPU_CASES_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "mhc/backend.h"
#include "mhc/dtype.h"

namespace mhc::bench {

// Every buffer an op reads or writes. Activations are of the run's dtype
// (Tensors::act: bf16 by default, f16 or f32), the rest fp32.
// Per-token tensors hold M rows; parameters and gradients are per layer.
// clang-format off
enum Tid : int {
  kX, kF, kDy, kDxNext, kE, kY, kXNext, kDx, kDf, kDe,   // activations
  kH, kMs, kHPre, kHPost, kHRes, kLogits, kDhPre, kDhPost, kDhRes, kDlogits,
  kDh, kDms, kMix,                                        // per-token fp32
  kPhi, kAlpha, kBeta, kHeadPhi, kHeadAlpha, kHeadBeta,   // parameters
  kGPhi, kGAlpha, kGBeta, kGHeadPhi, kGHeadAlpha, kGHeadBeta,  // gradients
  kNumTensors
};
// clang-format on
inline const char* const kTensorNames[kNumTensors] = {
    "x",       "f",       "dy",         "dx_next",      "e",          "y",
    "x_next",  "dx",      "df",         "de",           "h",          "ms",
    "h_pre",   "h_post",  "h_res",      "logits",       "dh_pre",     "dh_post",
    "dh_res",  "dlogits", "dh",         "dms",          "mix",        "phi",
    "alpha",   "beta",    "head_phi",   "head_alpha",   "head_beta",  "g_phi",
    "g_alpha", "g_beta",  "g_head_phi", "g_head_alpha", "g_head_beta"};

inline bool IsAct(int t) { return t <= kDe; }
inline bool PerToken(int t) { return t <= kMix; }
inline bool IsGrad(int t) { return t >= kGPhi; }
inline size_t ElemSize(int t, DType act) {
  return IsAct(t) ? DTypeSize(act) : 4;
}

// Elements per token (per-token tensors) or in all (parameters).
inline int64_t Elements(int t, const LayerSpec& s) {
  const int64_t n = s.n, C = s.hidden, K = s.K(), N = s.NumLogits();
  // clang-format off
  switch (t) {
    case kX: case kDxNext: case kXNext: case kDx: return K;
    case kF: case kDy: case kE: case kY: case kDf: case kDe: return C;
    case kH: case kDh: return N;
    case kMs: case kDms: return 1;
    case kHPre: case kHPost: case kDhPre: case kDhPost: case kMix: return n;
    case kHRes: case kLogits: case kDhRes: case kDlogits: return n * n;
    case kPhi: case kGPhi: return N * K;
    case kAlpha: case kGAlpha: return 3;
    case kBeta: case kGBeta: return N;
    case kHeadPhi: case kGHeadPhi: return n * K;
    case kHeadAlpha: case kGHeadAlpha: return 1;
    case kHeadBeta: case kGHeadBeta: return n;
  }
  // clang-format on
  return 0;
}

// Range of the random values of an fp32 tensor (mean squares must be > 0).
inline std::pair<float, float> Range(int t) {
  if (t == kMs) return {0.5f, 1.5f};
  if (t == kHPre || t == kHRes) return {0.0f, 1.0f};
  if (t == kHPost) return {0.0f, 2.0f};
  if (t == kLogits) return {-2.0f, 2.0f};
  return {-1.0f, 1.0f};
}

// Pointers to every tensor, in device memory or (for the reference) host
// memory, plus what the ops need besides.
struct Tensors {
  void* p[kNumTensors] = {};
  Workspace ws;
  DType act = DType::kBF16;  // of every activation
  template <typename T = float>
  T* f(int t) const {
    return static_cast<T*>(p[t]);
  }
  LayerWeights Weights() const {
    LayerWeights w;
    w.phi = f(kPhi);
    w.alpha = f(kAlpha);
    w.beta = f(kBeta);
    return w;
  }
  LayerWeights HeadWeights() const {
    LayerWeights w;
    w.phi = f(kHeadPhi);
    w.alpha = f(kHeadAlpha);
    w.beta = f(kHeadBeta);
    return w;
  }
};

// clang-format off
enum CaseId : int {
  kProjFwd, kProjBwd, kScaleFwd, kScaleBwd, kSinkFwd, kSinkBwd, kAggFwd,
  kAggBwd, kPostFwd, kPostBwd, kExpandFwd, kExpandBwd, kPreFwd, kPreBwd,
  kHeadFwd, kHeadBwd, kLayerFwd, kLayerFwdBwd, kNumCases
};
// clang-format on

struct Check {
  int tensor;
  // max |got - ref| / max |ref|; 0: within one ulp of a 16-bit activation
  // dtype instead (kF32ElementwiseTol norm-wise for f32 activations).
  double tol;
};

// Element-wise results in f32 activations: docs/SPEC.md section 7's bound
// for fp32 outputs (an fp32 sum of n terms, not a single rounding).
inline constexpr double kF32ElementwiseTol = 1e-5;

struct CaseInfo {
  const char* op;
  const char* direction;
  std::vector<Check> checks;
};

// Tolerances of docs/SPEC.md section 7: one ulp for element-wise 16-bit
// results, 1e-2 for anything downstream of the (tf32) projection (the
// 16-bit bound, which f32 activations meet too), fp32 mixing math tight.
inline const CaseInfo& Info(int c) {
  static const std::vector<CaseInfo>* infos = new std::vector<CaseInfo>{
      {"projection", "forward", {{kH, 1e-2}, {kMs, 1e-4}}},
      {"projection", "backward", {{kDx, 1e-2}}},
      {"scale", "forward", {{kHPre, 1e-4}, {kHPost, 1e-4}, {kLogits, 1e-4}}},
      {"scale", "backward", {{kDh, 1e-4}, {kDms, 1e-3}}},
      {"sinkhorn", "forward", {{kHRes, 1e-4}}},
      {"sinkhorn", "backward", {{kDlogits, 1e-3}}},
      {"aggregate", "forward", {{kY, 0}}},
      {"aggregate", "backward", {{kDx, 0}, {kDhPre, 1e-4}}},
      {"post", "forward", {{kXNext, 0}}},
      {"post",
       "backward",
       {{kDf, 0}, {kDx, 0}, {kDhPost, 1e-4}, {kDhRes, 1e-4}}},
      {"expand", "forward", {{kXNext, 0}}},
      {"expand", "backward", {{kDe, 0}}},
      {"pre", "forward", {{kY, 1e-2}, {kHPost, 1e-2}, {kHRes, 1e-2}}},
      {"pre", "backward", {{kDx, 1e-2}}},
      {"head", "forward", {{kY, 1e-2}, {kMix, 1e-2}}},
      {"head", "backward", {{kDx, 1e-2}}},
      {"layer", "forward", {{kY, 1e-2}, {kXNext, 1e-2}}},
      {"layer",
       "forward_backward",
       {{kXNext, 1e-2}, {kDf, 1e-2}, {kDhRes, 1e-3}, {kDx, 1e-2}}},
  };
  return (*infos)[c];
}

// Bytes per token that must move (the roofline count, exact: every
// per-token input read once and every output written once; parameters are
// per layer and left out). With keep_projection the layer cases also write
// the projection (h, mean square) forward and read it back backward. The
// layout moves the same bytes.
inline double BytesPerToken(int c, const LayerSpec& s, DType act,
                            bool keep_projection) {
  const double n = s.n, C = s.hidden, K = static_cast<double>(s.K()),
               N = static_cast<double>(s.NumLogits());
  const double a = static_cast<double>(DTypeSize(act));
  const double mix = 4.0 * (n + n * n);  // H_post and H_res
  const double kept = keep_projection ? 4 * (N + 1) : 0.0;
  // clang-format off
  switch (c) {
    case kProjFwd: return a * K + 4 * N + 4;
    case kProjBwd: return 2 * a * K + 4 * N + 4;
    case kScaleFwd: return 4 * (N + 1) + 4 * (2 * n + n * n);
    case kScaleBwd: return 8 * (N + 1) + 4 * (2 * n + n * n);
    case kSinkFwd: return 8 * n * n;
    case kSinkBwd: return 12 * n * n;
    case kAggFwd: return a * K + 4 * n + a * C;
    case kAggBwd: return a * C + 2 * a * K + 8 * n;
    case kPostFwd: return a * C + 2 * a * K + mix;
    case kPostBwd: return 3 * a * K + 2 * a * C + 2 * mix;
    case kExpandFwd: case kExpandBwd: return a * C + a * K;
    case kPreFwd: return a * K + a * C + mix;
    case kPreBwd: return 2 * a * K + a * C + mix;
    case kHeadFwd: return a * K + a * C + 4 * n;
    case kHeadBwd: return 2 * a * K + a * C;
    // pre fwd + post fwd.
    case kLayerFwd: return 3 * a * K + 2 * a * C + 2 * mix + kept;
    // + post bwd without dx (dx_next, f, x, H -> df, dH) + pre bwd folding
    // in the residual path (x, dy, dx_next, dH -> dx).
    case kLayerFwdBwd: return 8 * a * K + 5 * a * C + 5 * mix + 2 * kept;
  }
  // clang-format on
  return 0;
}

// The pre forward, post and pre backward of the single-op cases; the layer
// case adjusts them (the kept projection, the residual path folded into the
// pre backward).
inline PostBackwardParams PostBackwardOf(const LayerSpec& spec, int64_t M,
                                         const Tensors& t) {
  PostBackwardParams p;
  p.spec = &spec, p.tokens = M, p.act_dtype = t.act;
  p.dx_next = t.p[kDxNext], p.f = t.p[kF], p.x = t.p[kX];
  p.h_post = t.f(kHPost), p.h_res = t.f(kHRes), p.df = t.p[kDf];
  p.dx = t.p[kDx], p.dh_post = t.f(kDhPost), p.dh_res = t.f(kDhRes);
  return p;
}
inline PreForwardParams PreForwardOf(const LayerSpec& spec, int64_t M,
                                     const Tensors& t) {
  PreForwardParams p;
  p.spec = &spec, p.tokens = M, p.act_dtype = t.act, p.x = t.p[kX];
  p.weights = t.Weights(), p.y = t.p[kY], p.h_post = t.f(kHPost);
  p.h_res = t.f(kHRes);
  return p;
}
inline PreBackwardParams PreBackwardOf(const LayerSpec& spec, int64_t M,
                                       const Tensors& t) {
  PreBackwardParams p;
  p.spec = &spec, p.tokens = M, p.act_dtype = t.act, p.x = t.p[kX];
  p.weights = t.Weights(), p.dy = t.p[kDy], p.dh_post = t.f(kDhPost);
  p.dh_res = t.f(kDhRes), p.dx = t.p[kDx], p.grads.phi = t.f(kGPhi);
  p.grads.alpha = t.f(kGAlpha), p.grads.beta = t.f(kGBeta);
  return p;
}

inline ProjectionForwardParams ProjectionForwardOf(const LayerSpec& spec,
                                                   int64_t M,
                                                   const Tensors& t) {
  ProjectionForwardParams p;
  p.spec = &spec, p.tokens = M, p.act_dtype = t.act, p.x = t.p[kX];
  p.weights = t.Weights(), p.h = t.f(kH), p.mean_square = t.f(kMs);
  return p;
}
inline ProjectionBackwardParams ProjectionBackwardOf(const LayerSpec& spec,
                                                     int64_t M,
                                                     const Tensors& t) {
  ProjectionBackwardParams p;
  p.spec = &spec, p.tokens = M, p.act_dtype = t.act, p.x = t.p[kX];
  p.weights = t.Weights(), p.dh = t.f(kDh), p.dmean_square = t.f(kDms);
  p.dx = t.p[kDx], p.grads.phi = t.f(kGPhi);
  return p;
}

inline ScaleForwardParams ScaleForwardOf(const LayerSpec& spec, int64_t M,
                                         const Tensors& t) {
  ScaleForwardParams p;
  p.spec = &spec, p.tokens = M, p.h = t.f(kH), p.mean_square = t.f(kMs);
  p.weights = t.Weights(), p.h_pre = t.f(kHPre), p.h_post = t.f(kHPost);
  p.logits = t.f(kLogits);
  return p;
}
inline ScaleBackwardParams ScaleBackwardOf(const LayerSpec& spec, int64_t M,
                                           const Tensors& t) {
  ScaleBackwardParams p;
  p.spec = &spec, p.tokens = M, p.h = t.f(kH), p.mean_square = t.f(kMs);
  p.weights = t.Weights(), p.dh_pre = t.f(kDhPre);
  p.dh_post = t.f(kDhPost), p.dlogits = t.f(kDlogits), p.dh = t.f(kDh);
  p.dmean_square = t.f(kDms), p.grads.alpha = t.f(kGAlpha);
  p.grads.beta = t.f(kGBeta);
  return p;
}

inline SinkhornForwardParams SinkhornForwardOf(const LayerSpec& spec, int64_t M,
                                               const Tensors& t) {
  SinkhornForwardParams p;
  p.spec = &spec, p.tokens = M, p.logits = t.f(kLogits);
  p.h_res = t.f(kHRes);
  return p;
}
inline SinkhornBackwardParams SinkhornBackwardOf(const LayerSpec& spec,
                                                 int64_t M, const Tensors& t) {
  SinkhornBackwardParams p;
  p.spec = &spec, p.tokens = M, p.logits = t.f(kLogits);
  p.dh_res = t.f(kDhRes), p.dlogits = t.f(kDlogits);
  return p;
}
inline AggregateForwardParams AggregateForwardOf(const LayerSpec& spec,
                                                 int64_t M, const Tensors& t) {
  AggregateForwardParams p;
  p.spec = &spec, p.tokens = M, p.act_dtype = t.act, p.x = t.p[kX];
  p.h_pre = t.f(kHPre), p.y = t.p[kY];
  return p;
}
inline AggregateBackwardParams AggregateBackwardOf(const LayerSpec& spec,
                                                   int64_t M,
                                                   const Tensors& t) {
  AggregateBackwardParams p;
  p.spec = &spec, p.tokens = M, p.act_dtype = t.act, p.x = t.p[kX];
  p.h_pre = t.f(kHPre), p.dy = t.p[kDy], p.dx = t.p[kDx];
  p.dh_pre = t.f(kDhPre);
  return p;
}
inline PostForwardParams PostForwardOf(const LayerSpec& spec, int64_t M,
                                       const Tensors& t) {
  PostForwardParams p;
  p.spec = &spec, p.tokens = M, p.act_dtype = t.act, p.f = t.p[kF];
  p.x = t.p[kX], p.h_post = t.f(kHPost), p.h_res = t.f(kHRes);
  p.x_next = t.p[kXNext];
  return p;
}
inline ExpandForwardParams ExpandForwardOf(const LayerSpec& spec, int64_t M,
                                           const Tensors& t) {
  ExpandForwardParams p;
  p.spec = &spec, p.tokens = M, p.act_dtype = t.act, p.e = t.p[kE];
  p.x = t.p[kXNext];
  return p;
}
inline ExpandBackwardParams ExpandBackwardOf(const LayerSpec& spec, int64_t M,
                                             const Tensors& t) {
  ExpandBackwardParams p;
  p.spec = &spec, p.tokens = M, p.act_dtype = t.act;
  p.dx = t.p[kDxNext], p.de = t.p[kDe];
  return p;
}
inline HeadForwardParams HeadForwardOf(const LayerSpec& head, int64_t M,
                                       const Tensors& t) {
  HeadForwardParams p;
  p.spec = &head, p.tokens = M, p.act_dtype = t.act, p.x = t.p[kX];
  p.weights = t.HeadWeights(), p.y = t.p[kY], p.mix = t.f(kMix);
  return p;
}
inline HeadBackwardParams HeadBackwardOf(const LayerSpec& head, int64_t M,
                                         const Tensors& t) {
  HeadBackwardParams p;
  p.spec = &head, p.tokens = M, p.act_dtype = t.act, p.x = t.p[kX];
  p.weights = t.HeadWeights(), p.dy = t.p[kDy], p.dx = t.p[kDx];
  p.grads.phi = t.f(kGHeadPhi), p.grads.alpha = t.f(kGHeadAlpha);
  p.grads.beta = t.f(kGHeadBeta);
  return p;
}

// The kernel variant case `c` runs on `be` (Backend::KernelVariant: the
// op's plan on CUDA); Backend::kDefaultVariant for the layer cases, which
// run several ops.
inline absl::string_view CaseVariant(int c, const Backend& be,
                                     const LayerSpec& spec,
                                     const LayerSpec& head, const Tensors& t,
                                     int64_t M) {
  switch (c) {
    case kProjFwd:
      return be.KernelVariant(ProjectionForwardOf(spec, M, t));
    case kProjBwd:
      return be.KernelVariant(ProjectionBackwardOf(spec, M, t));
    case kScaleFwd:
      return be.KernelVariant(ScaleForwardOf(spec, M, t));
    case kScaleBwd:
      return be.KernelVariant(ScaleBackwardOf(spec, M, t));
    case kSinkFwd:
      return be.KernelVariant(SinkhornForwardOf(spec, M, t));
    case kSinkBwd:
      return be.KernelVariant(SinkhornBackwardOf(spec, M, t));
    case kAggFwd:
      return be.KernelVariant(AggregateForwardOf(spec, M, t));
    case kAggBwd:
      return be.KernelVariant(AggregateBackwardOf(spec, M, t));
    case kPostFwd:
      return be.KernelVariant(PostForwardOf(spec, M, t));
    case kPostBwd:
      return be.KernelVariant(PostBackwardOf(spec, M, t));
    case kExpandFwd:
      return be.KernelVariant(ExpandForwardOf(spec, M, t));
    case kExpandBwd:
      return be.KernelVariant(ExpandBackwardOf(spec, M, t));
    case kPreFwd:
      return be.KernelVariant(PreForwardOf(spec, M, t));
    case kPreBwd:
      return be.KernelVariant(PreBackwardOf(spec, M, t));
    case kHeadFwd:
      return be.KernelVariant(HeadForwardOf(head, M, t));
    case kHeadBwd:
      return be.KernelVariant(HeadBackwardOf(head, M, t));
  }
  return Backend::kDefaultVariant;
}

// Runs one case on `be` over `M` tokens of `t`. keep_projection: the layer
// cases' pre forward keeps h and the mean square for the pre backward, as a
// training step would (otherwise the backward recomputes them from x).
inline absl::Status RunCase(int c, Backend& be, const LayerSpec& spec,
                            const LayerSpec& head, const Tensors& t, int64_t M,
                            bool keep_projection) {
  switch (c) {
    case kProjFwd:
      return be.ProjectionForward(ProjectionForwardOf(spec, M, t), t.ws);
    case kProjBwd:
      return be.ProjectionBackward(ProjectionBackwardOf(spec, M, t), t.ws);
    case kScaleFwd:
      return be.ScaleForward(ScaleForwardOf(spec, M, t), t.ws);
    case kScaleBwd:
      return be.ScaleBackward(ScaleBackwardOf(spec, M, t), t.ws);
    case kSinkFwd:
      return be.SinkhornForward(SinkhornForwardOf(spec, M, t), t.ws);
    case kSinkBwd:
      return be.SinkhornBackward(SinkhornBackwardOf(spec, M, t), t.ws);
    case kAggFwd:
      return be.AggregateForward(AggregateForwardOf(spec, M, t), t.ws);
    case kAggBwd:
      return be.AggregateBackward(AggregateBackwardOf(spec, M, t), t.ws);
    case kPostFwd:
      return be.PostForward(PostForwardOf(spec, M, t), t.ws);
    case kPostBwd:
      return be.PostBackward(PostBackwardOf(spec, M, t), t.ws);
    case kExpandFwd:
      return be.ExpandForward(ExpandForwardOf(spec, M, t), t.ws);
    case kExpandBwd:
      return be.ExpandBackward(ExpandBackwardOf(spec, M, t), t.ws);
    case kPreFwd:
      return be.PreForward(PreForwardOf(spec, M, t), t.ws);
    case kPreBwd:
      return be.PreBackward(PreBackwardOf(spec, M, t), t.ws);
    case kHeadFwd:
      return be.HeadForward(HeadForwardOf(head, M, t), t.ws);
    case kHeadBwd:
      return be.HeadBackward(HeadBackwardOf(head, M, t), t.ws);
    case kLayerFwd:
    case kLayerFwdBwd: {
      PreForwardParams pf = PreForwardOf(spec, M, t);
      if (keep_projection) pf.h = t.f(kH), pf.mean_square = t.f(kMs);
      absl::Status st = be.PreForward(pf, t.ws);
      if (st.ok()) st = RunCase(kPostFwd, be, spec, head, t, M, false);
      if (!st.ok() || c == kLayerFwd) return st;
      // The post's dx is left to the pre backward, which folds it in.
      PostBackwardParams pb = PostBackwardOf(spec, M, t);
      pb.dx = nullptr;
      st = be.PostBackward(pb, t.ws);
      if (!st.ok()) return st;
      PreBackwardParams qb = PreBackwardOf(spec, M, t);
      qb.dx_next = t.p[kDxNext];
      qb.h = pf.h, qb.mean_square = pf.mean_square;
      return be.PreBackward(qb, t.ws);
    }
  }
  return absl::InvalidArgumentError("unknown case");
}

// The most scratch any op of the benchmark needs (head ops on the head
// layer, the rest at the activation dtype and at fp32).
inline size_t WorkspaceFor(const Backend& be, const LayerSpec& spec,
                           const LayerSpec& head, int64_t M, DType act) {
  size_t bytes = 0;
  for (int o = 0; o < kNumOpKinds; ++o) {
    const OpKind op = static_cast<OpKind>(o);
    const bool head_op =
        op == OpKind::kHeadForward || op == OpKind::kHeadBackward;
    for (DType dt : {act, DType::kF32}) {
      bytes =
          std::max(bytes, be.WorkspaceBytes(op, head_op ? head : spec, M, dt));
    }
  }
  return bytes;
}

}  // namespace mhc::bench

#endif  // MHC_BENCH_GPU_CASES_H_
