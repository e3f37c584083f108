// A gRPC server interceptor that sees every RPC of every service (mhc.v1,
// health, reflection): it records the grpc_server_* metrics, gives each
// RPC a request id (the client's `x-request-id` metadata when valid, else a
// random one, returned in the `x-request-id` trailer) and writes the access
// log line --log_requests asks for.
#ifndef MHC_SERVER_RPC_OBSERVER_H_
#define MHC_SERVER_RPC_OBSERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/server_interceptor.h"
#include "server/metrics.h"

namespace mhc::server {

// Which RPCs get an access log line.
enum class RequestLogMode { kNone, kFailed, kAll };

// "none", "failed" or "all".
absl::StatusOr<RequestLogMode> ParseRequestLogMode(absl::string_view name);

// The client's id when it is 1..128 characters of [A-Za-z0-9._:-], else a
// fresh random one (16 hex digits).
std::string RequestId(absl::string_view from_client);

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeRpcObserverFactory(Metrics* metrics, RequestLogMode log_mode);

}  // namespace mhc::server

#endif  // MHC_SERVER_RPC_OBSERVER_H_
