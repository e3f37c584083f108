// Calls that come through a session's call ring (call_ring.h): the compute
// RPC they name, with its checks, admission and metrics, on messages parsed
// from the ring instead of gRPC.
#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/arena.h"
#include "mhc/status.h"
#include "server/service.h"

namespace mhc::server {
namespace {

// A ring call's messages are a few hundred bytes: one block, reused by the
// ring's thread, keeps them off the heap.
constexpr size_t kArenaBlockBytes = 8192;

std::string EventIndex(int index) {
  return index < 0 ? std::string() : absl::StrCat(index);
}

}  // namespace

absl::Status MhcService::RingCall(const SessionRef& session,
                                  const std::optional<Caller>& caller,
                                  const RingCallRequest& call,
                                  std::string* response) {
  const absl::Time start = absl::Now();
  const ComputeRpc* rpc = FindComputeRpc(call.method);
  if (rpc == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "call ring: '", call.method, "' is not a compute RPC of mhc.v1.Mhc"));
  }
  thread_local char block[kArenaBlockBytes];
  google::protobuf::ArenaOptions arena_options;
  arena_options.initial_block = block;
  arena_options.initial_block_size = sizeof(block);
  google::protobuf::Arena arena(arena_options);
  google::protobuf::Message* request = rpc->request->New(&arena);
  google::protobuf::Message* reply = rpc->response->New(&arena);
  return Serve(
      rpc->name, true, authorizer_->Check(caller, rpc->name), start,
      [&]() -> absl::Status {
        if (!request->ParseFromArray(call.payload.data(),
                                     static_cast<int>(call.payload.size()))) {
          return absl::InvalidArgumentError(
              absl::StrCat(rpc->name, ": the call ring's request is not a ",
                           request->GetTypeName()));
        }
        RegionScope regions(shm_, session, /*local=*/true,
                            EventIndex(call.wait_event),
                            EventIndex(call.signal_event), call.completion);
        MHC_RETURN_IF_ERROR(
            rpc->kind.has_value()
                ? runner_.RunSingle(*rpc->kind, *request, reply, &regions)
                : runner_.Execute(
                      static_cast<const v1::ExecuteRequest&>(*request),
                      static_cast<v1::ExecuteResponse*>(reply), &regions));
        if (!reply->SerializeToString(response)) {
          return absl::InternalError(
              absl::StrCat(rpc->name, ": the response did not serialize"));
        }
        return absl::OkStatus();
      });
}

}  // namespace mhc::server
