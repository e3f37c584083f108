// Runs the real mhcd binary for a test: a fresh temp dir, a unix socket in
// it, a free metrics port, and stdout parsed for the listen / metrics /
// ready lines. The process is killed (SIGKILL) if a test leaves it running.
#ifndef MHC_TESTS_SERVER_DAEMON_H_
#define MHC_TESTS_SERVER_DAEMON_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mhc/client/client.h"

namespace mhc::testing {

class Daemon {
 public:
  // Starts mhcd (the build's, or $MHCD_PATH) with
  // --listen=unix:<tmp>/mhcd.sock --metrics_listen=127.0.0.1:0
  // --backend=cpu plus `flags` (later flags win) and waits up to 30 s for
  // its ready line (text or --log_format=json). With `capture_stderr`,
  // Stdout() holds stderr too.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(
      const std::vector<std::string>& flags = {}, bool capture_stderr = false);
  ~Daemon();

  const std::string& address() const { return address_; }  // unix:/...
  const std::string& metrics_host() const { return metrics_host_; }
  int metrics_port() const { return metrics_port_; }
  pid_t pid() const { return pid_; }

  absl::StatusOr<std::unique_ptr<client::Client>> Connect(
      absl::Duration timeout = absl::Seconds(60)) const;

  void Signal(int signal) const;
  // Waits for the process to exit; returns its exit code, or 128 + signal.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  // Everything the daemon printed on stdout so far.
  std::string Stdout() const;

 private:
  Daemon() = default;
  void ReadLoop(int fd);

  std::string dir_;
  std::string address_;
  std::string metrics_host_;
  int metrics_port_ = 0;
  pid_t pid_ = -1;
  bool exited_ = false;
  std::thread reader_;
  mutable absl::Mutex mu_;
  std::string stdout_ ABSL_GUARDED_BY(mu_);
  bool eof_ ABSL_GUARDED_BY(mu_) = false;
};

// GET http://host:port/path over a plain socket; the whole response.
// DEADLINE_EXCEEDED when connecting or any read waits longer than
// `timeout`.
absl::StatusOr<std::string> HttpGet(
    const std::string& host, int port, const std::string& path,
    absl::Duration timeout = absl::InfiniteDuration());

// Runs a command line, returns (exit code, stdout).
absl::StatusOr<std::pair<int, std::string>> RunCommand(
    const std::vector<std::string>& argv);

// A client process (shm_peer `hold`) that opened a session and registered a
// region in it, then waits: it exits when `stdin_fd` is closed.
struct HoldingPeer {
  pid_t pid = -1;
  int stdin_fd = -1;
  std::string session_id;
  std::string shm_key;  // the region's object, without the leading '/'
};

// Starts `peer_binary hold ADDRESS` and reads its "held SESSION KEY" line.
absl::StatusOr<HoldingPeer> StartHoldingPeer(const std::string& peer_binary,
                                             const std::string& address);

}  // namespace mhc::testing

#endif  // MHC_TESTS_SERVER_DAEMON_H_
