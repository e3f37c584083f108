// Scale: logits z = alpha * h * r + beta, then the gates (docs/SPEC.md section
// 2 steps 3-4). For kHead only the pre group exists (mix = sigmoid(s*u + b) +
// eps_pre). Per token, so deterministic and batch invariant; dalpha/dbeta are
// summed over tokens in token order.
#ifndef MHC_OPS_SCALE_H_
#define MHC_OPS_SCALE_H_

#include <cstdint>

#include "mhc/ops/weights.h"
#include "mhc/types.h"

namespace mhc {

struct ScaleForwardParams {
  const LayerSpec* spec = nullptr;
  int64_t tokens = 0;
  const float* h = nullptr;            // [M, N] fp32; null for static layers
  const float* mean_square = nullptr;  // [M] fp32; null for static layers
  LayerWeights weights;                // alpha, beta
  float* h_pre = nullptr;              // [M, n] fp32 out
  float* h_post = nullptr;             // [M, n] fp32 out (kMhc only)
  float* logits = nullptr;             // [M, n, n] fp32 out, raw A (kMhc only)
};

struct ScaleBackwardParams {
  const LayerSpec* spec = nullptr;
  int64_t tokens = 0;
  const float* h = nullptr;            // [M, N]; null for static layers
  const float* mean_square = nullptr;  // [M]; null for static layers
  LayerWeights weights;                // alpha, beta
  const float* dh_pre = nullptr;       // [M, n]
  const float* dh_post = nullptr;      // [M, n] (kMhc only)
  const float* dlogits = nullptr;      // [M, n, n] (kMhc only)
  float* dh = nullptr;                 // [M, N] out (dynamic only)
  float* dmean_square = nullptr;       // [M] out (dynamic only)
  LayerGrads grads;                    // alpha, beta accumulated (+=)
};

}  // namespace mhc

#endif  // MHC_OPS_SCALE_H_
