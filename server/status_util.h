// The one place where absl::Status becomes grpc::Status.
#ifndef MHC_SERVER_STATUS_UTIL_H_
#define MHC_SERVER_STATUS_UTIL_H_

#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace mhc::server {

// Same code (absl and gRPC share the numbering), same message.
grpc::Status ToGrpcStatus(const absl::Status& status);

// "OK", "INVALID_ARGUMENT", ... as used in metric labels.
std::string StatusCodeName(grpc::StatusCode code);

// Prefixes the message with `context` ("ops[2] (pre1): ") keeping the code.
absl::Status Annotate(const absl::Status& status, absl::string_view context);

}  // namespace mhc::server

#endif  // MHC_SERVER_STATUS_UTIL_H_
