// SaveCheckpoint, LoadCheckpoint and ListCheckpoints: the checkpoint store
// does the work; these admit, map the status and refresh the layer gauges.
#include "mhc/status.h"
#include "server/service.h"

namespace mhc::server {

grpc::Status MhcService::SaveCheckpoint(
    grpc::ServerContext* context, const v1::SaveCheckpointRequest* request,
    v1::SaveCheckpointResponse* response) {
  return Handle(*context, "SaveCheckpoint", true, [&]() -> absl::Status {
    MHC_ASSIGN_OR_RETURN(*response, checkpoints_->Save(*request));
    return absl::OkStatus();
  });
}

grpc::Status MhcService::LoadCheckpoint(
    grpc::ServerContext* context, const v1::LoadCheckpointRequest* request,
    v1::LoadCheckpointResponse* response) {
  return Handle(*context, "LoadCheckpoint", true, [&]() -> absl::Status {
    MHC_ASSIGN_OR_RETURN(*response, checkpoints_->Load(*request));
    UpdateLayerMetrics();
    return absl::OkStatus();
  });
}

grpc::Status MhcService::ListCheckpoints(
    grpc::ServerContext* context, const v1::ListCheckpointsRequest*,
    v1::ListCheckpointsResponse* response) {
  return Handle(*context, "ListCheckpoints", true, [&]() -> absl::Status {
    MHC_ASSIGN_OR_RETURN(*response, checkpoints_->List());
    return absl::OkStatus();
  });
}

}  // namespace mhc::server
