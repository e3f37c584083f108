// The optimizer step's vocabulary, its host-side coefficients, and the
// validating Backend entry point (see mhc/ops/optimizer.h).
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/optimizer_update.h"
#include "mhc/backend.h"
#include "mhc/status.h"

namespace mhc {

absl::string_view OptimizerAlgorithmName(OptimizerAlgorithm algorithm) {
  return algorithm == OptimizerAlgorithm::kAdamW ? "adamw" : "sgd";
}

absl::StatusOr<OptimizerAlgorithm> OptimizerAlgorithmFromName(
    absl::string_view name) {
  if (name == "sgd") return OptimizerAlgorithm::kSgd;
  if (name == "adamw") return OptimizerAlgorithm::kAdamW;
  return absl::InvalidArgumentError(absl::StrCat(
      "optimizer algorithm: expected 'sgd' or 'adamw', got '", name, "'"));
}

int OptimizerSlotCount(OptimizerAlgorithm algorithm) {
  return algorithm == OptimizerAlgorithm::kAdamW ? 2 : 1;
}

absl::string_view OptimizerSlotName(OptimizerAlgorithm algorithm, int slot) {
  if (algorithm == OptimizerAlgorithm::kSgd) return "momentum_buffer";
  return slot == 0 ? "exp_avg" : "exp_avg_sq";
}

int64_t NormPartialCount(const OptimizerStepParams& p) {
  int64_t partials = 0;
  for (int64_t i = 0; i < p.num_tensors; ++i) {
    partials += (p.tensors[i].count + kNormChunk - 1) / kNormChunk;
  }
  return partials;
}

OptimizerCoefficients MakeOptimizerCoefficients(
    const OptimizerHyperparameters& hyper, int64_t step) {
  OptimizerCoefficients c;
  const double lr = hyper.learning_rate;
  c.learning_rate = hyper.learning_rate;
  c.weight_decay = hyper.weight_decay;
  c.momentum = hyper.momentum;
  c.nesterov = hyper.nesterov;
  if (hyper.algorithm == OptimizerAlgorithm::kAdamW) {
    const double beta1 = hyper.beta1;
    const double beta2 = hyper.beta2;
    const double t = static_cast<double>(step);
    c.weight_decay = 0.0f;  // decoupled: applied through `decay`
    c.decay = static_cast<float>(1.0 - lr * hyper.weight_decay);
    c.beta1 = hyper.beta1;
    c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
    c.beta2 = hyper.beta2;
    c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    c.epsilon = hyper.epsilon;
    c.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, t)));
    c.inv_sqrt_bias2 =
        static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2, t)));
  }
  return c;
}

namespace {

absl::Status CheckRange(absl::string_view field, float value, float lo,
                        float hi, bool hi_inclusive) {
  const bool ok = std::isfinite(value) && value >= lo &&
                  (hi_inclusive ? value <= hi : value < hi);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("optimizer step: ", field, " must be in [", lo, ", ", hi,
                   hi_inclusive ? "]" : ")", ", got ", value));
}

}  // namespace

absl::Status ValidateOptimizerHyperparameters(
    const OptimizerHyperparameters& h) {
  constexpr float kInf = INFINITY;
  MHC_RETURN_IF_ERROR(CheckRange("learning_rate", h.learning_rate, 0.0f, kInf,
                                 /*hi_inclusive=*/false));
  MHC_RETURN_IF_ERROR(CheckRange("weight_decay", h.weight_decay, 0.0f, kInf,
                                 /*hi_inclusive=*/false));
  MHC_RETURN_IF_ERROR(CheckRange("max_grad_norm", h.max_grad_norm, 0.0f, kInf,
                                 /*hi_inclusive=*/false));
  if (h.algorithm == OptimizerAlgorithm::kSgd) {
    MHC_RETURN_IF_ERROR(CheckRange("momentum", h.momentum, 0.0f, 1.0f,
                                   /*hi_inclusive=*/true));
    if (h.nesterov && !(h.momentum > 0.0f)) {
      return absl::InvalidArgumentError(
          "optimizer step: nesterov needs momentum > 0");
    }
    return absl::OkStatus();
  }
  MHC_RETURN_IF_ERROR(
      CheckRange("beta1", h.beta1, 0.0f, 1.0f, /*hi_inclusive=*/false));
  MHC_RETURN_IF_ERROR(
      CheckRange("beta2", h.beta2, 0.0f, 1.0f, /*hi_inclusive=*/false));
  if (!(std::isfinite(h.epsilon) && h.epsilon > 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer step: epsilon must be finite and > 0, got ", h.epsilon));
  }
  return absl::OkStatus();
}

size_t Backend::OptimizerWorkspaceBytes(const OptimizerStepParams& p) const {
  if (!NeedsGradNorm(p)) return 0;
  return kOptimizerScalarBytes +
         static_cast<size_t>(NormPartialCount(p)) * sizeof(double);
}

absl::Status Backend::OptimizerStep(const OptimizerStepParams& p,
                                    Workspace ws) {
  MHC_RETURN_IF_ERROR(ValidateOptimizerHyperparameters(p.hyper));
  if (p.num_tensors < 0 || (p.num_tensors > 0 && p.tensors == nullptr)) {
    return absl::InvalidArgumentError(
        "optimizer step: tensors must hold num_tensors (>= 0) blocks");
  }
  for (int64_t i = 0; i < p.num_tensors; ++i) {
    const OptimizerTensor& t = p.tensors[i];
    if (t.count < 0 || t.step < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer step: tensors[", i, "] needs count >= 0 and step >= 1, ",
          "got count ", t.count, " and step ", t.step));
    }
    if (t.count > 0 &&
        (t.values == nullptr || t.grads == nullptr || t.slots == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer step: tensors[", i,
                       "] needs values, grads and slots (one is null)"));
    }
  }
  if (p.hyper.max_grad_norm > 0.0f && p.grad_norm == nullptr) {
    return absl::InvalidArgumentError(
        "optimizer step: grad_norm is required when clipping");
  }
  if (ws.bytes < OptimizerWorkspaceBytes(p) ||
      (ws.bytes > 0 && ws.data == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer step: workspace of ", ws.bytes,
                     " bytes, needs ", OptimizerWorkspaceBytes(p)));
  }
  return RunOptimizerStep(p, ws);
}

}  // namespace mhc
