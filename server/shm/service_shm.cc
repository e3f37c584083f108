// The shared-memory RPCs: sessions, the regions and events they own, and
// the layer memory local clients map.
#include <string>

#include "mhc/status.h"
#include "server/service.h"
#include "server/status_util.h"

namespace mhc::server {
namespace {

// Peers on this daemon's unix sockets are on this node; anything else may
// not be.
bool IsLocal(const Authorizer& authorizer, const grpc::ServerContext& context) {
  return authorizer.Peer(context).has_value();
}

std::string Metadata(const grpc::ServerContext& context,
                     absl::string_view key) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(grpc::string_ref(key.data(), key.size()));
  if (it == metadata.end()) return "";
  return std::string(it->second.data(), it->second.size());
}

}  // namespace

absl::StatusOr<SessionRef> MhcService::SessionOf(
    const grpc::ServerContext& context) const {
  MHC_ASSIGN_OR_RETURN(std::string caller, authorizer_->Identify(context));
  return SessionRef{Metadata(context, kSessionMetadataKey), std::move(caller)};
}

RegionScope MhcService::Regions(const grpc::ServerContext& context) {
  // The call was authorized, which identified its caller already; should
  // that fail now, the request names no session and cannot use any.
  absl::StatusOr<SessionRef> session = SessionOf(context);
  return RegionScope(shm_, session.ok() ? *std::move(session) : SessionRef{},
                     IsLocal(*authorizer_, context),
                     Metadata(context, kWaitEventMetadataKey),
                     Metadata(context, kSignalEventMetadataKey));
}

void MhcService::PublishSharedMemory() {
  for (auto [kind, label] : {std::pair{v1::SHARED_MEMORY_KIND_SYSTEM, "system"},
                             std::pair{v1::SHARED_MEMORY_KIND_CUDA, "cuda"}}) {
    const auto [regions, bytes] = shm_->Totals(kind);
    metrics_->SetSharedMemory(label, regions, static_cast<double>(bytes));
  }
  const auto [pinned, pinned_bytes] = shm_->PinnedTotals();
  metrics_->SetPinnedSharedMemory(pinned, static_cast<double>(pinned_bytes));
  const auto [mappings, mapped_bytes] = shm_->MappedTotals();
  metrics_->SetCudaIpcMappings(mappings, static_cast<double>(mapped_bytes));
}

grpc::Status MhcService::OpenSession(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::SessionEvent, v1::OpenSessionRequest>*
        stream) {
  // Not admitted: an open session uses no compute, and holding an
  // admission slot for its lifetime would starve requests.
  std::string id;
  grpc::Status opened =
      Handle(*context, "OpenSession", false, [&]() -> absl::Status {
        if (admission_->draining()) {
          return absl::UnavailableError("OpenSession: the daemon is draining");
        }
        MHC_RETURN_IF_ERROR(shm_->CheckAccess(IsLocal(*authorizer_, *context)));
        MHC_ASSIGN_OR_RETURN(std::string caller,
                             authorizer_->Identify(*context));
        MHC_ASSIGN_OR_RETURN(
            id, shm_->OpenSession(std::move(caller),
                                  [context] { context->TryCancel(); }));
        return absl::OkStatus();
      });
  if (!opened.ok()) return opened;
  v1::SessionEvent event;
  event.set_session_id(id);
  event.set_max_regions(shm_->options().max_regions_per_session);
  event.set_max_bytes(shm_->options().max_bytes_per_session);
  if (stream->Write(event)) {
    // Read fails once the client half-closes, its connection drops or the
    // daemon cancels the call: each of them ends the session.
    v1::OpenSessionRequest ignored;
    while (stream->Read(&ignored)) {
    }
  }
  // Regions first: a ring opened concurrently sees the session gone (see
  // OpenCallRing).
  shm_->CloseSession(id);
  call_rings_.Close(id);
  metrics_->SetCallRings(call_rings_.size());
  PublishSharedMemory();
  return grpc::Status::OK;
}

grpc::Status MhcService::RegisterSystemSharedMemory(
    grpc::ServerContext* context,
    const v1::RegisterSystemSharedMemoryRequest* request,
    v1::RegisterSystemSharedMemoryResponse*) {
  return Handle(
      *context, "RegisterSystemSharedMemory", true, [&]() -> absl::Status {
        MHC_RETURN_IF_ERROR(shm_->CheckAccess(IsLocal(*authorizer_, *context)));
        MHC_ASSIGN_OR_RETURN(SessionRef session, SessionOf(*context));
        MHC_ASSIGN_OR_RETURN(HostPinning pinning,
                             shm_->RegisterSystem(session, *request,
                                                  authorizer_->Peer(*context)));
        if (pinning == HostPinning::kFailed) metrics_->RecordPinFailure();
        PublishSharedMemory();
        return absl::OkStatus();
      });
}

grpc::Status MhcService::RegisterCudaSharedMemory(
    grpc::ServerContext* context,
    const v1::RegisterCudaSharedMemoryRequest* request,
    v1::RegisterCudaSharedMemoryResponse* response) {
  return Handle(
      *context, "RegisterCudaSharedMemory", true, [&]() -> absl::Status {
        MHC_RETURN_IF_ERROR(shm_->CheckAccess(IsLocal(*authorizer_, *context)));
        MHC_ASSIGN_OR_RETURN(SessionRef session, SessionOf(*context));
        MHC_ASSIGN_OR_RETURN(uint64_t bytes,
                             shm_->RegisterCuda(session, *request));
        response->set_byte_size(bytes);
        PublishSharedMemory();
        return absl::OkStatus();
      });
}

grpc::Status MhcService::UnregisterSharedMemory(
    grpc::ServerContext* context,
    const v1::UnregisterSharedMemoryRequest* request,
    v1::UnregisterSharedMemoryResponse* response) {
  return Handle(
      *context, "UnregisterSharedMemory", true, [&]() -> absl::Status {
        MHC_RETURN_IF_ERROR(shm_->CheckAccess(IsLocal(*authorizer_, *context)));
        MHC_ASSIGN_OR_RETURN(SessionRef session, SessionOf(*context));
        MHC_ASSIGN_OR_RETURN(std::vector<std::string> names,
                             shm_->Unregister(session, request->name()));
        for (std::string& name : names)
          response->add_unregistered(std::move(name));
        PublishSharedMemory();
        return absl::OkStatus();
      });
}

grpc::Status MhcService::SharedMemoryStatus(
    grpc::ServerContext* context, const v1::SharedMemoryStatusRequest* request,
    v1::SharedMemoryStatusResponse* response) {
  return Handle(*context, "SharedMemoryStatus", true, [&]() -> absl::Status {
    MHC_RETURN_IF_ERROR(shm_->CheckAccess(IsLocal(*authorizer_, *context)));
    MHC_ASSIGN_OR_RETURN(SessionRef session, SessionOf(*context));
    return shm_->Status(session, request->name(), response);
  });
}

grpc::Status MhcService::RegisterCudaEvents(
    grpc::ServerContext* context, const v1::RegisterCudaEventsRequest* request,
    v1::RegisterCudaEventsResponse* response) {
  return Handle(*context, "RegisterCudaEvents", true, [&]() -> absl::Status {
    MHC_RETURN_IF_ERROR(shm_->CheckAccess(IsLocal(*authorizer_, *context)));
    MHC_ASSIGN_OR_RETURN(SessionRef session, SessionOf(*context));
    return shm_->RegisterEvents(session, *request, response);
  });
}

grpc::Status MhcService::MapLayerMemory(
    grpc::ServerContext* context, const v1::MapLayerMemoryRequest* request,
    v1::LayerMemory* response) {
  return Handle(*context, "MapLayerMemory", true, [&]() -> absl::Status {
    // The handle lets its holder write the layer: the same trust as a
    // region, so the same gate.
    MHC_RETURN_IF_ERROR(shm_->CheckAccess(IsLocal(*authorizer_, *context)));
    MHC_ASSIGN_OR_RETURN(std::shared_ptr<Layer> layer,
                         store_->Find(request->layer(), "layer"));
    return store_->Export(*layer, response);
  });
}

grpc::Status MhcService::OpenCallRing(grpc::ServerContext* context,
                                      const v1::OpenCallRingRequest* request,
                                      v1::OpenCallRingResponse* response) {
  return Handle(*context, "OpenCallRing", false, [&]() -> absl::Status {
    MHC_RETURN_IF_ERROR(shm_->CheckAccess(IsLocal(*authorizer_, *context)));
    if (admission_->draining()) {
      return absl::UnavailableError("OpenCallRing: the daemon is draining");
    }
    MHC_ASSIGN_OR_RETURN(SessionRef session, SessionOf(*context));
    if (session.id.empty()) {
      return absl::FailedPreconditionError(
          "OpenCallRing: a ring belongs to a session; send its id "
          "(mhc-session-id)");
    }
    // Ring calls act for the caller that opened the ring.
    MHC_ASSIGN_OR_RETURN(std::optional<Caller> caller,
                         authorizer_->IdentifyCaller(*context, "OpenCallRing"));
    MHC_ASSIGN_OR_RETURN(std::shared_ptr<Region> region,
                         shm_->Find(session, request->region(), "region"));
    MHC_ASSIGN_OR_RETURN(
        std::unique_ptr<CallRing> ring,
        CallRing::Start(
            std::move(region),
            [this, session, caller](const RingCallRequest& call,
                                    std::string* answer) {
              return RingCall(session, caller, call, answer);
            },
            shm_->options().call_ring_spin));
    response->set_area_bytes(ring->area_bytes());
    MHC_RETURN_IF_ERROR(call_rings_.Add(session.id, std::move(ring)));
    // The session may have ended since Find; its close found no ring.
    if (!shm_->HasSession(session.id)) {
      call_rings_.Close(session.id);
      return absl::NotFoundError("OpenCallRing: the session ended");
    }
    metrics_->SetCallRings(call_rings_.size());
    return absl::OkStatus();
  });
}

}  // namespace mhc::server
