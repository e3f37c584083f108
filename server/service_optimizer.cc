// The training RPC: OptimizerStep through the optimizer runner.
#include "server/service.h"

namespace mhc::server {

grpc::Status MhcService::OptimizerStep(grpc::ServerContext* context,
                                       const v1::OptimizerStepRequest* request,
                                       v1::OptimizerStepResponse* response) {
  return Handle(*context, "OptimizerStep", true, [&]() -> absl::Status {
    RegionScope regions = Regions(*context);
    bool allocated = false;
    absl::Status status =
        optimizer_.Step(*request, response, &regions, &allocated);
    if (allocated) UpdateLayerMetrics();
    return status;
  });
}

}  // namespace mhc::server
