// Prometheus metrics of the daemon, served by prometheus-cpp on
// --metrics_listen. Base units (seconds, bytes), `_total` on counters, and
// histograms rather than summaries so that percentiles aggregate across
// pods. Every family is created up front, and label sets that dashboards and
// alerts select on (shm kinds, mismatch results) start at zero, so a query
// returns 0 instead of nothing on a healthy daemon.
#ifndef MHC_SERVER_METRICS_H_
#define MHC_SERVER_METRICS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/status.h"
#include "mhc/backend.h"
#include "mhc/types.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/probes.h"

namespace mhc::server {

// Labels of mhcd_build_info.
struct BuildInfo {
  std::string version;
  std::string commit;        // git commit of the source, "unknown" without
  std::string backend;       // "cpu", "reference", "cuda"
  std::string cuda_version;  // CUDA toolkit the build used, "none" without
};

// One kernel launch as the executor measured it.
struct KernelSample {
  OpKind kind = OpKind::kPreForward;
  DType dtype = DType::kF32;
  Layout layout = Layout::kStreamMajor;
  int n = 0;
  int64_t tokens = 0;
  uint64_t bytes = 0;  // tensor bytes read and written by the launch
  // The backend's kernel variant (a name from a small fixed set).
  absl::string_view variant = Backend::kDefaultVariant;
  double seconds = 0.0;  // device time
};

class Metrics {
 public:
  explicit Metrics(const BuildInfo& build);
  ~Metrics();

  // Starts the HTTP endpoint (/metrics, and the probes /healthz and
  // /readyz, see probes.h); returns "host:port" with the bound port (port
  // 0 picks a free one). Not calling it keeps the metrics in memory only.
  absl::StatusOr<std::string> Serve(const std::string& listen);
  // What /readyz reports; the server sets it.
  Readiness& readiness() { return *readiness_; }

  void RecordRequest(absl::string_view rpc, grpc::StatusCode code,
                     double seconds);
  // Every RPC of every service under the names gRPC's Prometheus
  // interceptors use (grpc_server_started_total, _handled_total,
  // _handling_seconds); `type` is unary, client_stream, server_stream or
  // bidi_stream.
  void RecordRpcStarted(absl::string_view service, absl::string_view method,
                        absl::string_view type);
  void RecordRpcHandled(absl::string_view service, absl::string_view method,
                        absl::string_view type, grpc::StatusCode code,
                        double seconds);
  void AddInflight(double delta) { inflight_->Increment(delta); }

  // Kernel time, bytes, bandwidth, fraction of `copy_bandwidth` (bytes per
  // second; 0: unknown, no roofline sample) and tokens of one launch.
  void RecordKernel(absl::string_view device, const KernelSample& sample,
                    double copy_bandwidth);
  // Requests waiting for the device, and how long one waited.
  void AddQueueDepth(absl::string_view device, double delta);
  void RecordQueueWait(absl::string_view device, double seconds);
  void SetCopyBandwidth(absl::string_view device, double bytes_per_second);
  // Layers and the memory their parameters and gradient accumulators hold.
  void SetLayerMemory(absl::string_view device, double layers,
                      double parameter_bytes, double gradient_bytes);
  void SetWorkspaceBytes(absl::string_view device, double bytes);
  // Optimizer: the step counters of `device` start at zero for every
  // algorithm; a step that updated parameters, and how long it held the
  // device; the memory of the layers' optimizer state.
  void DeclareOptimizerDevice(absl::string_view device);
  void RecordOptimizerStep(absl::string_view device,
                           absl::string_view algorithm, double seconds);
  void SetOptimizerStateBytes(absl::string_view device, double bytes);
  // Device memory host tensors are staged in (backends without host
  // access).
  void SetStagingBytes(absl::string_view device, double bytes);
  // Registered shared-memory regions of one kind ("system", "cuda"): the
  // registry calls it whenever a region comes or goes.
  void SetSharedMemory(absl::string_view kind, double regions, double bytes);
  // Registered system regions page-locked for device copies, and the host
  // bytes locked; a registration whose page lock failed.
  void SetPinnedSharedMemory(double regions, double bytes);
  void RecordPinFailure() { pin_failures_->Increment(); }
  // Client device memory mapped by CUDA IPC: distinct allocations (regions
  // over one allocation share its mapping) and their bytes.
  void SetCudaIpcMappings(double mappings, double bytes);
  // Sessions whose compute calls come through a call ring.
  void SetCallRings(double rings) { call_rings_->Set(rings); }
  // A request's thread waited for the device (`reason`: "request" for a
  // request answered after its work finished).
  void RecordHostSync(absl::string_view device, absl::string_view reason,
                      double count = 1);
  // One collective of a data-parallel group (`op`: "all_reduce" or
  // "broadcast") over `bytes` of one rank's buffers.
  void RecordCollective(absl::string_view op, double bytes, double seconds,
                        double bus_bytes_per_second);
  void SetGroups(absl::string_view state, double count);
  // One determinism check (`check`: "replay" or "batch_invariance").
  void RecordDeterminismCheck(OpKind kind, absl::string_view check, bool match,
                              uint64_t ulp_difference);

  // A checkpoint saved (`direction` "save": the file's bytes) or loaded
  // ("load": the tensor bytes read), and its wall time.
  void RecordCheckpoint(absl::string_view direction, uint64_t bytes,
                        double seconds);

  prometheus::Registry& registry() { return *registry_; }

  // Runs before every scrape, so that values recorded lazily (kernel times
  // read once the device finished) are current when they are read.
  void SetScrapeHook(std::function<void()> hook);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> process_;
  // Collected first on a scrape; calls the hook and adds no families.
  std::shared_ptr<prometheus::Collectable> scrape_hook_;
  std::shared_ptr<Readiness> readiness_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Counter>* rpcs_started_;
  prometheus::Family<prometheus::Counter>* rpcs_handled_;
  prometheus::Family<prometheus::Histogram>* rpc_seconds_;
  prometheus::Family<prometheus::Histogram>* durations_;
  prometheus::Gauge* inflight_;
  prometheus::Family<prometheus::Histogram>* kernel_seconds_;
  prometheus::Family<prometheus::Counter>* kernel_bytes_;
  prometheus::Family<prometheus::Histogram>* kernel_bandwidth_;
  prometheus::Family<prometheus::Histogram>* kernel_roofline_;
  prometheus::Family<prometheus::Histogram>* kernel_tokens_;
  prometheus::Family<prometheus::Gauge>* queue_depth_;
  prometheus::Family<prometheus::Histogram>* queue_wait_;
  prometheus::Family<prometheus::Gauge>* copy_bandwidth_;
  prometheus::Family<prometheus::Gauge>* layers_;
  prometheus::Family<prometheus::Gauge>* parameter_bytes_;
  prometheus::Family<prometheus::Gauge>* gradient_bytes_;
  prometheus::Family<prometheus::Gauge>* workspace_bytes_;
  prometheus::Family<prometheus::Counter>* optimizer_steps_;
  prometheus::Family<prometheus::Histogram>* optimizer_seconds_;
  prometheus::Family<prometheus::Gauge>* optimizer_state_bytes_;
  prometheus::Family<prometheus::Gauge>* staging_bytes_;
  prometheus::Family<prometheus::Gauge>* shm_regions_;
  prometheus::Family<prometheus::Gauge>* shm_bytes_;
  prometheus::Gauge* shm_pinned_regions_;
  prometheus::Gauge* shm_pinned_bytes_;
  prometheus::Counter* pin_failures_;
  prometheus::Gauge* ipc_mappings_;
  prometheus::Gauge* ipc_mapped_bytes_;
  prometheus::Gauge* call_rings_;
  prometheus::Family<prometheus::Counter>* host_syncs_;
  prometheus::Family<prometheus::Histogram>* group_seconds_;
  prometheus::Family<prometheus::Counter>* group_bytes_;
  prometheus::Family<prometheus::Histogram>* group_bus_bandwidth_;
  prometheus::Family<prometheus::Gauge>* groups_;
  prometheus::Family<prometheus::Counter>* determinism_checks_;
  prometheus::Family<prometheus::Gauge>* determinism_max_ulp_;
  // A maximum is a read-modify-write; checks of several devices may race.
  absl::Mutex ulp_mu_;
  prometheus::Gauge* last_mismatch_;
  prometheus::Family<prometheus::Counter>* checkpoint_bytes_;
  prometheus::Family<prometheus::Histogram>* checkpoint_seconds_;
  prometheus::Family<prometheus::Gauge>* checkpoint_last_success_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string http_host_;
  int http_port_ = 0;
  // Declared after the exposer, so routed away first when destroyed.
  std::unique_ptr<ProbeRoute> probe_route_;
};

}  // namespace mhc::server

#endif  // MHC_SERVER_METRICS_H_
