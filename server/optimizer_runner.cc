#include "server/optimizer_runner.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "mhc/ops/optimizer.h"
#include "mhc/status.h"

namespace mhc::server {
namespace {

// `field` must be finite and in [lo, hi] (or [lo, hi) when hi is open).
absl::Status CheckRange(absl::string_view field, float value, float lo,
                        float hi, bool hi_open) {
  const bool ok = std::isfinite(value) && value >= lo &&
                  (hi_open ? value < hi : value <= hi);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": expected a finite value in [", lo, ", ", hi,
                   hi_open ? ")" : "]", ", got ", value));
}

absl::Status CheckNonNegative(absl::string_view field, float value) {
  if (std::isfinite(value) && value >= 0.0f) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": expected a finite value >= 0, got ", value));
}

absl::StatusOr<OptimizerHyperparameters> Hyperparameters(
    const v1::OptimizerStepRequest& request) {
  OptimizerHyperparameters h;
  MHC_RETURN_IF_ERROR(
      CheckNonNegative("learning_rate", request.learning_rate()));
  MHC_RETURN_IF_ERROR(
      CheckNonNegative("max_grad_norm", request.max_grad_norm()));
  h.learning_rate = request.learning_rate();
  h.max_grad_norm = request.max_grad_norm();
  switch (request.algorithm_case()) {
    case v1::OptimizerStepRequest::kSgd: {
      const v1::SgdOptions& sgd = request.sgd();
      h.algorithm = OptimizerAlgorithm::kSgd;
      MHC_RETURN_IF_ERROR(CheckRange("sgd.momentum", sgd.momentum(), 0.0f, 1.0f,
                                     /*hi_open=*/false));
      MHC_RETURN_IF_ERROR(
          CheckNonNegative("sgd.weight_decay", sgd.weight_decay()));
      if (sgd.nesterov() && !(sgd.momentum() > 0.0f)) {
        return absl::InvalidArgumentError(
            "sgd.nesterov: needs sgd.momentum > 0");
      }
      h.momentum = sgd.momentum();
      h.nesterov = sgd.nesterov();
      h.weight_decay = sgd.weight_decay();
      break;
    }
    case v1::OptimizerStepRequest::kAdamw: {
      const v1::AdamWOptions& adamw = request.adamw();
      h.algorithm = OptimizerAlgorithm::kAdamW;
      if (adamw.has_beta1()) h.beta1 = adamw.beta1();
      if (adamw.has_beta2()) h.beta2 = adamw.beta2();
      if (adamw.has_epsilon()) h.epsilon = adamw.epsilon();
      h.weight_decay = adamw.has_weight_decay() ? adamw.weight_decay() : 0.01f;
      MHC_RETURN_IF_ERROR(CheckRange("adamw.beta1", h.beta1, 0.0f, 1.0f,
                                     /*hi_open=*/true));
      MHC_RETURN_IF_ERROR(CheckRange("adamw.beta2", h.beta2, 0.0f, 1.0f,
                                     /*hi_open=*/true));
      if (!(std::isfinite(h.epsilon) && h.epsilon > 0.0f)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "adamw.epsilon: expected a finite value > 0, got ", h.epsilon));
      }
      MHC_RETURN_IF_ERROR(
          CheckNonNegative("adamw.weight_decay", h.weight_decay));
      break;
    }
    default:
      return absl::InvalidArgumentError(
          "algorithm: required; set sgd or adamw");
  }
  return h;
}

// The layers of the request, found, distinct and on one device.
absl::StatusOr<std::vector<std::shared_ptr<Layer>>> FindLayers(
    const LayerStore& store, const v1::OptimizerStepRequest& request) {
  const int count = request.layers_size();
  if (count < 1 || count > kMaxOptimizerLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layers: expected 1..", kMaxOptimizerLayers,
                     " layer names, got ", count));
  }
  std::vector<std::shared_ptr<Layer>> layers;
  std::map<absl::string_view, int> seen;
  for (int i = 0; i < count; ++i) {
    const std::string& name = request.layers(i);
    const std::string field = absl::StrCat("layers[", i, "]");
    auto [it, fresh] = seen.emplace(name, i);
    if (!fresh) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": layer '", absl::CEscape(name),
                       "' is also layers[", it->second, "]; name it once"));
    }
    MHC_ASSIGN_OR_RETURN(std::shared_ptr<Layer> layer, store.Find(name, field));
    const Executor* first = layers.empty() ? nullptr : layers[0]->executor();
    if (first != nullptr && layer->executor() != first) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": layer '", name, "' is on ", layer->executor()->device(),
          " but layers[0] '", layers[0]->name(), "' is on ", first->device(),
          "; one OptimizerStep updates the layers of one device (send one "
          "per device)"));
    }
    layers.push_back(std::move(layer));
  }
  return layers;
}

// FAILED_PRECONDITION when layer `i` holds state of another algorithm.
absl::Status CheckState(const Layer& layer, int i, absl::string_view algorithm,
                        bool reset) {
  const OptimizerState* state = layer.optimizer_state();
  if (reset || state == nullptr || state->algorithm == algorithm) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "layers[", i, "]: ", layer.Describe(), " has ", state->algorithm,
      " optimizer state (step ", state->step, "), and this request asks for ",
      algorithm, "; set reset_state to discard that state"));
}

}  // namespace

absl::Status OptimizerRunner::Step(const v1::OptimizerStepRequest& request,
                                   v1::OptimizerStepResponse* response,
                                   RegionScope* regions, bool* allocated) {
  *allocated = false;
  MHC_ASSIGN_OR_RETURN(const OptimizerHyperparameters hyper,
                       Hyperparameters(request));
  MHC_ASSIGN_OR_RETURN(const std::vector<std::shared_ptr<Layer>> layers,
                       FindLayers(*store_, request));
  const std::string algorithm(OptimizerAlgorithmName(hyper.algorithm));
  Executor& executor = *layers[0]->executor();
  MHC_ASSIGN_OR_RETURN(const StreamOrder order,
                       regions->Events(executor.cuda_ordinal()));
  const bool host = executor.HostAccessible();
  const bool want_norm =
      hyper.max_grad_norm > 0.0f || request.compute_grad_norm();
  const bool reset = request.reset_state();

  std::vector<OptimizerTensor> tensors(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    tensors[i].count = layers[i]->parameter_count();
  }
  double norm = 0.0;
  OptimizerStepParams params;
  params.hyper = hyper;
  params.tensors = tensors.data();
  params.num_tensors = static_cast<int64_t>(tensors.size());
  params.zero_grads = request.zero_gradients();
  // Host devices write the norm here directly; device ones copy it here.
  params.grad_norm = want_norm ? &norm : nullptr;
  double seconds = 0.0;
  MHC_RETURN_IF_ERROR(executor.Run(
      [&](const Backend& backend) {
        return backend.OptimizerWorkspaceBytes(params);
      },
      host || !want_norm ? 0 : StagingArena::Footprint(sizeof(double)),
      [&](Backend& backend, Workspace ws,
          StagingArena& staging) -> absl::Status {
        const absl::Time start = absl::Now();
        for (size_t i = 0; i < layers.size(); ++i) {
          MHC_RETURN_IF_ERROR(layers[i]->CheckCurrent());
          MHC_RETURN_IF_ERROR(
              CheckState(*layers[i], static_cast<int>(i), algorithm, reset));
        }
        for (size_t i = 0; i < layers.size(); ++i) {
          Layer& layer = *layers[i];
          if (reset || layer.optimizer_state() == nullptr) {
            MHC_RETURN_IF_ERROR(
                layer.AllocateOptimizerState(backend, algorithm));
            *allocated = true;
          }
          tensors[i].values = layer.values();
          tensors[i].grads = layer.grads();
          tensors[i].slots = layer.optimizer_state()->slots;
          tensors[i].step = layer.optimizer_state()->step + 1;
        }
        if (want_norm && !host) {
          MHC_ASSIGN_OR_RETURN(void* device_norm, staging.Take(sizeof(double)));
          params.grad_norm = static_cast<double*>(device_norm);
        }
        absl::Status issued = absl::OkStatus();
        if (order.wait != nullptr) issued = backend.WaitForEvent(order.wait);
        if (issued.ok()) issued = backend.OptimizerStep(params, ws);
        if (issued.ok() && want_norm && !host) {
          issued =
              backend.CopyToHostAsync(&norm, params.grad_norm, sizeof(double));
        }
        if (issued.ok() && order.signal != nullptr) {
          issued = backend.RecordEvent(order.signal);
        }
        if (issued.ok()) {
          for (size_t i = 0; i < layers.size(); ++i) {
            layers[i]->set_optimizer_step(tensors[i].step);
            layers[i]->set_version(layers[i]->version() + 1);
            if (params.zero_grads) layers[i]->set_gradient_tokens(0);
          }
        }
        // As the ops: answered once queued only with a signal event and
        // nothing to read back; a failure waits too, so that nothing still
        // runs on the layers' memory.
        if (!host && (!issued.ok() || order.signal == nullptr || want_norm)) {
          absl::Status synced = executor.Synchronize(
              backend, want_norm ? "grad_norm" : "request");
          if (issued.ok() && !synced.ok()) {
            issued = absl::InternalError(
                absl::StrCat("the ", backend.Name(),
                             " backend failed to finish the optimizer step: ",
                             synced.message()));
          }
        }
        seconds = absl::ToDoubleSeconds(absl::Now() - start);
        return issued;
      }));
  if (metrics_ != nullptr) {
    metrics_->RecordOptimizerStep(executor.device(), algorithm, seconds);
  }
  if (want_norm) {
    response->set_grad_norm(norm);
    const double scale = hyper.max_grad_norm > 0.0f
                             ? hyper.max_grad_norm / (norm + kClipEpsilon)
                             : 1.0;
    response->set_clip_coefficient(scale < 1.0 ? static_cast<float>(scale)
                                               : 1.0f);
  } else {
    response->set_clip_coefficient(1.0f);
  }
  for (const auto& layer : layers) {
    store_->FillInfo(*layer, response->add_layers());
  }
  return absl::OkStatus();
}

}  // namespace mhc::server
