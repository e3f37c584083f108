// mhcd: starts the server, prints where it listens, and drains it on
// SIGTERM/SIGINT, or when a device fails for good (then exits 3).
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <thread>

#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/flags.h"
#include "server/log.h"
#include "server/server.h"

namespace {

using mhc::server::Log;
using mhc::server::LogLevel;

// How far past --drain_timeout a drain may run before the process exits
// regardless: the tail of the last kernels and the teardown.
constexpr absl::Duration kExitSlack = absl::Milliseconds(900);

// The exit status after a device failed for good (docs/operations.md).
constexpr int kExitDeviceFailed = 3;

// Set when a device failed for good; the drain that follows ends the
// process with kExitDeviceFailed.
std::atomic<bool> device_failed{false};

int Fail(const absl::Status& status) {
  Log(LogLevel::kError, status.message());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  mhc::server::ConfigureFlagUsage();
  if (mhc::server::HandleHelpOrVersion(argc, argv)) return 0;
  absl::ParseCommandLine(argc, argv);
  if (absl::Status logging = mhc::server::ConfigureLoggingFromFlags();
      !logging.ok()) {
    return Fail(logging);
  }

  // Blocked before any thread exists (backends and gRPC start pools), so
  // every thread inherits the mask and only the sigwait thread sees them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<mhc::server::ServerConfig> config =
      mhc::server::ConfigFromFlags();
  if (!config.ok()) return Fail(config.status());
  // The drain runs as for SIGTERM, on the signal thread.
  config->on_device_failure = [] {
    device_failed.store(true);
    kill(getpid(), SIGTERM);
  };
  for (const std::string& notice : mhc::server::FlagNotices()) {
    Log(LogLevel::kWarning, notice);
  }
  absl::StatusOr<std::vector<mhc::server::DeviceBackend>> devices =
      mhc::server::BackendsFromFlags();
  if (!devices.ok()) return Fail(devices.status());
  absl::StatusOr<std::unique_ptr<mhc::server::MhcServer>> server =
      mhc::server::MhcServer::Start(*config, std::move(*devices));
  if (!server.ok()) return Fail(server.status());

  // Scripts and tests read these lines: keep their text.
  for (const std::string& address : (*server)->addresses()) {
    Log(LogLevel::kInfo, absl::StrCat("listening on ", address));
  }
  if (!(*server)->metrics_address().empty()) {
    Log(LogLevel::kInfo,
        absl::StrCat("metrics on http://", (*server)->metrics_address(),
                     "/metrics"));
  }
  if (!(*server)->restored_checkpoint().empty()) {
    Log(LogLevel::kInfo, absl::StrCat("restored checkpoint '",
                                      (*server)->restored_checkpoint(), "'"));
  }
  mhc::server::ArmFaultInjectionFromFlags();
  Log(LogLevel::kInfo,
      absl::StrCat("ready (backend=", (*server)->backend_name(), ")"));

  const absl::Duration drain_timeout = mhc::server::DrainTimeoutFromFlags();
  mhc::server::MhcServer* raw = server->get();
  std::thread signal_thread([&signals, raw, drain_timeout] {
    int signal_number = 0;
    sigwait(&signals, &signal_number);
    if (device_failed.load()) {
      Log(LogLevel::kError,
          absl::StrCat("a device failed for good; draining, then exiting "
                       "with status ",
                       kExitDeviceFailed, " to be restarted"));
    } else {
      Log(LogLevel::kInfo,
          absl::StrCat("received signal ", signal_number, ", draining"));
    }
    // The drain ends every call it can; a handler stuck in a kernel cannot
    // be interrupted, so it does not get to hold the exit past the promise
    // of --drain_timeout (the orchestrator would kill the process anyway).
    std::thread([drain_timeout] {
      absl::SleepFor(drain_timeout + kExitSlack);
      Log(LogLevel::kError,
          "drain: still running past --drain_timeout; exiting without "
          "waiting for the requests left");
      std::_Exit(1);
    }).detach();
    raw->Drain(drain_timeout);
  });
  (*server)->Wait();
  signal_thread.join();
  server->reset();
  Log(LogLevel::kInfo, "drained");
  return device_failed.load() ? kExitDeviceFailed : 0;
}
