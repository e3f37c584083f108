#include "server/auth_policy.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "mhc/status.h"

namespace mhc::server {
namespace {

constexpr size_t kMinTokenChars = 16;
constexpr size_t kMaxTokenChars = 512;
constexpr size_t kMaxTokensFileBytes = size_t{1} << 20;

bool ValidToken(absl::string_view token) {
  if (token.size() < kMinTokenChars || token.size() > kMaxTokenChars) {
    return false;
  }
  for (char c : token) {
    if (!absl::ascii_isgraph(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<Role> ParseRole(absl::string_view name) {
  if (name == "read") return Role::kRead;
  if (name == "compute") return Role::kCompute;
  if (name == "admin") return Role::kAdmin;
  return absl::InvalidArgumentError(absl::StrCat(
      "expected a role (read, compute or admin), got '", name, "'"));
}

const char* RoleName(Role role) {
  switch (role) {
    case Role::kNone:
      return "none";
    case Role::kRead:
      return "read";
    case Role::kCompute:
      return "compute";
    case Role::kAdmin:
      return "admin";
  }
  return "none";
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // Every byte of `b` is visited whatever `a` holds.
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < b.size(); ++i) {
    const unsigned char from_a =
        i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    diff |=
        static_cast<unsigned char>(from_a ^ static_cast<unsigned char>(b[i]));
  }
  return diff == 0;
}

absl::StatusOr<std::vector<AuthPolicy::Token>> AuthPolicy::ParseTokens(
    absl::string_view text) {
  std::vector<Token> tokens;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    const std::string where = absl::StrCat("line ", line_number, ": ");
    if (fields.size() < 2 || fields.size() > 3) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "expected 'TOKEN ROLE [NAME]'"));
    }
    if (!ValidToken(fields[0])) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "a token is ", kMinTokenChars, "..",
                       kMaxTokenChars, " printable characters without spaces"));
    }
    absl::StatusOr<Role> role = ParseRole(fields[1]);
    if (!role.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, role.status().message()));
    }
    for (const Token& seen : tokens) {
      if (seen.secret == fields[0]) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, "token repeated (also '", seen.name, "')"));
      }
    }
    tokens.push_back(Token{std::string(fields[0]), *role,
                           fields.size() == 3
                               ? std::string(fields[2])
                               : absl::StrCat("token", line_number)});
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(
        "no tokens (expected 'TOKEN ROLE [NAME]' "
        "lines)");
  }
  return tokens;
}

absl::StatusOr<std::vector<AuthPolicy::Token>> AuthPolicy::ReadTokensFile(
    const std::string& path) {
  const std::string flag = absl::StrCat("--auth_tokens: ", path, ": ");
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat(flag, std::strerror(errno)));
  }
  // Mode and contents come from the same open file.
  struct stat st = {};
  std::string text;
  absl::Status status = absl::OkStatus();
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    status = absl::InvalidArgumentError(absl::StrCat(flag, "not a file"));
  } else if ((st.st_mode & S_IRWXO) != 0) {
    status = absl::PermissionDeniedError(absl::StrCat(
        flag, "other users may access it (mode ",
        absl::StrFormat("%03o", st.st_mode & 0777), "); chmod o-rwx it"));
  } else if (static_cast<uint64_t>(st.st_size) > kMaxTokensFileBytes) {
    status = absl::InvalidArgumentError(
        absl::StrCat(flag, "larger than ", kMaxTokensFileBytes, " bytes"));
  } else {
    char buffer[4096];
    ssize_t got;
    while ((got = read(fd, buffer, sizeof(buffer))) > 0) {
      text.append(buffer, static_cast<size_t>(got));
    }
    if (got < 0) {
      status =
          absl::InvalidArgumentError(absl::StrCat(flag, std::strerror(errno)));
    }
  }
  close(fd);
  MHC_RETURN_IF_ERROR(status);
  absl::StatusOr<std::vector<Token>> tokens = ParseTokens(text);
  if (!tokens.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, tokens.status().message()));
  }
  return tokens;
}

absl::StatusOr<std::map<uid_t, Role>> AuthPolicy::ParseUidRoles(
    absl::string_view text) {
  std::map<uid_t, Role> roles;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    item = absl::StripAsciiWhitespace(item);
    const size_t colon = item.find(':');
    uint32_t uid = 0;
    if (colon == absl::string_view::npos ||
        !absl::SimpleAtoi(item.substr(0, colon), &uid)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--unix_peer_roles: expected uid:role, got '", item, "'"));
    }
    absl::StatusOr<Role> role = ParseRole(item.substr(colon + 1));
    if (!role.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--unix_peer_roles: ", role.status().message()));
    }
    if (!roles.emplace(static_cast<uid_t>(uid), *role).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--unix_peer_roles: uid ", uid, " listed twice"));
    }
  }
  return roles;
}

AuthPolicy::AuthPolicy(std::vector<Token> tokens,
                       std::map<uid_t, Role> uid_roles)
    : tokens_(std::move(tokens)), uid_roles_(std::move(uid_roles)) {}

absl::StatusOr<Caller> AuthPolicy::Authenticate(
    std::optional<absl::string_view> bearer,
    const std::optional<PeerCredentials>& peer) const {
  if (bearer.has_value()) {
    // Every token is compared, so the time says nothing about which one
    // (or whether any) matched.
    const Token* match = nullptr;
    for (const Token& token : tokens_) {
      if (ConstantTimeEquals(*bearer, token.secret)) match = &token;
    }
    if (match == nullptr) {
      return absl::UnauthenticatedError("the bearer token is not valid");
    }
    return Caller{match->role, absl::StrCat("token '", match->name, "'"),
                  absl::StrCat("token:", match - tokens_.data())};
  }
  if (peer.has_value()) {
    auto it = uid_roles_.find(peer->uid);
    if (it != uid_roles_.end()) {
      return Caller{it->second, absl::StrCat("uid ", peer->uid),
                    absl::StrCat("uid:", peer->uid)};
    }
    return absl::UnauthenticatedError(absl::StrCat(
        "unix-socket peer uid ", peer->uid,
        " has no role (--unix_peer_roles) and sent no bearer token"));
  }
  return absl::UnauthenticatedError(
      "no credentials: send 'authorization: Bearer TOKEN' metadata");
}

}  // namespace mhc::server
