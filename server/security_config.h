// How mhcd protects its listeners and who may call it (docs/security.md):
// TLS on TCP listeners, the unix sockets' mode and group, and the callers'
// roles. The defaults keep the daemon as it was: loopback TCP and unix
// sockets, no TLS, no authentication.
#ifndef MHC_SERVER_SECURITY_CONFIG_H_
#define MHC_SERVER_SECURITY_CONFIG_H_

#include <sys/types.h>

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/server_credentials.h"
#include "server/auth_policy.h"
#include "server/unix_listener.h"

namespace mhc::server {

struct SecurityConfig {
  // PEM files; TLS on every TCP listener when cert and key are set, client
  // certificates signed by client_ca required when it is set too.
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  // Serve plaintext TCP on addresses other than loopback.
  bool allow_insecure_remote = false;
  // Tokens file (auth_policy.h); empty: none.
  std::string auth_tokens_file;
  // Roles of unix-socket users; unset: when authentication is on, the
  // daemon's own user and root are admins.
  std::optional<std::map<uid_t, Role>> unix_peer_roles;
  UnixSocketOptions unix_socket;

  bool tls() const { return !tls_cert.empty(); }
  // Callers must authenticate: a tokens file or unix peer roles are given.
  bool authentication() const {
    return !auth_tokens_file.empty() || unix_peer_roles.has_value();
  }
};

// Whether a listen host ("127.0.0.1", "localhost", "[::1]") is loopback.
bool IsLoopbackHost(absl::string_view host);

// Credentials of the TCP listeners: TLS (mutual when a client CA is given)
// or plaintext. Errors name the flag.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpCredentials(
    const SecurityConfig& config);

// Refuses a plaintext TCP listener on `host` unless it is loopback or the
// operator allowed it.
absl::Status CheckTcpListener(const SecurityConfig& config,
                              absl::string_view address,
                              absl::string_view host);

// The policy callers are held to; null when authentication is off.
absl::StatusOr<std::unique_ptr<AuthPolicy>> MakeAuthPolicy(
    const SecurityConfig& config);

}  // namespace mhc::server

#endif  // MHC_SERVER_SECURITY_CONFIG_H_
