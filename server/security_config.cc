#include "server/security_config.h"

#include <arpa/inet.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "mhc/status.h"

namespace mhc::server {
namespace {

absl::StatusOr<std::string> ReadPem(absl::string_view flag,
                                    const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream text;
  text << file.rdbuf();
  if (!file) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": cannot read ", path));
  }
  if (!absl::StrContains(text.str(), "-----BEGIN ")) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": ", path, " holds no PEM block"));
  }
  return text.str();
}

}  // namespace

bool IsLoopbackHost(absl::string_view host) {
  if (absl::EqualsIgnoreCase(host, "localhost")) return true;
  absl::ConsumePrefix(&host, "[");
  absl::ConsumeSuffix(&host, "]");
  const std::string text(host);
  in_addr v4 = {};
  if (inet_pton(AF_INET, text.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6 = {};
  if (inet_pton(AF_INET6, text.c_str(), &v6) == 1) {
    return IN6_IS_ADDR_LOOPBACK(&v6) ||
           (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
  }
  return false;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpCredentials(
    const SecurityConfig& config) {
  if (config.tls_cert.empty() != config.tls_key.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert and --tls_key: give both (certificate chain and its "
        "private key) or neither");
  }
  if (!config.tls()) {
    if (!config.tls_client_ca.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca: needs --tls_cert and --tls_key (client "
          "certificates are checked only on TLS listeners)");
    }
    return grpc::InsecureServerCredentials();
  }
  MHC_ASSIGN_OR_RETURN(std::string cert, ReadPem("tls_cert", config.tls_cert));
  MHC_ASSIGN_OR_RETURN(std::string key, ReadPem("tls_key", config.tls_key));
  grpc::SslServerCredentialsOptions options(
      config.tls_client_ca.empty()
          ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
          : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  if (!config.tls_client_ca.empty()) {
    MHC_ASSIGN_OR_RETURN(options.pem_root_certs,
                         ReadPem("tls_client_ca", config.tls_client_ca));
  }
  options.pem_key_cert_pairs.push_back({std::move(key), std::move(cert)});
  return grpc::SslServerCredentials(options);
}

absl::Status CheckTcpListener(const SecurityConfig& config,
                              absl::string_view address,
                              absl::string_view host) {
  if (config.tls() || config.allow_insecure_remote || IsLoopbackHost(host)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--listen: ", address,
      " is reachable from other machines but has no TLS; give --tls_cert and "
      "--tls_key, listen on loopback, or pass --allow_insecure_remote"));
}

absl::StatusOr<std::unique_ptr<AuthPolicy>> MakeAuthPolicy(
    const SecurityConfig& config) {
  if (!config.authentication()) return nullptr;
  std::vector<AuthPolicy::Token> tokens;
  if (!config.auth_tokens_file.empty()) {
    MHC_ASSIGN_OR_RETURN(tokens,
                         AuthPolicy::ReadTokensFile(config.auth_tokens_file));
  }
  std::map<uid_t, Role> uid_roles;
  if (config.unix_peer_roles.has_value()) {
    uid_roles = *config.unix_peer_roles;
  } else {
    uid_roles = {{0, Role::kAdmin}, {getuid(), Role::kAdmin}};
  }
  return std::make_unique<AuthPolicy>(std::move(tokens), std::move(uid_roles));
}

}  // namespace mhc::server
