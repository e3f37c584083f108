// Command-line flags of mhcd and their translation into a server config.
#ifndef MHC_SERVER_FLAGS_H_
#define MHC_SERVER_FLAGS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "mhc/backend.h"
#include "server/server.h"

namespace mhc::server {

// Makes `--help` list mhcd's flags, sets the usage text and version.
void ConfigureFlagUsage();
// --help (-h, --helpshort, --helpfull): the usage and mhcd's flags on
// stdout; --version: "mhcd VERSION". Returns whether it printed either, so
// that main exits 0 (absl's own --help exits 1).
bool HandleHelpOrVersion(int argc, char** argv);
// --log_format: sets the format of every later log line.
absl::Status ConfigureLoggingFromFlags();

// The config the flags describe; errors name the flag.
absl::StatusOr<ServerConfig> ConfigFromFlags();
// The TLS, unix socket and authentication flags (security_flags.cc).
absl::StatusOr<SecurityConfig> SecurityConfigFromFlags();
absl::Duration DrainTimeoutFromFlags();
// The devices to serve: --backend (auto: CUDA when built and a GPU is
// present, else cpu) with --threads for cpu and --devices for cuda.
absl::StatusOr<std::vector<DeviceBackend>> BackendsFromFlags();
// Warnings about accepted flags that do not act yet.
std::vector<std::string> FlagNotices();

// --fault_injection, test only (fault_injection_flags.cc). The check runs
// with the backends: INVALID_ARGUMENT when malformed or when a device is
// not a CUDA one. Armed once the daemon is ready, so that only the work of
// requests counts.
absl::Status CheckFaultInjectionFlag(const std::vector<DeviceBackend>& devices);
void ArmFaultInjectionFromFlags();
// The startup warning while it is set; empty otherwise.
std::string FaultInjectionNotice();

}  // namespace mhc::server

#endif  // MHC_SERVER_FLAGS_H_
