// Reference fused pre (projection -> scale -> Sinkhorn -> aggregate) and head
// (projection -> scale -> aggregate), forward and backward, float64. The
// oracle composes the single-op reference functions literally, so "fused ==
// composition" holds by construction here and is what the fast backends are
// held to. Single threaded, fixed order: bitwise deterministic; token outputs
// and dx are batch invariant; parameter gradients are summed in token order.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/reference/reference_math.h"

namespace mhc::reference {
namespace {

// The recomputed forward state of a layer for `tokens` tokens.
struct LayerState {
  std::vector<double> h;            // [M, N] (dynamic only)
  std::vector<double> mean_square;  // [M] (dynamic only)
  std::vector<double> h_pre;        // [M, n]
  std::vector<double> h_post;       // [M, n] (kMhc)
  std::vector<double> logits;       // [M, n, n] (kMhc)
  std::vector<double> h_res;        // [M, n, n] (kMhc)
};

// With kept_h / kept_mean_square (a dynamic layer's projection kept from its
// forward) the projection is taken from them instead of computed from x.
LayerState ComputeState(const LayerSpec& spec, int64_t tokens, const double* x,
                        const Weights& w, const double* kept_h = nullptr,
                        const double* kept_mean_square = nullptr) {
  const int64_t n = spec.n;
  LayerState state;
  if (spec.dynamic && kept_h != nullptr) {
    const int64_t rows = spec.NumLogits();
    state.h.assign(kept_h, kept_h + tokens * rows);
    state.mean_square.assign(kept_mean_square, kept_mean_square + tokens);
    // A kept value that overflowed fp32 stands for one that did not fit:
    // that token's projection comes from x again (docs/SPEC.md section 7).
    for (int64_t m = 0; m < tokens; ++m) {
      bool finite = std::isfinite(state.mean_square[m]);
      for (int64_t g = 0; g < rows; ++g) {
        finite = finite && std::isfinite(state.h[m * rows + g]);
      }
      if (finite) continue;
      ProjectionForward(spec, 1, x + m * spec.K(), w, &state.h[m * rows],
                        &state.mean_square[m]);
    }
  } else if (spec.dynamic) {
    state.h.assign(tokens * spec.NumLogits(), 0.0);
    state.mean_square.assign(tokens, 0.0);
    ProjectionForward(spec, tokens, x, w, state.h.data(),
                      state.mean_square.data());
  }
  state.h_pre.assign(tokens * n, 0.0);
  if (spec.kind == LayerKind::kMhc) {
    state.h_post.assign(tokens * n, 0.0);
    state.logits.assign(tokens * n * n, 0.0);
    state.h_res.assign(tokens * n * n, 0.0);
  }
  ScaleForward(spec, tokens, state.h.data(), state.mean_square.data(), w,
               state.h_pre.data(), state.h_post.data(), state.logits.data());
  if (spec.kind == LayerKind::kMhc) {
    SinkhornForward(spec, tokens, state.logits.data(), state.h_res.data());
  }
  return state;
}

// dx += the projection's input gradient (dynamic layers), and the phi/gamma
// gradients.
void ProjectionIntoDx(const LayerSpec& spec, int64_t tokens, const double* x,
                      const Weights& w, const std::vector<double>& dh,
                      const std::vector<double>& dmean_square, double* dx,
                      const Grads& grads) {
  if (!spec.dynamic) return;
  const int64_t size = tokens * spec.K();
  std::vector<double> dx_projection(size, 0.0);
  ProjectionBackward(spec, tokens, x, w, dh.data(), dmean_square.data(),
                     dx_projection.data(), grads);
  for (int64_t e = 0; e < size; ++e) dx[e] += dx_projection[e];
}

}  // namespace

void PreForward(const LayerSpec& spec, int64_t tokens, const double* x,
                const Weights& w, double* y, double* h_pre, double* h_post,
                double* h_res, double* h, double* mean_square) {
  if (tokens == 0) return;
  const LayerState state = ComputeState(spec, tokens, x, w);
  AggregateForward(spec, tokens, x, state.h_pre.data(), y);
  if (h != nullptr) {
    std::copy(state.h.begin(), state.h.end(), h);
    std::copy(state.mean_square.begin(), state.mean_square.end(), mean_square);
  }
  const int64_t n = spec.n;
  for (int64_t e = 0; e < tokens * n; ++e) {
    if (h_pre != nullptr) h_pre[e] = state.h_pre[e];
    h_post[e] = state.h_post[e];
  }
  for (int64_t e = 0; e < tokens * n * n; ++e) h_res[e] = state.h_res[e];
}

void PreBackward(const LayerSpec& spec, int64_t tokens, const double* x,
                 const Weights& w, const double* dy, const double* dh_post,
                 const double* dh_res, const double* dx_next, double* dx,
                 const Grads& grads, const double* kept_h,
                 const double* kept_mean_square) {
  if (tokens == 0) return;
  const int64_t n = spec.n;
  const LayerState state =
      ComputeState(spec, tokens, x, w, kept_h, kept_mean_square);
  std::vector<double> dh_pre(tokens * n, 0.0);
  AggregateBackward(spec, tokens, x, state.h_pre.data(), dy, dx, dh_pre.data());
  if (dx_next != nullptr) {
    AddResidualGradient(spec, tokens, state.h_res.data(), dx_next, dx);
  }
  std::vector<double> dlogits(tokens * n * n, 0.0);
  SinkhornBackward(spec, tokens, state.logits.data(), dh_res, dlogits.data());
  std::vector<double> dh(spec.dynamic ? tokens * spec.NumLogits() : 0, 0.0);
  std::vector<double> dmean_square(spec.dynamic ? tokens : 0, 0.0);
  ScaleBackward(spec, tokens, state.h.data(), state.mean_square.data(), w,
                dh_pre.data(), dh_post, dlogits.data(), dh.data(),
                dmean_square.data(), grads);
  ProjectionIntoDx(spec, tokens, x, w, dh, dmean_square, dx, grads);
}

void HeadForward(const LayerSpec& spec, int64_t tokens, const double* x,
                 const Weights& w, double* y, double* mix) {
  if (tokens == 0) return;
  const LayerState state = ComputeState(spec, tokens, x, w);
  AggregateForward(spec, tokens, x, state.h_pre.data(), y);
  if (mix != nullptr) {
    for (int64_t e = 0; e < tokens * spec.n; ++e) mix[e] = state.h_pre[e];
  }
}

void HeadBackward(const LayerSpec& spec, int64_t tokens, const double* x,
                  const Weights& w, const double* dy, double* dx,
                  const Grads& grads) {
  if (tokens == 0) return;
  const LayerState state = ComputeState(spec, tokens, x, w);
  std::vector<double> dmix(tokens * spec.n, 0.0);
  AggregateBackward(spec, tokens, x, state.h_pre.data(), dy, dx, dmix.data());
  std::vector<double> dh(tokens * spec.NumLogits(), 0.0);
  std::vector<double> dmean_square(tokens, 0.0);
  ScaleBackward(spec, tokens, state.h.data(), state.mean_square.data(), w,
                dmix.data(), nullptr, nullptr, dh.data(), dmean_square.data(),
                grads);
  ProjectionIntoDx(spec, tokens, x, w, dh, dmean_square, dx, grads);
}

}  // namespace mhc::reference
