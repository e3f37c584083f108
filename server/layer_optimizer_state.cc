// Layer's optimizer state (see OptimizerState in layer_store.h): one device
// allocation per layer holding every slot.
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "mhc/ops/optimizer.h"
#include "mhc/status.h"
#include "server/layer_store.h"

namespace mhc::server {

absl::Status Layer::AllocateOptimizerState(Backend& backend,
                                           absl::string_view algorithm) {
  MHC_ASSIGN_OR_RETURN(OptimizerAlgorithm kind,
                       OptimizerAlgorithmFromName(algorithm));
  auto state = std::make_unique<OptimizerState>();
  state->algorithm = std::string(OptimizerAlgorithmName(kind));
  for (int s = 0; s < OptimizerSlotCount(kind); ++s) {
    state->slot_names.emplace_back(OptimizerSlotName(kind, s));
  }
  const size_t bytes = state->slot_names.size() *
                       static_cast<size_t>(total_elements_) * sizeof(float);
  MHC_ASSIGN_OR_RETURN(void* slots, backend.Allocate(bytes));
  state->slots = static_cast<float*>(slots);
  absl::Status zeroed = backend.Memset(slots, 0, bytes);
  if (!zeroed.ok()) {
    backend.Free(slots);
    return zeroed;
  }
  FreeOptimizerState(backend);
  absl::MutexLock lock(&optimizer_mu_);
  optimizer_ = std::move(state);
  return absl::OkStatus();
}

absl::Status Layer::RestoreOptimizerState(Backend& backend,
                                          absl::string_view algorithm,
                                          int64_t step,
                                          const std::vector<float>& slots) {
  MHC_ASSIGN_OR_RETURN(OptimizerAlgorithm kind,
                       OptimizerAlgorithmFromName(algorithm));
  const size_t expected =
      static_cast<size_t>(OptimizerSlotCount(kind) * total_elements_);
  if (slots.size() != expected || step < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        Describe(), ": ", algorithm, " optimizer state needs ", expected,
        " floats and a step >= 0, got ", slots.size(), " and step ", step));
  }
  MHC_RETURN_IF_ERROR(AllocateOptimizerState(backend, algorithm));
  MHC_RETURN_IF_ERROR(backend.CopyToDevice(optimizer_->slots, slots.data(),
                                           slots.size() * sizeof(float)));
  set_optimizer_step(step);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> Layer::ReadOptimizerState(
    Backend& backend) const {
  if (optimizer_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(Describe(), " has no optimizer state"));
  }
  std::vector<float> slots(optimizer_->slot_names.size() *
                           static_cast<size_t>(total_elements_));
  MHC_RETURN_IF_ERROR(backend.CopyToHost(slots.data(), optimizer_->slots,
                                         slots.size() * sizeof(float)));
  return slots;
}

void Layer::FreeOptimizerState(Backend& backend) {
  std::unique_ptr<OptimizerState> doomed;
  {
    absl::MutexLock lock(&optimizer_mu_);
    doomed = std::move(optimizer_);
  }
  if (doomed != nullptr && doomed->slots != nullptr) {
    backend.Free(doomed->slots);
  }
}

void Layer::set_optimizer_step(int64_t step) {
  absl::MutexLock lock(&optimizer_mu_);
  if (optimizer_ != nullptr) optimizer_->step = step;
}

std::pair<std::string, int64_t> Layer::optimizer_summary() const {
  absl::MutexLock lock(&optimizer_mu_);
  if (optimizer_ == nullptr) return {"", 0};
  return {optimizer_->algorithm, optimizer_->step};
}

uint64_t Layer::optimizer_state_bytes() const {
  absl::MutexLock lock(&optimizer_mu_);
  if (optimizer_ == nullptr) return 0;
  return optimizer_->slot_names.size() *
         static_cast<uint64_t>(total_elements_) * sizeof(float);
}

}  // namespace mhc::server
