// Fused layer ops: pre (projection -> scale -> Sinkhorn -> aggregate) and head
// (projection -> scale -> aggregate), forward and backward. The backward ops
// recompute the forward from x, so nothing but the forward's inputs need be
// kept between forward and backward; a dynamic pre layer may instead keep its
// projection (h and the mean square, N + 1 floats per token) from the forward
// and hand it to the backward, which then skips a read of x. Deterministic;
// token outputs and dx are batch invariant; parameter gradients are sums over
// tokens in a fixed order.
#ifndef MHC_OPS_FUSED_H_
#define MHC_OPS_FUSED_H_

#include <cstdint>

#include "mhc/ops/weights.h"
#include "mhc/types.h"

namespace mhc {

struct PreForwardParams {
  const LayerSpec* spec = nullptr;  // kind kMhc, static or dynamic
  int64_t tokens = 0;
  DType act_dtype = DType::kBF16;
  const void* x = nullptr;  // [M, K] act_dtype
  LayerWeights weights;     // phi, alpha, beta, gamma
  void* y = nullptr;        // [M, C] act_dtype out
  float* h_pre = nullptr;   // [M, n] fp32 out, optional (null: not written)
  float* h_post = nullptr;  // [M, n] fp32 out
  float* h_res = nullptr;   // [M, n, n] fp32 out
  // Optional, dynamic layers, both or neither: the projection (docs/SPEC.md
  // section 1's h and mean square) for PreBackward to take instead of
  // recomputing it.
  float* h = nullptr;            // [M, N] fp32 out
  float* mean_square = nullptr;  // [M] fp32 out
};

struct PreBackwardParams {
  const LayerSpec* spec = nullptr;
  int64_t tokens = 0;
  DType act_dtype = DType::kBF16;
  const void* x = nullptr;  // [M, K] act_dtype (forward input)
  LayerWeights weights;
  const void* dy = nullptr;        // [M, C] act_dtype (F's input gradient)
  const float* dh_post = nullptr;  // [M, n] fp32 (from post backward)
  const float* dh_res = nullptr;   // [M, n, n] fp32 (from post backward)
  // Optional [M, K] act_dtype: the post's upstream gradient. When given, the
  // residual path R dx_next is added inside the kernel, so the layer's whole
  // dx is accumulated in fp32 and rounded once (docs/SPEC.md section 4, last
  // line).
  const void* dx_next = nullptr;
  void* dx = nullptr;  // [M, K] act_dtype out
  LayerGrads grads;    // phi, alpha, beta, gamma accumulated (+=)
  // Optional, dynamic layers, both or neither: PreForward's h and
  // mean_square for this x and phi; given, the projection is not recomputed.
  const float* h = nullptr;            // [M, N] fp32
  const float* mean_square = nullptr;  // [M] fp32
};

struct HeadForwardParams {
  const LayerSpec* spec = nullptr;  // kind kHead
  int64_t tokens = 0;
  DType act_dtype = DType::kBF16;
  const void* x = nullptr;  // [M, K] act_dtype
  LayerWeights weights;     // phi [n, K], alpha [1] = s, beta [n], gamma
  void* y = nullptr;        // [M, C] act_dtype out
  float* mix = nullptr;     // [M, n] fp32 out, optional
};

struct HeadBackwardParams {
  const LayerSpec* spec = nullptr;
  int64_t tokens = 0;
  DType act_dtype = DType::kBF16;
  const void* x = nullptr;  // [M, K] act_dtype
  LayerWeights weights;
  const void* dy = nullptr;  // [M, C] act_dtype
  void* dx = nullptr;        // [M, K] act_dtype out
  LayerGrads grads;          // phi, alpha, beta, gamma accumulated (+=)
};

}  // namespace mhc

#endif  // MHC_OPS_FUSED_H_
