// Reference optimizer step (mhc/ops/optimizer.h) in float64: hyperparameters
// widened from fp32, every intermediate in double. Single threaded, fixed
// loop order.
#include <cmath>

#include "cpu/reference/reference_math.h"

namespace mhc::reference {

double SquaredNorm(const double* grads, int64_t count) {
  double sum = 0.0;
  for (int64_t e = 0; e < count; ++e) sum += grads[e] * grads[e];
  return sum;
}

double ClipScale(double norm, double max_grad_norm) {
  if (!(max_grad_norm > 0.0)) return 1.0;
  const double scale = max_grad_norm / (norm + kClipEpsilon);
  return scale < 1.0 ? scale : 1.0;
}

void OptimizerUpdate(const OptimizerHyperparameters& hyper, int64_t step,
                     double clip_scale, int64_t count, const double* grads,
                     double* values, double* slots) {
  const double lr = hyper.learning_rate;
  const double weight_decay = hyper.weight_decay;
  if (hyper.algorithm == OptimizerAlgorithm::kSgd) {
    const double momentum = hyper.momentum;
    double* buffer = slots;
    for (int64_t e = 0; e < count; ++e) {
      double g = grads[e] * clip_scale + weight_decay * values[e];
      if (momentum != 0.0) {
        buffer[e] = momentum * buffer[e] + g;
        g = hyper.nesterov ? g + momentum * buffer[e] : buffer[e];
      }
      values[e] -= lr * g;
    }
    return;
  }
  const double beta1 = hyper.beta1;
  const double beta2 = hyper.beta2;
  const double t = static_cast<double>(step);
  const double bias1 = 1.0 - std::pow(beta1, t);
  const double bias2 = 1.0 - std::pow(beta2, t);
  double* exp_avg = slots;
  double* exp_avg_sq = slots + count;
  for (int64_t e = 0; e < count; ++e) {
    const double g = grads[e] * clip_scale;
    exp_avg[e] = beta1 * exp_avg[e] + (1.0 - beta1) * g;
    exp_avg_sq[e] = beta2 * exp_avg_sq[e] + (1.0 - beta2) * g * g;
    const double denom =
        std::sqrt(exp_avg_sq[e]) / std::sqrt(bias2) + hyper.epsilon;
    values[e] *= 1.0 - lr * weight_decay;
    values[e] -= lr / bias1 * exp_avg[e] / denom;
  }
}

}  // namespace mhc::reference
