// mhcctl commands and the flags they share (defined in main.cc).
#ifndef MHC_CLIENT_MHCCTL_COMMANDS_H_
#define MHC_CLIENT_MHCCTL_COMMANDS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "mhc/client/client.h"

ABSL_DECLARE_FLAG(std::string, address);
ABSL_DECLARE_FLAG(bool, json);
ABSL_DECLARE_FLAG(std::string, name);
ABSL_DECLARE_FLAG(std::string, preset);
ABSL_DECLARE_FLAG(int32_t, n);
ABSL_DECLARE_FLAG(int64_t, hidden);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(std::string, kind);
ABSL_DECLARE_FLAG(std::string, layout);
ABSL_DECLARE_FLAG(std::string, orientation);
ABSL_DECLARE_FLAG(std::string, sinkhorn_mode);
ABSL_DECLARE_FLAG(std::string, sinkhorn_iterations);
ABSL_DECLARE_FLAG(std::string, eps_sk);
ABSL_DECLARE_FLAG(std::string, eps_rms);
ABSL_DECLARE_FLAG(std::string, eps_placement);
ABSL_DECLARE_FLAG(std::string, eps_pre);
ABSL_DECLARE_FLAG(std::string, post_mult);
ABSL_DECLARE_FLAG(std::string, dynamic);
ABSL_DECLARE_FLAG(bool, has_gamma);
ABSL_DECLARE_FLAG(bool, has_post_bias);
ABSL_DECLARE_FLAG(std::string, matmul_precision);
ABSL_DECLARE_FLAG(int64_t, tokens);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(int32_t, iterations);
ABSL_DECLARE_FLAG(std::string, layer);
ABSL_DECLARE_FLAG(std::string, f);
ABSL_DECLARE_FLAG(uint64_t, data_seed);
ABSL_DECLARE_FLAG(bool, shm);
ABSL_DECLARE_FLAG(std::string, optimizer);
ABSL_DECLARE_FLAG(float, learning_rate);

namespace mhc::mhcctl {

// TLS and bearer token from --tls* and --token_file (connect_flags.cc).
absl::StatusOr<client::ClientOptions> ConnectOptionsFromFlags();

// Exit codes: 0 success, 1 an RPC or a check failed, 2 bad usage.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// A CreateLayerRequest from --name, --preset, --n, --hidden, --seed,
// --device and the spec override flags (empty string flags keep the
// preset's value).
absl::StatusOr<v1::CreateLayerRequest> CreateRequestFromFlags(
    const std::string& name, int64_t default_hidden);

int RunInfo(client::Client& client);
int RunHealth(client::Client& client);
int RunLayer(client::Client& client, const std::vector<std::string>& args);
int RunRun(client::Client& client);
int RunCheckpoint(client::Client& client, const std::vector<std::string>& args);

}  // namespace mhc::mhcctl

#endif  // MHC_CLIENT_MHCCTL_COMMANDS_H_
