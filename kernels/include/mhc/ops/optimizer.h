// Optimizer step: updates fp32 parameter blocks in place from their gradient
// accumulators and per-element optimizer state, for several blocks (layers)
// at once so that gradient clipping can use their global L2 norm.
//
// Algorithms (g is the gradient times the clip scale, t the block's step):
// - SGD: g += weight_decay * p; with momentum, b = momentum * b + g and
//   g = nesterov ? g + momentum * b : b; p -= lr * g. The momentum buffer
//   starts at zero, so the first step sets b = g.
// - AdamW: p *= 1 - lr * weight_decay (decoupled); m = b1 m + (1 - b1) g;
//   v = b2 v + (1 - b2) g^2; p -= lr / (1 - b1^t) * m /
//   (sqrt(v) / sqrt(1 - b2^t) + eps).
// Clipping: norm = sqrt(sum of g^2 over every element of every block);
// scale = min(1, max_grad_norm / (norm + 1e-6)).
//
// Determinism: element updates are independent; the norm is summed in
// float64, first within fixed chunks of kNormChunk elements in element
// order, then over the chunks in (block, chunk) order. The partition is a
// constant, never derived from thread or SM counts, so every run on a
// backend gives the same bits.
#ifndef MHC_OPS_OPTIMIZER_H_
#define MHC_OPS_OPTIMIZER_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mhc {

enum class OptimizerAlgorithm : uint8_t { kSgd, kAdamW };

// "sgd", "adamw".
absl::string_view OptimizerAlgorithmName(OptimizerAlgorithm algorithm);
absl::StatusOr<OptimizerAlgorithm> OptimizerAlgorithmFromName(
    absl::string_view name);
// State slots per parameter element: SGD keeps "momentum_buffer", AdamW
// "exp_avg" and "exp_avg_sq", in that order.
int OptimizerSlotCount(OptimizerAlgorithm algorithm);
absl::string_view OptimizerSlotName(OptimizerAlgorithm algorithm, int slot);

// Elements per float64 partial of the global norm.
inline constexpr int64_t kNormChunk = 4096;
// Added to the norm before dividing max_grad_norm by it.
inline constexpr double kClipEpsilon = 1e-6;

struct OptimizerHyperparameters {
  OptimizerAlgorithm algorithm = OptimizerAlgorithm::kSgd;
  float learning_rate = 0.0f;  // finite, >= 0
  // SGD: L2 term added to the gradient; AdamW: decoupled decay. >= 0.
  float weight_decay = 0.0f;
  float momentum = 0.0f;  // SGD, [0, 1]
  bool nesterov = false;  // SGD, needs momentum > 0
  float beta1 = 0.9f;     // AdamW, [0, 1)
  float beta2 = 0.999f;   // AdamW, [0, 1)
  float epsilon = 1e-8f;  // AdamW, > 0
  // > 0: scale the gradients so their global L2 norm is at most this.
  float max_grad_norm = 0.0f;
};

// One parameter block and its gradients and state, in backend memory.
struct OptimizerTensor {
  float* values = nullptr;  // [count], updated in place
  float* grads = nullptr;   // [count], zeroed after use when zero_grads
  // OptimizerSlotCount slots of [count] floats, slot s at slots + s * count.
  float* slots = nullptr;
  int64_t count = 0;
  int64_t step = 0;  // this update's number, >= 1 (AdamW bias correction)
};

struct OptimizerStepParams {
  OptimizerHyperparameters hyper;
  const OptimizerTensor* tensors = nullptr;  // host array
  int64_t num_tensors = 0;
  bool zero_grads = false;
  // Backend memory for one double: the global L2 norm of the gradients
  // before clipping. Required when clipping; when null otherwise, the norm
  // is not computed.
  double* grad_norm = nullptr;
};

// Whether the step computes the global norm.
inline bool NeedsGradNorm(const OptimizerStepParams& p) {
  return p.grad_norm != nullptr || p.hyper.max_grad_norm > 0.0f;
}

// float64 norm partials of the step: one per started kNormChunk of every
// block.
int64_t NormPartialCount(const OptimizerStepParams& p);

// The workspace of a step that computes the norm: the clip scale (one
// float) in the first kOptimizerScalarBytes, then the NormPartialCount
// doubles in (block, chunk) order.
inline constexpr size_t kOptimizerScalarBytes = 256;

// INVALID_ARGUMENT naming the first hyperparameter out of its range.
absl::Status ValidateOptimizerHyperparameters(
    const OptimizerHyperparameters& hyper);

}  // namespace mhc

#endif  // MHC_OPS_OPTIMIZER_H_
