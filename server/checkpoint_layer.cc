#include "server/checkpoint_layer.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "mhc/ops/optimizer.h"
#include "mhc/status.h"
#include "server/checkpoint_format.h"

namespace mhc::server {

namespace {

// The slot names of `algorithm`, in the order of its state in memory.
std::vector<std::string> SlotNames(OptimizerAlgorithm algorithm) {
  std::vector<std::string> names;
  for (int s = 0; s < OptimizerSlotCount(algorithm); ++s) {
    names.emplace_back(OptimizerSlotName(algorithm, s));
  }
  return names;
}

}  // namespace

std::optional<v1::CheckpointOptimizerState> OptimizerStateOf(
    const Layer& layer) {
  const OptimizerState* state = layer.optimizer_state();
  if (state == nullptr) return std::nullopt;
  v1::CheckpointOptimizerState out;
  out.set_algorithm(state->algorithm);
  out.set_step(state->step);
  for (const std::string& slot : state->slot_names) out.add_slots(slot);
  return out;
}

std::vector<LayerBlock> BlocksToSave(const Layer& layer, bool gradients,
                                     bool optimizer) {
  std::vector<LayerBlock> blocks = {{"param", layer.values()}};
  if (gradients) blocks.push_back({"grad", layer.grads()});
  const OptimizerState* state = layer.optimizer_state();
  if (optimizer && state != nullptr) {
    for (size_t s = 0; s < state->slot_names.size(); ++s) {
      blocks.push_back(
          {OptimizerSection(state->slot_names[s]),
           state->slots + s * static_cast<size_t>(layer.parameter_count())});
    }
  }
  return blocks;
}

absl::Status CheckOptimizerStateLoadable(
    const v1::CheckpointOptimizerState& state) {
  absl::StatusOr<OptimizerAlgorithm> algorithm =
      OptimizerAlgorithmFromName(state.algorithm());
  if (!algorithm.ok()) {
    // Perhaps a newer mhcd's algorithm: the file may be fine, this daemon
    // just cannot continue it.
    return absl::FailedPreconditionError(
        absl::StrCat("its optimizer state is of algorithm '", state.algorithm(),
                     "', which this mhcd does not have (it has ",
                     OptimizerAlgorithmName(OptimizerAlgorithm::kSgd), ", ",
                     OptimizerAlgorithmName(OptimizerAlgorithm::kAdamW), ")"));
  }
  if (state.step() < 0) {
    return absl::DataLossError(absl::StrCat(
        "its ", state.algorithm(), " optimizer state is inconsistent: step ",
        state.step(), " (must be >= 0)"));
  }
  // Each slot of the algorithm exactly once; the order does not matter, as
  // the load matches slots by name.
  const std::vector<std::string> expected = SlotNames(*algorithm);
  std::vector<std::string> got(state.slots().begin(), state.slots().end());
  std::vector<std::string> sorted_expected = expected;
  std::sort(got.begin(), got.end());
  std::sort(sorted_expected.begin(), sorted_expected.end());
  if (got != sorted_expected) {
    return absl::DataLossError(absl::StrCat(
        "its ", state.algorithm(), " optimizer state is inconsistent: slots (",
        absl::StrJoin(state.slots(), ", "), ") but ", state.algorithm(),
        " keeps (", absl::StrJoin(expected, ", "), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<LayerBlock>> BlocksToLoad(
    Backend& backend, Layer& layer, bool gradients,
    const std::optional<v1::CheckpointOptimizerState>& optimizer) {
  std::vector<LayerBlock> blocks = {{"param", layer.values()}};
  if (gradients) blocks.push_back({"grad", layer.grads()});
  if (!optimizer.has_value()) return blocks;
  MHC_RETURN_IF_ERROR(CheckOptimizerStateLoadable(*optimizer));
  // Zeroed slots now, filled by the loader from the file's blocks; a load
  // that fails later drops the layer and its state with it.
  MHC_RETURN_IF_ERROR(
      layer.AllocateOptimizerState(backend, optimizer->algorithm()));
  layer.set_optimizer_step(optimizer->step());
  const OptimizerState& state = *layer.optimizer_state();
  for (size_t s = 0; s < state.slot_names.size(); ++s) {
    blocks.push_back(
        {OptimizerSection(state.slot_names[s]),
         state.slots + s * static_cast<size_t>(layer.parameter_count())});
  }
  return blocks;
}

}  // namespace mhc::server
