// OptimizerStep: one optimizer step over layers of one device.
//
// The request is validated completely before anything changes: the layer
// names (present, distinct, on one device), the hyperparameters, and each
// layer's optimizer state (an existing state of another algorithm is
// FAILED_PRECONDITION unless reset_state). Then, under the device, missing
// state is allocated, the backend's OptimizerStep updates every layer, and
// each layer's step counter and parameter version advance.
//
// The clip scale is computed on the device, so the update never waits for
// the host. The request itself waits for the device only to return the
// gradient norm, or when it has no session signal event (like the ops:
// see op_runner.h, "Stream order").
#ifndef MHC_SERVER_OPTIMIZER_RUNNER_H_
#define MHC_SERVER_OPTIMIZER_RUNNER_H_

#include "absl/status/status.h"
#include "mhc/v1/optimizer.pb.h"
#include "server/layer_store.h"
#include "server/metrics.h"
#include "server/shm/shm_registry.h"

namespace mhc::server {

// Most layers one OptimizerStep may name.
inline constexpr int kMaxOptimizerLayers = 4096;

class OptimizerRunner {
 public:
  // `metrics` may be null.
  OptimizerRunner(LayerStore* store, Metrics* metrics)
      : store_(store), metrics_(metrics) {}

  // `allocated`: set when some layer's optimizer state was (re)allocated,
  // even if the step then failed.
  absl::Status Step(const v1::OptimizerStepRequest& request,
                    v1::OptimizerStepResponse* response, RegionScope* regions,
                    bool* allocated);

 private:
  LayerStore* const store_;
  Metrics* const metrics_;
};

}  // namespace mhc::server

#endif  // MHC_SERVER_OPTIMIZER_RUNNER_H_
