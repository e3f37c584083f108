#include "server/server.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "grpc/grpc.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "mhc/status.h"
#include "server/log.h"

#ifdef MHC_HAVE_CUDA
#include "mhc/cuda.h"
#include "mhc/cuda_tools.h"
#include "server/nccl_transport.h"
#include "server/shm/device_memory.h"
#endif

#ifndef MHC_VERSION
#define MHC_VERSION "0.0.0"
#endif
#ifndef MHC_GIT_COMMIT
#define MHC_GIT_COMMIT "unknown"
#endif
#ifndef MHC_CUDA_VERSION
#define MHC_CUDA_VERSION "none"
#endif

namespace mhc::server {

namespace {

constexpr char kServiceName[] = "mhc.v1.Mhc";
// How far past its deadline a drain may run to let the requests running
// at the deadline answer and calling clients go quiet; and how long the
// connections it cuts get to close (only a handler still running holds one
// open, and waiting longer would not end it).
constexpr absl::Duration kDrainOverrun = absl::Milliseconds(500);
constexpr absl::Duration kConnectionsClose = absl::Milliseconds(100);
// How long no call may have been refused before the gRPC server shuts down.
constexpr absl::Duration kClientsQuiet = absl::Milliseconds(250);

struct Listener {
  std::string address;
  bool tcp = false;
  std::string host;  // tcp only
  int port = 0;      // bound port, filled by gRPC
};

absl::StatusOr<Listener> ParseListener(const std::string& address) {
  Listener listener;
  listener.address = address;
  if (absl::StartsWith(address, "unix:")) {
    if (address.size() == 5) {
      return absl::InvalidArgumentError(
          "--listen: 'unix:' needs a socket path (unix:/path)");
    }
    return listener;
  }
  size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--listen: expected host:port or unix:/path, got '", address, "'"));
  }
  listener.tcp = true;
  listener.host = address.substr(0, colon);
  return listener;
}

// Binding replaces an existing socket file, which would silently take the
// path away from a daemon still serving on it. A socket that accepts a
// connection belongs to a live server; a stale one may be reused.
absl::Status CheckUnixSocketFree(const std::string& address) {
  const std::string path = address.substr(5);
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--listen: socket path of ", address, " is longer than ",
                     sizeof(addr.sun_path) - 1, " bytes"));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  if (fd < 0) return absl::OkStatus();
  bool live =
      connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  if (live) {
    return absl::UnavailableError(
        absl::StrCat("--listen: ", address, " is in use by a running server"));
  }
  return absl::OkStatus();
}

// Groups need CUDA devices and NCCL; without them the registry refuses every
// group request with the reason.
std::unique_ptr<GroupRegistry> MakeGroups(
    const ServerConfig& config, const std::vector<Executor*>& executors,
    LayerStore* store, Metrics* metrics) {
  std::unique_ptr<GroupTransport> transport;
  std::string unavailable = "this build of mhcd has no CUDA backend";
#ifdef MHC_HAVE_CUDA
  const bool any_cuda =
      std::any_of(executors.begin(), executors.end(),
                  [](const Executor* e) { return e->cuda_ordinal() >= 0; });
  unavailable = "this daemon serves no CUDA device";
  if (any_cuda) {
    // NVLink SHARP multicast stays off unless the operator asks for it.
    setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
    absl::StatusOr<std::unique_ptr<GroupTransport>> nccl =
        LoadNcclTransport(config.nccl_library);
    if (nccl.ok()) {
      transport = *std::move(nccl);
    } else {
      unavailable = std::string(nccl.status().message());
    }
  }
#endif
  return std::make_unique<GroupRegistry>(store, executors, std::move(transport),
                                         std::move(unavailable),
                                         config.group_timeout, metrics);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MhcServer>> MhcServer::Start(
    const ServerConfig& config, std::vector<DeviceBackend> devices) {
  if (devices.empty()) {
    return absl::InvalidArgumentError("at least one device to serve");
  }
  if (config.listen.empty()) {
    return absl::InvalidArgumentError("--listen: at least one address");
  }
  std::vector<Listener> listeners;
  for (const std::string& address : config.listen) {
    MHC_ASSIGN_OR_RETURN(Listener listener, ParseListener(address));
    if (listener.tcp) {
      MHC_RETURN_IF_ERROR(
          CheckTcpListener(config.security, address, listener.host));
    } else {
      MHC_RETURN_IF_ERROR(CheckUnixSocketFree(address));
    }
    listeners.push_back(std::move(listener));
  }
  MHC_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> tcp_credentials,
                       TcpCredentials(config.security));
  MHC_ASSIGN_OR_RETURN(std::unique_ptr<AuthPolicy> auth_policy,
                       MakeAuthPolicy(config.security));

  std::unique_ptr<MhcServer> server(new MhcServer());
  server->metrics_ = std::make_unique<Metrics>(
      BuildInfo{MHC_VERSION, MHC_GIT_COMMIT, devices.front().backend->Name(),
                MHC_CUDA_VERSION});
  if (!config.metrics_listen.empty()) {
    MHC_ASSIGN_OR_RETURN(server->metrics_address_,
                         server->metrics_->Serve(config.metrics_listen));
  }
  server->audit_ = std::make_unique<DeterminismAudit>(
      config.determinism_audit_rate, config.batch_invariance_audit_rate,
      server->metrics_.get());
  std::vector<Executor*> executors;
  double host_copy_bandwidth = 0;
  for (DeviceBackend& device : devices) {
    auto executor =
        std::make_unique<Executor>(std::move(device.backend), device.device);
    executor->SetMetrics(server->metrics_.get());
    executor->SetAudit(server->audit_.get());
    // The roofline denominator: a host memcpy for host backends (measured
    // once), a device-to-device copy for GPUs.
    if (executor->HostAccessible()) {
      if (host_copy_bandwidth == 0) {
        host_copy_bandwidth = MeasureHostCopyBandwidth();
      }
      executor->SetCopyBandwidth(host_copy_bandwidth);
    } else if (device.cuda_index >= 0) {
#ifdef MHC_HAVE_CUDA
      MHC_ASSIGN_OR_RETURN(double bandwidth,
                           MeasureCudaCopyBandwidth(device.cuda_index));
      executor->SetCopyBandwidth(bandwidth);
#endif
    }
    executors.push_back(executor.get());
    server->executors_.push_back(std::move(executor));
  }
  server->store_ =
      std::make_unique<LayerStore>(executors, config.service.limits);
  server->checkpoints_ = std::make_unique<CheckpointStore>(
      config.checkpoints, server->store_.get(), server->metrics_.get());
  MHC_RETURN_IF_ERROR(server->checkpoints_->Init());
  server->admission_ = std::make_unique<Admission>(config.service.max_inflight);
  // CUDA IPC regions need a CUDA device served by this daemon; host
  // backends get none, so RegisterCudaSharedMemory is refused there. Host
  // backends read system regions in place; CUDA devices copy them, which a
  // page lock makes asynchronous and fast.
  std::unique_ptr<DeviceMemoryOpener> cuda_ipc;
  std::unique_ptr<HostMemoryPinner> pinner;
#ifdef MHC_HAVE_CUDA
  auto first_cuda =
      std::find_if(devices.begin(), devices.end(),
                   [](const DeviceBackend& d) { return d.cuda_index >= 0; });
  if (first_cuda != devices.end()) {
    std::shared_ptr<DeviceIpc> ipc = MakeCudaDeviceIpc();
    cuda_ipc = MakeDeviceMemoryOpener(ipc);
    if (config.service.shm.pin_host) {
      pinner = MakeHostMemoryPinner(ipc, first_cuda->cuda_index);
    }
  }
#endif
  ShmOptions shm_options = config.service.shm;
  // With authentication on, a caller's user must be known to map its
  // memory (peer_credentials.h).
  shm_options.require_peer_credentials = auth_policy != nullptr;
  server->shm_ = std::make_unique<ShmRegistry>(shm_options, std::move(cuda_ipc),
                                               std::move(pinner));
  server->peers_ = std::make_unique<ConnectionPeers>();
  server->authorizer_ = std::make_unique<Authorizer>(std::move(auth_policy),
                                                     server->peers_.get());
  server->groups_ = MakeGroups(config, executors, server->store_.get(),
                               server->metrics_.get());
  server->service_ = std::make_unique<MhcService>(
      config.service, executors, server->store_.get(),
      server->checkpoints_.get(), server->admission_.get(),
      server->metrics_.get(), server->shm_.get(), server->groups_.get(),
      server->authorizer_.get());
  // Layers come back before the first request can see the store.
  if (config.checkpoints.restore) {
    MHC_ASSIGN_OR_RETURN(server->restored_,
                         server->checkpoints_->RestoreNewest());
  }
  server->service_->UpdateLayerMetrics();
  // Stream-ordered requests are answered before their kernels finish; their
  // times are read at the next request or, here, at the next scrape.
  server->metrics_->SetScrapeHook([executors] {
    for (Executor* executor : executors) executor->PollTimings();
  });

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const int message_limit = static_cast<int>(
      std::min<uint64_t>(config.service.max_message_bytes, INT_MAX));
  builder.SetMaxReceiveMessageSize(message_limit);
  builder.SetMaxSendMessageSize(message_limit);
  // Enough threads that requests reach admission control, which answers
  // the excess with a clear RESOURCE_EXHAUSTED; the quota only backstops
  // runaway thread creation (open streams hold a thread each).
  grpc::ResourceQuota quota("mhcd");
  quota.SetMaxThreads(std::max(16, 2 * config.service.max_inflight + 16));
  builder.SetResourceQuota(quota);
  // gRPC sets SO_REUSEPORT on TCP listeners by default, which lets a second
  // daemon bind a port that is taken and split its connections with the
  // first; with it off, the second start fails on the taken port.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE,
                             static_cast<int>(kMaxMetadataBytes));
  // Unix sockets are accepted by the daemon itself, which learns each
  // peer's user before handing the connection to gRPC (unix_listener.h).
  for (Listener& listener : listeners) {
    if (listener.tcp) {
      builder.AddListeningPort(listener.address, tcp_credentials,
                               &listener.port);
      continue;
    }
    MHC_ASSIGN_OR_RETURN(
        std::unique_ptr<UnixListener> unix_listener,
        UnixListener::Bind(listener.address.substr(5),
                           config.security.unix_socket, server->peers_.get()));
    server->unix_listeners_.push_back(std::move(unix_listener));
  }
  builder.RegisterService(server->service_.get());
  std::vector<
      std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
      interceptors;
  interceptors.push_back(
      MakeRpcObserverFactory(server->metrics_.get(), config.log_requests));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("--listen: could not start the gRPC server on ",
                     absl::StrJoin(config.listen, ","),
                     " (address in use, bad address or no permission)"));
  }
  for (const Listener& listener : listeners) {
    if (listener.tcp && listener.port == 0) {
      server->StopUnixListeners();
      server->server_->Shutdown();
      return absl::UnavailableError(
          absl::StrCat("--listen: could not bind ", listener.address));
    }
    server->addresses_.push_back(
        listener.tcp ? absl::StrCat(listener.host, ":", listener.port)
                     : listener.address);
  }
  for (const auto& unix_listener : server->unix_listeners_) {
    unix_listener->Start(server->server_.get());
  }
  grpc::HealthCheckServiceInterface* health =
      server->server_->GetHealthCheckService();
  if (health != nullptr) {
    health->SetServingStatus("", true);
    health->SetServingStatus(kServiceName, true);
  }
  // A device that failed for good (its CUDA context is lost) fails every
  // request it gets: take the daemon out of service, and let it end so
  // that the orchestrator restarts it.
  Readiness* readiness = &server->metrics_->readiness();
  auto failed_once = std::make_shared<std::atomic<bool>>(false);
  for (const auto& executor : server->executors_) {
    executor->SetFailureCallback(
        [health, readiness, failed_once, on_failure = config.on_device_failure,
         device = executor->device()](const absl::Status& failure) {
          if (health != nullptr) health->SetServingStatus(false);
          readiness->SetNotReady(
              absl::StrCat("device ", device, " failed: ", failure.message()));
          if (on_failure && !failed_once->exchange(true)) on_failure();
        });
  }
  server->metrics_->readiness().SetReady();
  return server;
}

MhcServer::~MhcServer() {
  // The executors go before the metrics endpoint does.
  if (metrics_ != nullptr) metrics_->SetScrapeHook(nullptr);
  StopUnixListeners();
  if (server_ != nullptr) {
    // Open sessions are streams that never end on their own.
    shm_->CancelAllSessions();
    server_->Shutdown();
    server_->Wait();
  }
}

void MhcServer::Drain(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  metrics_->readiness().SetNotReady("draining");
  admission_->BeginDrain();
  shm_->CancelAllSessions();
  service_->EndStreams();
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health != nullptr) health->SetServingStatus(false);
  // Admitted unary calls run to their end before the gRPC server shuts
  // down, since its shutdown deadline cancels whatever still runs. Past
  // the drain deadline, requests still queued for a device are refused
  // with UNAVAILABLE and the ones running get a moment to answer.
  const absl::Time overrun_end = deadline + kDrainOverrun;
  if (!admission_->AwaitIdle(deadline)) {
    Log(LogLevel::kWarning,
        absl::StrCat("drain: ", admission_->inflight(),
                     " requests still in flight at --drain_timeout; "
                     "refusing the ones not yet running"));
    for (const auto& executor : executors_) executor->RefuseQueuedWork();
    admission_->AwaitIdle(overrun_end);
  }
  // Clients still calling are answered UNAVAILABLE until they stop (or the
  // time is up).
  admission_->AwaitQuiet(kClientsQuiet,
                         absl::Now() < deadline ? deadline : overrun_end);
  // gRPC ends CANCELLED, which clients do not retry, every call that
  // reaches it after its shutdown began, whatever the shutdown deadline;
  // clients that keep calling would meet that. So every connection is cut
  // before: its calls end UNAVAILABLE, and with the unix listeners stopped
  // the client's next call finds nobody to connect to. The cut is
  // asynchronous, so the shutdown waits until gRPC has closed the unix
  // connections.
  StopUnixListeners();
  grpc_server_cancel_all_calls(server_->c_server());
  if (!peers_->AwaitClosed(absl::Now() + kConnectionsClose)) {
    Log(LogLevel::kWarning,
        "drain: a connection is still open after it was cut; shutting down");
  }
  // gRPC's own TCP listeners stop only with its shutdown: a TCP client
  // that reconnected since is cut at once rather than given time to call.
  server_->Shutdown(absl::ToChronoTime(absl::Now()));
}

void MhcServer::StopUnixListeners() {
  for (const auto& unix_listener : unix_listeners_) unix_listener->Stop();
}

void MhcServer::Wait() { server_->Wait(); }

}  // namespace mhc::server
