// What of a layer a checkpoint holds, as blocks of device memory: the
// parameters, the gradient accumulators and the optimizer's state buffers,
// each parameter_count() fp32 values in parameter order. Save and load walk
// these blocks and nothing else, so a new kind of per-layer state is one
// more block here.
#ifndef MHC_SERVER_CHECKPOINT_LAYER_H_
#define MHC_SERVER_CHECKPOINT_LAYER_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "mhc/v1/checkpoint.pb.h"
#include "server/layer_store.h"

namespace mhc::server {

struct LayerBlock {
  std::string section;  // "param", "grad", "optim/<slot>" (tensor names)
  float* device;        // parameter_count() floats in the layer's memory
};

// The optimizer's algorithm, step and slot names of `layer`; nullopt while
// it has no optimizer state. Call under the layer's device (steps change
// the state there).
std::optional<v1::CheckpointOptimizerState> OptimizerStateOf(
    const Layer& layer);

// The blocks a save reads: parameters, gradients when `gradients`, and each
// optimizer slot when `optimizer` and the layer has state. Call under the
// layer's device (the optimizer may allocate its state lazily).
std::vector<LayerBlock> BlocksToSave(const Layer& layer, bool gradients,
                                     bool optimizer);

// OK when this daemon can hold `state` for a layer (checked before a load
// allocates anything): FAILED_PRECONDITION for an algorithm it does not
// have, DATA_LOSS when the slots are not exactly the algorithm's or the
// step is negative.
absl::Status CheckOptimizerStateLoadable(
    const v1::CheckpointOptimizerState& state);

// The blocks a load writes into the freshly allocated `layer`: parameters,
// gradients when the checkpoint has them, and the optimizer slots of
// `optimizer` (allocated here with `backend`, zeroed, with its step set;
// the caller fills every block). Call under the layer's device.
absl::StatusOr<std::vector<LayerBlock>> BlocksToLoad(
    Backend& backend, Layer& layer, bool gradients,
    const std::optional<v1::CheckpointOptimizerState>& optimizer);

}  // namespace mhc::server

#endif  // MHC_SERVER_CHECKPOINT_LAYER_H_
