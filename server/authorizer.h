// Authentication and authorization of one call: who is calling (bearer
// token, or the user of a unix-socket connection) and whether its role
// covers the RPC (rpc_roles.h). MhcService::Handle asks before anything
// else runs, so every mhc.v1.Mhc RPC goes through here.
#ifndef MHC_SERVER_AUTHORIZER_H_
#define MHC_SERVER_AUTHORIZER_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/server_context.h"
#include "server/auth_policy.h"
#include "server/peer_credentials.h"
#include "server/unix_listener.h"

namespace mhc::server {

class Authorizer {
 public:
  // `policy` null: authentication is off and every caller may call every
  // RPC (the default). `peers`: the daemon's unix-socket connections.
  Authorizer(std::unique_ptr<AuthPolicy> policy, const ConnectionPeers* peers);

  bool enabled() const { return policy_ != nullptr; }

  // The user of the call's connection when it is one of this daemon's unix
  // sockets; nullopt for TCP.
  std::optional<PeerCredentials> Peer(const grpc::ServerContext& context) const;

  // OK when the caller may call `rpc` (a method name of mhc.v1.Mhc, e.g.
  // "GetLayer"); UNAUTHENTICATED when it cannot be identified,
  // PERMISSION_DENIED (naming the role needed) when its role is too small.
  absl::Status Authorize(const grpc::ServerContext& context,
                         absl::string_view rpc) const;

  // Who is calling, as a key that is the same for every call of one caller
  // and differs between callers: with authentication on, the token when the
  // call carries one, else the unix-socket user; with it off, the
  // unix-socket user, else "" (TCP callers are indistinguishable). What
  // belongs to a caller (a shared-memory session) answers only to this key.
  absl::StatusOr<std::string> Identify(
      const grpc::ServerContext& context) const;

  // Authorize in two steps, for calls that arrive outside gRPC on behalf of
  // a caller authenticated once (the call ring): the caller (nullopt when
  // authentication is off), then whether that caller may call `rpc`.
  absl::StatusOr<std::optional<Caller>> IdentifyCaller(
      const grpc::ServerContext& context, absl::string_view rpc) const;
  absl::Status Check(const std::optional<Caller>& caller,
                     absl::string_view rpc) const;

 private:
  // The caller by its token or unix-socket user; only with a policy.
  absl::StatusOr<Caller> Authenticate(const grpc::ServerContext& context) const;

  const std::unique_ptr<AuthPolicy> policy_;
  const ConnectionPeers* const peers_;
};

// The credentials of the call's "authorization: Bearer ..." metadata;
// nullopt when there is none, UNAUTHENTICATED when it is malformed or
// repeated.
absl::StatusOr<std::optional<absl::string_view>> BearerToken(
    const grpc::ServerContext& context);

}  // namespace mhc::server

#endif  // MHC_SERVER_AUTHORIZER_H_
