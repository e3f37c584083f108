// mhcd: starts the server, prints where it listens, and drains it on
// SIGTERM/SIGINT.
#include <pthread.h>
#include <signal.h>

#include <iostream>
#include <thread>

#include "absl/flags/parse.h"
#include "server/flags.h"
#include "server/server.h"

namespace {

int Fail(const absl::Status& status) {
  std::cerr << "mhcd: " << status.message() << std::endl;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  mhc::server::ConfigureFlagUsage();
  absl::ParseCommandLine(argc, argv);

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
  for (const std::string& notice : mhc::server::FlagNotices()) {
    std::cerr << notice << std::endl;
  }
  absl::StatusOr<std::vector<mhc::server::DeviceBackend>> devices =
      mhc::server::BackendsFromFlags();
  if (!devices.ok()) return Fail(devices.status());
  absl::StatusOr<std::unique_ptr<mhc::server::MhcServer>> server =
      mhc::server::MhcServer::Start(*config, std::move(*devices));
  if (!server.ok()) return Fail(server.status());

  for (const std::string& address : (*server)->addresses()) {
    std::cout << "mhcd: listening on " << address << "\n";
  }
  if (!(*server)->metrics_address().empty()) {
    std::cout << "mhcd: metrics on http://" << (*server)->metrics_address()
              << "/metrics\n";
  }
  if (!(*server)->restored_checkpoint().empty()) {
    std::cout << "mhcd: restored checkpoint '"
              << (*server)->restored_checkpoint() << "'\n";
  }
  std::cout << "mhcd: ready (backend=" << (*server)->backend_name() << ")"
            << std::endl;

  const absl::Duration drain_timeout = mhc::server::DrainTimeoutFromFlags();
  mhc::server::MhcServer* raw = server->get();
  std::thread signal_thread([&signals, raw, drain_timeout] {
    int signal_number = 0;
    sigwait(&signals, &signal_number);
    std::cerr << "mhcd: received signal " << signal_number << ", draining"
              << std::endl;
    raw->Drain(drain_timeout);
  });
  (*server)->Wait();
  signal_thread.join();
  server->reset();
  std::cout << "mhcd: drained" << std::endl;
  return 0;
}
