// mhcd's flags for TLS, unix socket permissions and authentication
// (docs/security.md).
#include <cstdint>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "mhc/status.h"
#include "server/flags.h"

ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain of the TCP listeners; with --tls_key they "
          "serve TLS only. Unix sockets are unaffected.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA certificates; TCP clients must present a certificate "
          "signed by one of them (mutual TLS). Needs --tls_cert.");
ABSL_FLAG(bool, allow_insecure_remote, false,
          "Allow plaintext TCP listeners on addresses other than loopback "
          "(by default they need TLS).");
ABSL_FLAG(std::string, auth_tokens, "",
          "File of bearer tokens, one 'TOKEN ROLE [NAME]' per line (roles: "
          "read, compute, admin); turns authentication on. The file must "
          "not be accessible to other users.");
ABSL_FLAG(std::string, unix_peer_roles, "",
          "Roles of unix-socket users without a token, as uid:role,... "
          "(e.g. 1000:compute,0:admin); turns authentication on. Unset with "
          "authentication on: the daemon's own uid and root are admins.");
ABSL_FLAG(std::string, unix_socket_mode, "0660",
          "Mode (octal) of the unix socket files; connecting needs write "
          "permission.");
ABSL_FLAG(std::string, unix_socket_group, "",
          "Group (name or gid) of the unix socket files; empty: the "
          "daemon's.");

namespace mhc::server {

absl::StatusOr<SecurityConfig> SecurityConfigFromFlags() {
  SecurityConfig config;
  config.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  config.tls_key = absl::GetFlag(FLAGS_tls_key);
  config.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  config.allow_insecure_remote = absl::GetFlag(FLAGS_allow_insecure_remote);
  config.auth_tokens_file = absl::GetFlag(FLAGS_auth_tokens);
  const std::string peer_roles = absl::GetFlag(FLAGS_unix_peer_roles);
  if (!peer_roles.empty()) {
    MHC_ASSIGN_OR_RETURN(config.unix_peer_roles,
                         AuthPolicy::ParseUidRoles(peer_roles));
  }
  const std::string mode = absl::GetFlag(FLAGS_unix_socket_mode);
  uint32_t bits = 0;
  bool valid = !mode.empty() && mode.size() <= 4;
  for (char c : mode) {
    valid = valid && c >= '0' && c <= '7';
    bits = bits * 8 + static_cast<uint32_t>(c - '0');
  }
  if (!valid || bits > 0777) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--unix_socket_mode: expected octal permission bits such as 0660, "
        "got '",
        mode, "'"));
  }
  config.unix_socket.mode = static_cast<mode_t>(bits);
  const std::string group = absl::GetFlag(FLAGS_unix_socket_group);
  if (!group.empty()) {
    MHC_ASSIGN_OR_RETURN(config.unix_socket.group, ResolveGroup(group));
  }
  return config;
}

}  // namespace mhc::server
