// The daemon as an object: backend, device executor, layers, the gRPC
// server with health and reflection, and the metrics endpoint. main() only
// parses flags, starts it and waits for a signal to drain it.
#ifndef MHC_SERVER_SERVER_H_
#define MHC_SERVER_SERVER_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "mhc/backend.h"
#include "server/admission.h"
#include "server/checkpoint_store.h"
#include "server/determinism_audit.h"
#include "server/executor.h"
#include "server/groups.h"
#include "server/layer_store.h"
#include "server/metrics.h"
#include "server/rpc_observer.h"
#include "server/security_config.h"
#include "server/service.h"
#include "server/shm/shm_registry.h"
#include "server/unix_listener.h"

namespace mhc::server {

struct ServerConfig {
  // "host:port" (port 0 picks a free port) or "unix:/path".
  std::vector<std::string> listen;
  // "host:port"; empty: no metrics endpoint.
  std::string metrics_listen;
  // Fractions of kernel launches the determinism audit re-runs whole
  // (replay) and one token alone (batch invariance); 0 disables each.
  double determinism_audit_rate = 0;
  double batch_invariance_audit_rate = 0;
  // Data-parallel groups on CUDA devices: the NCCL library to load and the
  // timeout of requests that give none.
  std::string nccl_library = "libnccl.so.2";
  absl::Duration group_timeout = absl::Seconds(120);
  ServiceOptions service;
  CheckpointOptions checkpoints;
  // Which RPCs get an access log line (see rpc_observer.h).
  RequestLogMode log_requests = RequestLogMode::kFailed;
  // TLS, unix socket permissions and authentication (security_config.h).
  SecurityConfig security;
  // Called once, after health went NOT_SERVING, when a device fails for
  // good (its CUDA context is lost): mhcd's main drains and exits non-zero,
  // since only a new process gets a new context. Unset: the daemon stays up,
  // NOT_SERVING.
  std::function<void()> on_device_failure;
};

// A backend and the name the API gives its device.
struct DeviceBackend {
  std::string device;  // "cpu", "cuda:0", ...
  std::unique_ptr<Backend> backend;
  int cuda_index = -1;  // CUDA device ordinal, -1 for host backends
};

class MhcServer {
 public:
  // `devices`: at least one; layers go to the first unless a request names
  // another. Each device gets its own executor.
  static absl::StatusOr<std::unique_ptr<MhcServer>> Start(
      const ServerConfig& config, std::vector<DeviceBackend> devices);
  ~MhcServer();

  // The listeners as bound: real ports in place of 0.
  const std::vector<std::string>& addresses() const { return addresses_; }
  // "host:port" of the metrics endpoint, empty when disabled.
  const std::string& metrics_address() const { return metrics_address_; }
  std::string backend_name() const { return executors_.front()->BackendName(); }
  // The checkpoint --restore loaded at start; empty when none.
  const std::string& restored_checkpoint() const { return restored_; }

  // Health goes NOT_SERVING (and /readyz 503), new requests get
  // UNAVAILABLE, sessions and ExecuteStreams are ended; admitted unary
  // requests get until `timeout` to finish (past it, those still queued for
  // a device are refused), then every connection is cut (what is still in
  // flight ends UNAVAILABLE) and the server shuts down. Returns when the
  // server has shut down.
  void Drain(absl::Duration timeout);
  // Blocks until the server has shut down.
  void Wait();

 private:
  MhcServer() = default;
  void StopUnixListeners();

  // Destroyed bottom-up: the gRPC server first (no more handlers), the
  // layers before the executor whose memory they hold.
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<DeterminismAudit> audit_;
  std::vector<std::unique_ptr<Executor>> executors_;
  std::unique_ptr<LayerStore> store_;
  std::unique_ptr<CheckpointStore> checkpoints_;
  std::unique_ptr<GroupRegistry> groups_;
  std::unique_ptr<Admission> admission_;
  std::unique_ptr<ShmRegistry> shm_;
  std::unique_ptr<ConnectionPeers> peers_;
  std::unique_ptr<Authorizer> authorizer_;
  std::unique_ptr<MhcService> service_;
  std::unique_ptr<grpc::Server> server_;
  // Stopped before the server shuts down: they hand connections to it.
  std::vector<std::unique_ptr<UnixListener>> unix_listeners_;
  std::vector<std::string> addresses_;
  std::string metrics_address_;
  std::string restored_;
};

}  // namespace mhc::server

#endif  // MHC_SERVER_SERVER_H_
