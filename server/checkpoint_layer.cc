#include "server/checkpoint_layer.h"

#include "absl/strings/str_cat.h"
#include "mhc/status.h"
#include "server/checkpoint_format.h"

namespace mhc::server {

// The in-daemon optimizer gives each Layer its algorithm, step and slot
// buffers; these four functions are where they meet checkpoints. Until then
// a layer has no optimizer state and a checkpoint that holds some is
// refused rather than loaded without it.

std::optional<v1::CheckpointOptimizerState> OptimizerStateOf(const Layer&) {
  return std::nullopt;
}

std::vector<LayerBlock> BlocksToSave(const Layer& layer, bool gradients,
                                     bool optimizer) {
  std::vector<LayerBlock> blocks = {{"param", layer.values()}};
  if (gradients) blocks.push_back({"grad", layer.grads()});
  // `optimizer` selects the optimizer's blocks: one
  // {OptimizerSection(slot), buffer} per slot, in the order of
  // OptimizerStateOf(layer)->slots, once layers have them.
  static_cast<void>(optimizer);
  return blocks;
}

absl::Status CheckOptimizerStateLoadable(
    const v1::CheckpointOptimizerState& state) {
  return absl::FailedPreconditionError(absl::StrCat(
      "the checkpoint holds optimizer state ('", state.algorithm(), "', step ",
      state.step(), ") but this mhcd keeps no optimizer state"));
}

absl::StatusOr<std::vector<LayerBlock>> BlocksToLoad(
    Layer& layer, bool gradients,
    const std::optional<v1::CheckpointOptimizerState>& optimizer) {
  std::vector<LayerBlock> blocks = {{"param", layer.values()}};
  if (gradients) blocks.push_back({"grad", layer.grads()});
  if (optimizer.has_value()) {
    MHC_RETURN_IF_ERROR(CheckOptimizerStateLoadable(*optimizer));
  }
  return blocks;
}

}  // namespace mhc::server
