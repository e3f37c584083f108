// The data-parallel group RPCs: thin handlers over the GroupRegistry.
#include "mhc/status.h"
#include "server/service.h"

namespace mhc::server {

grpc::Status MhcService::CreateGroup(grpc::ServerContext* context,
                                     const v1::CreateGroupRequest* request,
                                     v1::GroupInfo* response) {
  return Handle(*context, "CreateGroup", true, [&]() -> absl::Status {
    MHC_ASSIGN_OR_RETURN(*response, groups_->Create(*request));
    return absl::OkStatus();
  });
}

grpc::Status MhcService::JoinGroup(grpc::ServerContext* context,
                                   const v1::JoinGroupRequest* request,
                                   v1::GroupInfo* response) {
  return Handle(*context, "JoinGroup", true, [&]() -> absl::Status {
    MHC_ASSIGN_OR_RETURN(*response, groups_->Join(*request));
    return absl::OkStatus();
  });
}

grpc::Status MhcService::GetGroup(grpc::ServerContext* context,
                                  const v1::GetGroupRequest* request,
                                  v1::GroupInfo* response) {
  return Handle(*context, "GetGroup", false, [&]() -> absl::Status {
    MHC_ASSIGN_OR_RETURN(*response, groups_->Get(*request));
    return absl::OkStatus();
  });
}

grpc::Status MhcService::AllReduceGradients(
    grpc::ServerContext* context, const v1::AllReduceGradientsRequest* request,
    v1::CollectiveResponse* response) {
  return Handle(*context, "AllReduceGradients", true, [&]() -> absl::Status {
    MHC_ASSIGN_OR_RETURN(*response, groups_->AllReduceGradients(*request));
    return absl::OkStatus();
  });
}

grpc::Status MhcService::BroadcastParameters(
    grpc::ServerContext* context, const v1::BroadcastParametersRequest* request,
    v1::CollectiveResponse* response) {
  return Handle(*context, "BroadcastParameters", true, [&]() -> absl::Status {
    MHC_ASSIGN_OR_RETURN(*response, groups_->BroadcastParameters(*request));
    return absl::OkStatus();
  });
}

grpc::Status MhcService::LeaveGroup(grpc::ServerContext* context,
                                    const v1::LeaveGroupRequest* request,
                                    v1::LeaveGroupResponse*) {
  // Not admitted: leaving must work while the daemon is busy or draining.
  return Handle(*context, "LeaveGroup", false,
                [&]() { return groups_->Leave(*request); });
}

}  // namespace mhc::server
