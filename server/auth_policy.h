// Who may call what: roles, the bearer tokens that grant them (--auth_tokens)
// and the unix-socket users that hold them (--unix_peer_roles).
//
// Tokens file: one "TOKEN ROLE [NAME]" per line, separated by spaces or
// tabs; blank lines and lines starting with '#' are ignored. A token is 16
// to 512 printable characters without spaces; NAME (default "token<LINE>")
// names the caller in messages and logs. The file must not be accessible to
// other users (no "other" mode bits).
#ifndef MHC_SERVER_AUTH_POLICY_H_
#define MHC_SERVER_AUTH_POLICY_H_

#include <sys/types.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/peer_credentials.h"

namespace mhc::server {

// Ordered: each role may do everything the ones before it may.
enum class Role { kNone = 0, kRead = 1, kCompute = 2, kAdmin = 3 };

absl::StatusOr<Role> ParseRole(absl::string_view name);  // read|compute|admin
const char* RoleName(Role role);

// Equality whose time depends only on the lengths, never on where the
// strings differ.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

// A caller as authenticated: its role and how it was recognised.
struct Caller {
  Role role = Role::kNone;
  std::string name;  // "token 'ci'", "uid 1000", ...
  // The same for every call of this caller and different for any other:
  // "token:INDEX" (token names may repeat), "uid:UID".
  std::string identity;
};

class AuthPolicy {
 public:
  struct Token {
    std::string secret;
    Role role = Role::kNone;
    std::string name;
  };

  // Parses the tokens file text (see above); errors name the line.
  static absl::StatusOr<std::vector<Token>> ParseTokens(absl::string_view text);
  // Reads --auth_tokens, refusing a file other users can access.
  static absl::StatusOr<std::vector<Token>> ReadTokensFile(
      const std::string& path);
  // "uid:role,uid:role" (--unix_peer_roles).
  static absl::StatusOr<std::map<uid_t, Role>> ParseUidRoles(
      absl::string_view text);

  AuthPolicy(std::vector<Token> tokens, std::map<uid_t, Role> uid_roles);

  // The caller of a request that carried `bearer` (the credentials of an
  // "authorization: Bearer ..." header; nullopt when absent) over a
  // connection whose peer is `peer` (nullopt unless a unix socket). A
  // token, when given, decides alone. UNAUTHENTICATED when nothing
  // identifies the caller.
  absl::StatusOr<Caller> Authenticate(
      std::optional<absl::string_view> bearer,
      const std::optional<PeerCredentials>& peer) const;

 private:
  const std::vector<Token> tokens_;
  const std::map<uid_t, Role> uid_roles_;
};

}  // namespace mhc::server

#endif  // MHC_SERVER_AUTH_POLICY_H_
