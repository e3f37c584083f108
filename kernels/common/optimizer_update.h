// The fp32 element update of the optimizer step (mhc/ops/optimizer.h),
// shared by the fast CPU backend and the CUDA kernels so that both run the
// same sequence of float operations. Scalars that depend only on the step
// (bias corrections, the decoupled decay factor) are computed once on the
// host in float64 and rounded once.
#ifndef MHC_KERNELS_COMMON_OPTIMIZER_UPDATE_H_
#define MHC_KERNELS_COMMON_OPTIMIZER_UPDATE_H_

#include <math.h>

#include <cstdint>

#include "mhc/ops/optimizer.h"

#ifdef __CUDACC__
#define MHC_HOST_DEVICE __host__ __device__
#else
#define MHC_HOST_DEVICE
#endif

namespace mhc {

// What one block's update needs, as plain floats (kernel arguments).
struct OptimizerCoefficients {
  float learning_rate = 0.0f;
  float weight_decay = 0.0f;
  float momentum = 0.0f;
  bool nesterov = false;
  float decay = 1.0f;  // AdamW: 1 - lr * weight_decay
  float beta1 = 0.0f;
  float one_minus_beta1 = 1.0f;
  float beta2 = 0.0f;
  float one_minus_beta2 = 1.0f;
  float epsilon = 0.0f;
  float step_size = 0.0f;       // AdamW: lr / (1 - beta1^t)
  float inv_sqrt_bias2 = 1.0f;  // AdamW: 1 / sqrt(1 - beta2^t)
};

// Host side, float64 then rounded once; `step` >= 1.
OptimizerCoefficients MakeOptimizerCoefficients(
    const OptimizerHyperparameters& hyper, int64_t step);

// min(1, max_grad_norm / (norm + kClipEpsilon)), or 1 without clipping.
MHC_HOST_DEVICE inline float ClipScale(double norm, float max_grad_norm) {
  if (!(max_grad_norm > 0.0f)) return 1.0f;
  const double scale =
      static_cast<double>(max_grad_norm) / (norm + kClipEpsilon);
  // A NaN norm leaves the scale at 1: the NaN gradient reaches the
  // parameters either way.
  return scale < 1.0 ? static_cast<float>(scale) : 1.0f;
}

// One SGD element: `buffer` is its momentum slot (untouched when momentum is
// 0).
MHC_HOST_DEVICE inline void SgdElement(const OptimizerCoefficients& c,
                                       float clip_scale, float grad,
                                       float* value, float* buffer) {
  float g = grad * clip_scale;
  g += c.weight_decay * *value;
  if (c.momentum != 0.0f) {
    const float b = c.momentum * *buffer + g;
    *buffer = b;
    g = c.nesterov ? g + c.momentum * b : b;
  }
  *value -= c.learning_rate * g;
}

// One AdamW element with its two moments.
MHC_HOST_DEVICE inline void AdamWElement(const OptimizerCoefficients& c,
                                         float clip_scale, float grad,
                                         float* value, float* exp_avg,
                                         float* exp_avg_sq) {
  const float g = grad * clip_scale;
  const float m = c.beta1 * *exp_avg + c.one_minus_beta1 * g;
  const float v = c.beta2 * *exp_avg_sq + c.one_minus_beta2 * (g * g);
  *exp_avg = m;
  *exp_avg_sq = v;
  const float denom = sqrtf(v) * c.inv_sqrt_bias2 + c.epsilon;
  *value = *value * c.decay - c.step_size * (m / denom);
}

}  // namespace mhc

#undef MHC_HOST_DEVICE

#endif  // MHC_KERNELS_COMMON_OPTIMIZER_UPDATE_H_
