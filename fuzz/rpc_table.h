// Every unary and client-streaming RPC of mhc.v1.Mhc as a function of its
// serialized request (for a client stream, its pieces as EncodeStream
// writes them): parse, call the MhcService handler, discard the response. The
// harnesses and the seed writer pick RPCs by their index in the service
// descriptor, so an input's first byte keeps its meaning as long as
// service.proto only appends RPCs.
#ifndef MHC_FUZZ_RPC_TABLE_H_
#define MHC_FUZZ_RPC_TABLE_H_

#include <functional>
#include <string>

#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"
#include "server/service.h"

namespace mhc::fuzz {

// Parses `request` as the RPC's request message, calls its handler and
// returns its answer (INVALID_ARGUMENT when the bytes do not parse). Aborts
// on INTERNAL or UNKNOWN (see AbortOnDaemonBug).
using RpcInvoker =
    std::function<grpc::Status(server::MhcService&, absl::string_view request)>;

// INTERNAL and UNKNOWN mean a bug on the daemon's side (a failed invariant,
// an escaped exception), never a bad request: the harnesses abort on them,
// which libFuzzer reports as a crash.
void AbortOnDaemonBug(absl::string_view rpc, const grpc::Status& status);

// The invoker of method `index` of mhc.v1.Mhc, or null for the RPCs that
// answer in a stream (StreamParameters and ExecuteStream repeat unary
// RPCs; OpenSession carries no request content) and for indices past the
// last method.
const RpcInvoker* FindRpc(int index);

// The number of methods of mhc.v1.Mhc.
int RpcCount();

// Index of method `name` in mhc.v1.Mhc; -1 when there is none.
int RpcIndex(absl::string_view name);

}  // namespace mhc::fuzz

#endif  // MHC_FUZZ_RPC_TABLE_H_
