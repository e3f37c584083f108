// The float64 math of every mHC operator (docs/SPEC.md sections 2-4), forward
// and reverse mode, as plain loops over double arrays. This is the oracle every
// backend is compared against; its own backward is checked against float64
// finite differences, which is why inputs, parameters, outputs and gradients
// are all double here (the Backend wrapper in reference_backend.cc converts).
//
// Determinism and batch invariance: single threaded, fixed loop order, every
// token computed on its own, so results are bitwise reproducible and a
// token's outputs never depend on the other tokens. Parameter gradients are
// summed over tokens in token order.
//
// Conventions shared by every function below:
// - `tokens` is M >= 0; M = 0 reads and writes nothing.
// - Shapes follow the op headers under mhc/ops/: x [M, K] in spec.layout
//   order (element (i, c) of a token at spec.XIndex(i, c)), y / f / e [M, C],
//   h [M, N] with N = spec.NumLogits(), mean_square [M], H_pre / H_post [M, n],
//   logits / H_res [M, n, n] with A[i][j] at i*n + j.
// - Outputs, including per-token input gradients, are overwritten. A null
//   per-token output is documented per function.
// - Parameter gradients in Grads are ADDED to; a null slot is not computed.
// - gamma is read only when spec.has_gamma, bias only when
//   spec.has_post_bias; phi and alpha only for dynamic layers.
#ifndef MHC_KERNELS_CPU_REFERENCE_REFERENCE_MATH_H_
#define MHC_KERNELS_CPU_REFERENCE_REFERENCE_MATH_H_

#include <cstdint>

#include "mhc/ops/optimizer.h"
#include "mhc/types.h"

namespace mhc::reference {

// One layer's parameters in double (see mhc/ops/weights.h for the shapes).
struct Weights {
  const double* phi = nullptr;    // [N, K]
  const double* alpha = nullptr;  // [3] (kHead: [1], the scalar s)
  const double* beta = nullptr;   // [N] (kHead: b_head)
  const double* gamma = nullptr;  // [K]
  const double* bias = nullptr;   // [C]
};

// Parameter gradient accumulators in double (+=; null: not computed).
struct Grads {
  double* phi = nullptr;
  double* alpha = nullptr;
  double* beta = nullptr;
  double* gamma = nullptr;
  double* bias = nullptr;
};

// ---------------------------------------------------------------- scalars --

double Sigmoid(double z);

// r(ms): 1/sqrt(ms + eps_rms) (INSIDE) or 1/(sqrt(ms) + eps_rms) (OUTSIDE).
double RmsFactor(const LayerSpec& spec, double mean_square);

// dr/dms. OUTSIDE at ms = 0 the one-sided derivative is -infinity; we return
// 0 there. ms = 0 means v = 0, where h = phi' v = 0 as well, so the logits
// z = alpha h r + beta have the exact derivative alpha phi' r(0) with respect
// to v and the ms path contributes nothing: any finite value gives the exact
// dx, and 0 keeps dmean_square finite instead of -inf * 0 = NaN.
double RmsFactorDerivative(const LayerSpec& spec, double mean_square);

// -------------------------------------------------------------- projection --

// h[m][g] = sum_k phi'[g][k] v_k with phi' = phi * gamma; mean_square[m] =
// (1/K) sum_k v_k^2. Works for kMhc (N = 2n + n^2) and kHead (N = n).
void ProjectionForward(const LayerSpec& spec, int64_t tokens, const double* x,
                       const Weights& w, double* h, double* mean_square);

// dx[m][k] = sum_g dh[g] phi'[g][k] + dmean_square * 2 v_k / K (dx may be
// null); grads.phi += (sum over tokens of dh v) * gamma, grads.gamma[k] +=
// sum_g (sum over tokens of dh_g v_k) phi[g][k].
void ProjectionBackward(const LayerSpec& spec, int64_t tokens, const double* x,
                        const Weights& w, const double* dh,
                        const double* dmean_square, double* dx,
                        const Grads& grads);

// ------------------------------------------------------------------ scale --

// z = alpha[p(g)] h r + beta (dynamic) or z = beta (static); H_pre =
// sigmoid(z_i) + eps_pre, H_post = post_mult sigmoid(z_{n+i}), logits = the
// raw z_{2n+..}. For kHead only H_pre (the mix) is written; h_post and logits
// may be null. For static layers h and mean_square are not read.
void ScaleForward(const LayerSpec& spec, int64_t tokens, const double* h,
                  const double* mean_square, const Weights& w, double* h_pre,
                  double* h_post, double* logits);

// Reverse mode of ScaleForward. dh and dmean_square are written for dynamic
// layers (may be null: not computed); grads.alpha and grads.beta accumulate.
// dh_post and dlogits are read only for kMhc.
void ScaleBackward(const LayerSpec& spec, int64_t tokens, const double* h,
                   const double* mean_square, const Weights& w,
                   const double* dh_pre, const double* dh_post,
                   const double* dlogits, double* dh, double* dmean_square,
                   const Grads& grads);

// --------------------------------------------------------------- sinkhorn --

// H_res = Sinkhorn(A) in spec.sinkhorn_mode with spec.sinkhorn_iterations
// (docs/SPEC.md section 3).
void SinkhornForward(const LayerSpec& spec, int64_t tokens,
                     const double* logits, double* h_res);

// Exact reverse mode through the T unrolled iterations.
void SinkhornBackward(const LayerSpec& spec, int64_t tokens,
                      const double* logits, const double* dh_res,
                      double* dlogits);

// -------------------------------------------------------------- aggregate --

// y[c] = sum_i H_pre[i] x[i][c].
void AggregateForward(const LayerSpec& spec, int64_t tokens, const double* x,
                      const double* h_pre, double* y);

// dx[i][c] = H_pre[i] dy[c] (dx may be null); dh_pre[i] = sum_c dy[c] x[i][c].
void AggregateBackward(const LayerSpec& spec, int64_t tokens, const double* x,
                       const double* h_pre, const double* dy, double* dx,
                       double* dh_pre);

// ------------------------------------------------------------------- post --

// x_next[j][c] = H_post[j] (f[c] + bias[c]) + sum_i R[i][j] x[i][c] with
// R = H_res (SOURCE_ROWS) or H_res^T (DEST_ROWS).
void PostForward(const LayerSpec& spec, int64_t tokens, const double* f,
                 const double* x, const double* h_post, const double* h_res,
                 const Weights& w, double* x_next);

// Reverse mode of PostForward. dx may be null (not computed); dh_res is the
// gradient of H_res itself (transposed back for DEST_ROWS); grads.bias
// accumulates df.
void PostBackward(const LayerSpec& spec, int64_t tokens, const double* dx_next,
                  const double* f, const double* x, const double* h_post,
                  const double* h_res, const Weights& w, double* df, double* dx,
                  double* dh_post, double* dh_res, const Grads& grads);

// The residual path of the post backward alone: dx[i][c] += sum_j R[i][j]
// dx_next[j][c] (ADDS into dx).
void AddResidualGradient(const LayerSpec& spec, int64_t tokens,
                         const double* h_res, const double* dx_next,
                         double* dx);

// ----------------------------------------------------------------- expand --

// x[i][c] = e[c] for every stream.
void ExpandForward(const LayerSpec& spec, int64_t tokens, const double* e,
                   double* x);

// de[c] = sum_i dx[i][c].
void ExpandBackward(const LayerSpec& spec, int64_t tokens, const double* dx,
                    double* de);

// ------------------------------------------------------------------ fused --

// pre = projection -> scale -> Sinkhorn -> aggregate (kMhc, static or
// dynamic). h_pre may be null; h [M, N] and mean_square [M] (dynamic layers,
// both or neither) receive the projection.
void PreForward(const LayerSpec& spec, int64_t tokens, const double* x,
                const Weights& w, double* y, double* h_pre, double* h_post,
                double* h_res, double* h = nullptr,
                double* mean_square = nullptr);

// Reverse mode of PreForward, recomputing the forward from x, or from the
// projection kept_h / kept_mean_square when given (dynamic layers). With
// dx_next (may be null) the post's residual path sum_j R[i][j] dx_next[j][c]
// is added to dx, R from the recomputed H_res, so dx is the layer's whole
// gradient.
void PreBackward(const LayerSpec& spec, int64_t tokens, const double* x,
                 const Weights& w, const double* dy, const double* dh_post,
                 const double* dh_res, const double* dx_next, double* dx,
                 const Grads& grads, const double* kept_h = nullptr,
                 const double* kept_mean_square = nullptr);

// head (kHead): u = (phi' v) r, mix[i] = sigmoid(s u_i + b_head[i]) +
// eps_pre, y[c] = sum_i mix[i] x[i][c]. mix may be null.
void HeadForward(const LayerSpec& spec, int64_t tokens, const double* x,
                 const Weights& w, double* y, double* mix);

void HeadBackward(const LayerSpec& spec, int64_t tokens, const double* x,
                  const Weights& w, const double* dy, double* dx,
                  const Grads& grads);

// Optimizer (mhc/ops/optimizer.h): the sum of g^2 over `count` gradients in
// element order.
double SquaredNorm(const double* grads, int64_t count);
// min(1, max_grad_norm / (norm + kClipEpsilon)); 1 without clipping.
double ClipScale(double norm, double max_grad_norm);
// One block's update: `step` >= 1 is this update's number, `slots` holds
// OptimizerSlotCount(hyper.algorithm) arrays of `count` values.
void OptimizerUpdate(const OptimizerHyperparameters& hyper, int64_t step,
                     double clip_scale, int64_t count, const double* grads,
                     double* values, double* slots);

}  // namespace mhc::reference

#endif  // MHC_KERNELS_CPU_REFERENCE_REFERENCE_MATH_H_
