// mhcctl's TLS and bearer-token flags (docs/security.md).
#include <cstdlib>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "commands.h"

ABSL_FLAG(bool, tls, false,
          "connect with TLS (TCP addresses); implied by the other --tls_* "
          "flags");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM file of the CA that signed the daemon's certificate (default: "
          "the system's roots)");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM file of this client's certificate chain (mutual TLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM file of --tls_cert's private key");
ABSL_FLAG(std::string, tls_server_name, "",
          "name the daemon's certificate must carry when it is not the "
          "address's host");
ABSL_FLAG(std::string, token_file, "",
          "file holding the bearer token to send (kept off the command line, "
          "where other users could read it); $MHC_TOKEN_FILE when unset");

namespace mhc::mhcctl {
namespace {

absl::Status ReadInto(const std::string& flag, const std::string& path,
                      std::string* out) {
  if (path.empty()) return absl::OkStatus();
  absl::StatusOr<std::string> text = client::ReadClientFile(path);
  if (!text.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": ", text.status().message()));
  }
  *out = *std::move(text);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<client::ClientOptions> ConnectOptionsFromFlags() {
  client::ClientOptions options;
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  absl::Status status =
      ReadInto("tls_ca", absl::GetFlag(FLAGS_tls_ca), &options.tls_root_ca_pem);
  if (status.ok()) {
    status = ReadInto("tls_cert", absl::GetFlag(FLAGS_tls_cert),
                      &options.tls_client_cert_pem);
  }
  if (status.ok()) {
    status = ReadInto("tls_key", absl::GetFlag(FLAGS_tls_key),
                      &options.tls_client_key_pem);
  }
  std::string token_file = absl::GetFlag(FLAGS_token_file);
  if (token_file.empty()) {
    const char* from_env = std::getenv("MHC_TOKEN_FILE");
    if (from_env != nullptr) token_file = from_env;
  }
  if (status.ok())
    status = ReadInto("token_file", token_file, &options.bearer_token);
  if (!status.ok()) return status;
  // A token file usually ends with a newline, which is not part of it.
  options.bearer_token =
      std::string(absl::StripAsciiWhitespace(options.bearer_token));
  if (!token_file.empty() && options.bearer_token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--token_file: ", token_file, " is empty"));
  }
  options.tls = absl::GetFlag(FLAGS_tls) || !options.tls_root_ca_pem.empty() ||
                !options.tls_client_cert_pem.empty() ||
                !options.tls_client_key_pem.empty() ||
                !options.tls_server_name.empty();
  return options;
}

}  // namespace mhc::mhcctl
