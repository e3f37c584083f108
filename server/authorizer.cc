#include "server/authorizer.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "mhc/status.h"
#include "server/rpc_roles.h"

namespace mhc::server {

Authorizer::Authorizer(std::unique_ptr<AuthPolicy> policy,
                       const ConnectionPeers* peers)
    : policy_(std::move(policy)), peers_(peers) {}

std::optional<PeerCredentials> Authorizer::Peer(
    const grpc::ServerContext& context) const {
  if (peers_ == nullptr) return std::nullopt;
  return peers_->Find(context.peer());
}

absl::StatusOr<std::optional<absl::string_view>> BearerToken(
    const grpc::ServerContext& context) {
  const auto& metadata = context.client_metadata();
  auto [first, last] = metadata.equal_range("authorization");
  if (first == last) return std::optional<absl::string_view>();
  if (std::next(first) != last) {
    return absl::UnauthenticatedError(
        "more than one 'authorization' metadata entry");
  }
  absl::string_view value(first->second.data(), first->second.size());
  constexpr absl::string_view kScheme = "bearer ";
  if (value.size() <= kScheme.size() ||
      !absl::EqualsIgnoreCase(value.substr(0, kScheme.size()), kScheme)) {
    return absl::UnauthenticatedError(
        "'authorization' metadata: expected 'Bearer TOKEN'");
  }
  return std::optional<absl::string_view>(
      absl::StripLeadingAsciiWhitespace(value.substr(kScheme.size())));
}

absl::StatusOr<Caller> Authorizer::Authenticate(
    const grpc::ServerContext& context) const {
  MHC_ASSIGN_OR_RETURN(std::optional<absl::string_view> bearer,
                       BearerToken(context));
  return policy_->Authenticate(bearer, Peer(context));
}

absl::Status Authorizer::Authorize(const grpc::ServerContext& context,
                                   absl::string_view rpc) const {
  MHC_ASSIGN_OR_RETURN(std::optional<Caller> caller,
                       IdentifyCaller(context, rpc));
  return Check(caller, rpc);
}

absl::StatusOr<std::optional<Caller>> Authorizer::IdentifyCaller(
    const grpc::ServerContext& context, absl::string_view rpc) const {
  if (policy_ == nullptr) return std::optional<Caller>();
  absl::StatusOr<Caller> caller = Authenticate(context);
  if (!caller.ok()) {
    return absl::UnauthenticatedError(
        absl::StrCat(rpc, ": ", caller.status().message()));
  }
  return std::optional<Caller>(*std::move(caller));
}

absl::Status Authorizer::Check(const std::optional<Caller>& caller,
                               absl::string_view rpc) const {
  if (policy_ == nullptr) return absl::OkStatus();
  const std::string method = absl::StrCat(kMhcServicePrefix, rpc);
  MHC_ASSIGN_OR_RETURN(Role needed, RequiredRole(method));
  if (!caller.has_value() || caller->role < needed) {
    return absl::PermissionDeniedError(absl::StrCat(
        rpc, " needs the ", RoleName(needed), " role; ",
        caller.has_value() ? caller->name : std::string("the caller"), " has ",
        RoleName(caller.has_value() ? caller->role : Role::kNone)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Authorizer::Identify(
    const grpc::ServerContext& context) const {
  if (policy_ != nullptr) {
    MHC_ASSIGN_OR_RETURN(Caller caller, Authenticate(context));
    return caller.identity;
  }
  // Without authentication a token proves nothing: only the kernel's word
  // on the unix-socket user counts.
  const std::optional<PeerCredentials> peer = Peer(context);
  return peer.has_value() ? absl::StrCat("uid:", peer->uid) : std::string();
}

}  // namespace mhc::server
