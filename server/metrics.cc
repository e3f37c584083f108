#include "server/metrics.h"

#include <exception>
#include <functional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/metrics_http.h"
#include "server/process_metrics.h"
#include "server/status_util.h"

namespace mhc::server {

namespace {

// 50 us (a tiny Sinkhorn) to 60 s (a huge batch on the reference backend).
const prometheus::Histogram::BucketBoundaries& LatencyBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
      0.1,   0.25,   0.5,    1.0,    2.5,  5.0,    10.0, 30.0,  60.0};
  return *buckets;
}

// 1 us (one token of a small op on a GPU) to 60 s.
const prometheus::Histogram::BucketBoundaries& KernelBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      1e-6,   2.5e-6, 5e-6,   10e-6, 25e-6, 50e-6, 100e-6, 250e-6,
      500e-6, 1e-3,   2.5e-3, 5e-3,  10e-3, 25e-3, 50e-3,  0.1,
      0.25,   0.5,    1.0,    2.5,   5.0,   10.0,  30.0,   60.0};
  return *buckets;
}

// 100 MB/s (a slow CPU) to 10 TB/s (beyond any HBM today).
const prometheus::Histogram::BucketBoundaries& BandwidthBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      1e8,    2.5e8, 5e8,  1e9,    2.5e9, 5e9,  1e10, 2.5e10, 5e10, 1e11,
      2.5e11, 5e11,  1e12, 1.5e12, 2e12,  3e12, 4e12, 5e12,   1e13};
  return *buckets;
}

// 10 ms (a small layer to /dev/shm) to 30 min (a large model to a slow
// disk).
const prometheus::Histogram::BucketBoundaries& CheckpointBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      0.01, 0.025, 0.05, 0.1,  0.25, 0.5,   1.0,   2.5,
      5.0,  10.0,  30.0, 60.0, 120., 300.0, 600.0, 1800.0};
  return *buckets;
}

// Fraction of the copy bandwidth; read-heavy kernels may exceed 1.
const prometheus::Histogram::BucketBoundaries& RooflineBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      0.01, 0.02, 0.05, 0.1,  0.2, 0.3, 0.4,  0.5, 0.6, 0.7,
      0.8,  0.85, 0.9,  0.95, 1.0, 1.1, 1.25, 1.5, 2.0};
  return *buckets;
}

// Tokens per launch, powers of two up to 2^20.
const prometheus::Histogram::BucketBoundaries& TokenBuckets() {
  static const auto* buckets = [] {
    auto* b = new prometheus::Histogram::BucketBoundaries;
    for (int i = 0; i <= 20; ++i) b->push_back(static_cast<double>(1 << i));
    return b;
  }();
  return *buckets;
}

prometheus::Labels OpLabels(OpKind kind, absl::string_view device) {
  return {{"op", std::string(OpFamilyName(kind))},
          {"direction", std::string(OpDirectionName(kind))},
          {"device", std::string(device)}};
}

class ScrapeHook final : public prometheus::Collectable {
 public:
  void Set(std::function<void()> hook) {
    absl::MutexLock lock(&mu_);
    hook_ = std::move(hook);
  }
  std::vector<prometheus::MetricFamily> Collect() const override {
    absl::MutexLock lock(&mu_);
    if (hook_) hook_();
    return {};
  }

 private:
  mutable absl::Mutex mu_;
  std::function<void()> hook_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

void Metrics::SetScrapeHook(std::function<void()> hook) {
  static_cast<ScrapeHook&>(*scrape_hook_).Set(std::move(hook));
}

Metrics::Metrics(const BuildInfo& build)
    : registry_(std::make_shared<prometheus::Registry>()),
      process_(MakeProcessCollector()),
      scrape_hook_(std::make_shared<ScrapeHook>()),
      readiness_(std::make_shared<Readiness>()) {
  requests_ = &prometheus::BuildCounter()
                   .Name("mhcd_requests_total")
                   .Help("RPCs handled, by method and gRPC status code.")
                   .Register(*registry_);
  durations_ =
      &prometheus::BuildHistogram()
           .Name("mhcd_request_duration_seconds")
           .Help(
               "Wall time of an RPC inside the daemon (admission, "
               "validation, queueing for the device, compute), by method "
               "and gRPC status code.")
           .Register(*registry_);
  rpcs_started_ = &prometheus::BuildCounter()
                       .Name("grpc_server_started_total")
                       .Help(
                           "RPCs started on the server, by service, method "
                           "and type.")
                       .Register(*registry_);
  rpcs_handled_ = &prometheus::BuildCounter()
                       .Name("grpc_server_handled_total")
                       .Help(
                           "RPCs completed on the server, by service, "
                           "method, type and gRPC status code.")
                       .Register(*registry_);
  rpc_seconds_ = &prometheus::BuildHistogram()
                      .Name("grpc_server_handling_seconds")
                      .Help(
                          "Time from the start of an RPC to its status, "
                          "by service, method and type.")
                      .Register(*registry_);
  inflight_ = &prometheus::BuildGauge()
                   .Name("mhcd_inflight_requests")
                   .Help("Requests admitted and not yet answered.")
                   .Register(*registry_)
                   .Add({});
  kernel_seconds_ =
      &prometheus::BuildHistogram()
           .Name("mhcd_kernel_duration_seconds")
           .Help(
               "Device time of one kernel launch (CUDA events on GPUs, the "
               "host clock on CPU backends), by op family, direction, "
               "activation dtype, layout, streams n, device and the "
               "backend's kernel variant (docs/kernels.md; \"default\" "
               "where it has one).")
           .Register(*registry_);
  kernel_bytes_ = &prometheus::BuildCounter()
                       .Name("mhcd_kernel_bytes_total")
                       .Help(
                           "Tensor bytes read and written by kernel "
                           "launches (parameters excluded), by op family, "
                           "direction and device.")
                       .Register(*registry_);
  kernel_bandwidth_ =
      &prometheus::BuildHistogram()
           .Name("mhcd_kernel_bandwidth_bytes_per_second")
           .Help(
               "Achieved bandwidth of one launch: tensor bytes over device "
               "time, by op family, direction and device.")
           .Register(*registry_);
  kernel_roofline_ =
      &prometheus::BuildHistogram()
           .Name("mhcd_kernel_roofline_ratio")
           .Help(
               "Achieved bandwidth of one launch as a fraction of the "
               "device's measured copy bandwidth "
               "(mhcd_device_copy_bandwidth_bytes_per_second), by op family, "
               "direction and device.")
           .Register(*registry_);
  kernel_tokens_ = &prometheus::BuildHistogram()
                        .Name("mhcd_kernel_tokens")
                        .Help(
                            "Tokens (M) per kernel launch, by op family, "
                            "direction and device.")
                        .Register(*registry_);
  queue_depth_ = &prometheus::BuildGauge()
                      .Name("mhcd_queue_depth")
                      .Help("Admitted requests waiting for their device.")
                      .Register(*registry_);
  queue_wait_ = &prometheus::BuildHistogram()
                     .Name("mhcd_queue_wait_seconds")
                     .Help(
                         "Time a request waited for its device before its "
                         "ops started, by device.")
                     .Register(*registry_);
  copy_bandwidth_ =
      &prometheus::BuildGauge()
           .Name("mhcd_device_copy_bandwidth_bytes_per_second")
           .Help(
               "Bytes read plus written per second by a large copy within "
               "the device's memory, measured once at startup: the "
               "roofline denominator.")
           .Register(*registry_);
  layers_ = &prometheus::BuildGauge()
                 .Name("mhcd_layers")
                 .Help("Layers held by the daemon, by device.")
                 .Register(*registry_);
  parameter_bytes_ = &prometheus::BuildGauge()
                          .Name("mhcd_parameter_bytes")
                          .Help("Memory of layer parameters, by device.")
                          .Register(*registry_);
  gradient_bytes_ = &prometheus::BuildGauge()
                         .Name("mhcd_gradient_bytes")
                         .Help("Memory of gradient accumulators, by device.")
                         .Register(*registry_);
  workspace_bytes_ =
      &prometheus::BuildGauge()
           .Name("mhcd_workspace_bytes")
           .Help("Memory of the kernel workspace (scratch), by device.")
           .Register(*registry_);
  optimizer_steps_ =
      &prometheus::BuildCounter()
           .Name("mhcd_optimizer_steps_total")
           .Help(
               "OptimizerStep calls that updated parameters, by device and "
               "algorithm (sgd, adamw).")
           .Register(*registry_);
  optimizer_seconds_ =
      &prometheus::BuildHistogram()
           .Name("mhcd_optimizer_step_duration_seconds")
           .Help(
               "Time one OptimizerStep held its device: the launches, and "
               "the wait for the device when the request waits for it, by "
               "device and algorithm.")
           .Register(*registry_);
  optimizer_state_bytes_ =
      &prometheus::BuildGauge()
           .Name("mhcd_optimizer_state_bytes")
           .Help(
               "Memory of the layers' optimizer state (momentum, Adam "
               "moments), by device.")
           .Register(*registry_);
  staging_bytes_ =
      &prometheus::BuildGauge()
           .Name("mhcd_staging_bytes")
           .Help(
               "Device memory that host tensors (inline bytes, system "
               "shared memory) are copied through on devices without host "
               "access, by device; it only grows, to the largest request.")
           .Register(*registry_);
  shm_regions_ = &prometheus::BuildGauge()
                      .Name("mhcd_shm_regions")
                      .Help(
                          "Registered shared-memory regions, by kind "
                          "(system, cuda).")
                      .Register(*registry_);
  shm_bytes_ = &prometheus::BuildGauge()
                    .Name("mhcd_shm_region_bytes")
                    .Help(
                        "Bytes of registered shared-memory regions, by kind "
                        "(system, cuda).")
                    .Register(*registry_);
  for (const char* kind : {"system", "cuda"}) SetSharedMemory(kind, 0, 0);
  shm_pinned_regions_ =
      &prometheus::BuildGauge()
           .Name("mhcd_shm_pinned_regions")
           .Help(
               "Registered system shared-memory regions whose mapping is "
               "page-locked for asynchronous GPU copies (daemons serving "
               "CUDA devices).")
           .Register(*registry_)
           .Add({});
  shm_pinned_bytes_ =
      &prometheus::BuildGauge()
           .Name("mhcd_shm_pinned_bytes")
           .Help(
               "Host memory page-locked by the mappings of registered system "
               "shared-memory regions.")
           .Register(*registry_)
           .Add({});
  pin_failures_ = &prometheus::BuildCounter()
                       .Name("mhcd_shm_pin_failures_total")
                       .Help(
                           "System shared-memory registrations whose mapping "
                           "could not be page-locked (e.g. the locked-memory "
                           "limit); those regions use slower pageable copies.")
                       .Register(*registry_)
                       .Add({});
  call_rings_ = &prometheus::BuildGauge()
                     .Name("mhcd_call_rings")
                     .Help(
                         "Open call rings: sessions whose compute calls come "
                         "through shared memory instead of gRPC messages.")
                     .Register(*registry_)
                     .Add({});
  ipc_mappings_ =
      &prometheus::BuildGauge()
           .Name("mhcd_cuda_ipc_mappings")
           .Help(
               "Client device allocations the daemon has mapped through CUDA "
               "IPC (all regions over one allocation share its mapping).")
           .Register(*registry_)
           .Add({});
  ipc_mapped_bytes_ =
      &prometheus::BuildGauge()
           .Name("mhcd_cuda_ipc_mapped_bytes")
           .Help(
               "Bytes of the client device allocations mapped through CUDA "
               "IPC; a mapping keeps its allocation alive, so this bounds the "
               "client memory the daemon holds.")
           .Register(*registry_)
           .Add({});
  group_seconds_ =
      &prometheus::BuildHistogram()
           .Name("mhcd_group_collective_seconds")
           .Help(
               "Collectives of data-parallel groups, from issue to completion "
               "on every local rank, by op (all_reduce, broadcast).")
           .Register(*registry_);
  group_bytes_ = &prometheus::BuildCounter()
                      .Name("mhcd_group_collective_bytes_total")
                      .Help(
                          "Bytes of one rank's buffers reduced or broadcast "
                          "by data-parallel groups, by op.")
                      .Register(*registry_);
  group_bus_bandwidth_ =
      &prometheus::BuildHistogram()
           .Name("mhcd_group_bus_bandwidth_bytes_per_second")
           .Help(
               "Bus bandwidth of group collectives, by op: for an all-reduce "
               "bytes * 2 * (ranks - 1) / ranks / seconds, comparable across "
               "group sizes.")
           .Register(*registry_);
  groups_ = &prometheus::BuildGauge()
                 .Name("mhcd_groups")
                 .Help(
                     "Data-parallel groups on this daemon, by state "
                     "(FORMING, READY, FAILED).")
                 .Register(*registry_);
  host_syncs_ =
      &prometheus::BuildCounter()
           .Name("mhcd_host_synchronizations_total")
           .Help(
               "Times a request's thread waited for its device to finish, by "
               "device and reason (request: requests without a signal event, "
               "or with host copies, are answered once their work is done; "
               "grad_norm: an OptimizerStep returns the gradient norm). "
               "Stream-ordered requests on device memory add none.")
           .Register(*registry_);
  determinism_checks_ =
      &prometheus::BuildCounter()
           .Name("mhcd_determinism_checks_total")
           .Help(
               "Determinism audits of sampled launches, by op family, "
               "direction, check (replay: same inputs again; "
               "batch_invariance: one token alone) and result (match, "
               "mismatch).")
           .Register(*registry_);
  determinism_max_ulp_ =
      &prometheus::BuildGauge()
           .Name("mhcd_determinism_max_ulp_difference")
           .Help(
               "Largest difference between an audited launch and its "
               "re-run seen since start, in units in the last place of the "
               "output dtype, by op family, direction and check.")
           .Register(*registry_);
  last_mismatch_ =
      &prometheus::BuildGauge()
           .Name("mhcd_determinism_last_mismatch_timestamp_seconds")
           .Help(
               "Unix time of the last determinism mismatch; 0 "
               "when there was none.")
           .Register(*registry_)
           .Add({});
  checkpoint_bytes_ =
      &prometheus::BuildCounter()
           .Name("mhcd_checkpoint_bytes_total")
           .Help(
               "Bytes of checkpoints written (direction save: whole files) "
               "and read (direction load: tensor data).")
           .Register(*registry_);
  checkpoint_seconds_ =
      &prometheus::BuildHistogram()
           .Name("mhcd_checkpoint_duration_seconds")
           .Help(
               "Wall time of a successful SaveCheckpoint or LoadCheckpoint "
               "(--restore included) inside the daemon, by direction.")
           .Register(*registry_);
  checkpoint_last_success_ =
      &prometheus::BuildGauge()
           .Name("mhcd_checkpoint_last_success_timestamp_seconds")
           .Help(
               "Unix time of the last successful checkpoint save or load, "
               "by direction; 0 when there was none.")
           .Register(*registry_);
  for (const char* direction : {"save", "load"}) {
    const prometheus::Labels labels{{"direction", direction}};
    checkpoint_bytes_->Add(labels);
    checkpoint_seconds_->Add(labels, CheckpointBuckets());
    checkpoint_last_success_->Add(labels);
  }
  prometheus::BuildGauge()
      .Name("mhcd_build_info")
      .Help("Always 1; the labels say which build and backend run.")
      .Register(*registry_)
      .Add({{"version", build.version},
            {"commit", build.commit},
            {"backend", build.backend},
            {"cuda_version", build.cuda_version}})
      .Set(1);
}

Metrics::~Metrics() {
  StopMetricsHttp(std::move(exposer_), http_host_, http_port_);
}

absl::StatusOr<std::string> Metrics::Serve(const std::string& listen) {
  size_t colon = listen.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_listen: expected host:port, got '", listen, "'"));
  }
  std::string host = listen.substr(0, colon);
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(MetricsHttpOptions(listen),
                                                     ProbeCallbacks());
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(
        "--metrics_listen: cannot listen on ", listen, ": ", e.what()));
  }
  exposer_->RegisterCollectable(scrape_hook_);
  exposer_->RegisterCollectable(registry_);
  exposer_->RegisterCollectable(process_);
  std::vector<int> ports = exposer_->GetListeningPorts();
  if (ports.empty()) {
    return absl::UnavailableError(
        absl::StrCat("--metrics_listen: no port bound for ", listen));
  }
  probe_route_ = std::make_unique<ProbeRoute>(ports.front(), readiness_);
  http_host_ = host;
  http_port_ = ports.front();
  return absl::StrCat(host, ":", ports.front());
}

void Metrics::RecordRequest(absl::string_view rpc, grpc::StatusCode code,
                            double seconds) {
  prometheus::Labels labels{{"rpc", std::string(rpc)},
                            {"code", StatusCodeName(code)}};
  requests_->Add(labels).Increment();
  durations_->Add(labels, LatencyBuckets()).Observe(seconds);
}

void Metrics::RecordRpcStarted(absl::string_view service,
                               absl::string_view method,
                               absl::string_view type) {
  rpcs_started_
      ->Add({{"grpc_service", std::string(service)},
             {"grpc_method", std::string(method)},
             {"grpc_type", std::string(type)}})
      .Increment();
}

void Metrics::RecordRpcHandled(absl::string_view service,
                               absl::string_view method, absl::string_view type,
                               grpc::StatusCode code, double seconds) {
  prometheus::Labels labels{{"grpc_service", std::string(service)},
                            {"grpc_method", std::string(method)},
                            {"grpc_type", std::string(type)}};
  rpc_seconds_->Add(labels, LatencyBuckets()).Observe(seconds);
  labels.emplace("grpc_code", StatusCodeName(code));
  rpcs_handled_->Add(labels).Increment();
}

}  // namespace mhc::server

namespace mhc::server {

void Metrics::RecordKernel(absl::string_view device, const KernelSample& sample,
                           double copy_bandwidth) {
  prometheus::Labels labels = OpLabels(sample.kind, device);
  kernel_bytes_->Add(labels).Increment(static_cast<double>(sample.bytes));
  kernel_tokens_->Add(labels, TokenBuckets())
      .Observe(static_cast<double>(sample.tokens));
  // An empty launch moves nothing; its bandwidth would only drag the
  // distribution towards zero.
  if (sample.seconds > 0 && sample.bytes > 0) {
    const double bandwidth = static_cast<double>(sample.bytes) / sample.seconds;
    kernel_bandwidth_->Add(labels, BandwidthBuckets()).Observe(bandwidth);
    if (copy_bandwidth > 0) {
      kernel_roofline_->Add(labels, RooflineBuckets())
          .Observe(bandwidth / copy_bandwidth);
    }
  }
  labels["dtype"] = std::string(DTypeName(sample.dtype));
  labels["layout"] = std::string(LayoutName(sample.layout));
  labels["n"] = absl::StrCat(sample.n);
  labels["variant"] = std::string(sample.variant);
  kernel_seconds_->Add(labels, KernelBuckets()).Observe(sample.seconds);
}

void Metrics::AddQueueDepth(absl::string_view device, double delta) {
  queue_depth_->Add({{"device", std::string(device)}}).Increment(delta);
}

void Metrics::RecordQueueWait(absl::string_view device, double seconds) {
  queue_wait_->Add({{"device", std::string(device)}}, LatencyBuckets())
      .Observe(seconds);
}

void Metrics::SetCopyBandwidth(absl::string_view device,
                               double bytes_per_second) {
  copy_bandwidth_->Add({{"device", std::string(device)}}).Set(bytes_per_second);
}

void Metrics::SetLayerMemory(absl::string_view device, double layers,
                             double parameter_bytes, double gradient_bytes) {
  const prometheus::Labels labels{{"device", std::string(device)}};
  layers_->Add(labels).Set(layers);
  parameter_bytes_->Add(labels).Set(parameter_bytes);
  gradient_bytes_->Add(labels).Set(gradient_bytes);
}

void Metrics::SetWorkspaceBytes(absl::string_view device, double bytes) {
  workspace_bytes_->Add({{"device", std::string(device)}}).Set(bytes);
}

void Metrics::DeclareOptimizerDevice(absl::string_view device) {
  for (const char* algorithm : {"sgd", "adamw"}) {
    optimizer_steps_->Add(
        {{"device", std::string(device)}, {"algorithm", algorithm}});
  }
  optimizer_state_bytes_->Add({{"device", std::string(device)}});
}

void Metrics::RecordOptimizerStep(absl::string_view device,
                                  absl::string_view algorithm, double seconds) {
  const prometheus::Labels labels{{"device", std::string(device)},
                                  {"algorithm", std::string(algorithm)}};
  optimizer_steps_->Add(labels).Increment();
  optimizer_seconds_->Add(labels, LatencyBuckets()).Observe(seconds);
}

void Metrics::SetOptimizerStateBytes(absl::string_view device, double bytes) {
  optimizer_state_bytes_->Add({{"device", std::string(device)}}).Set(bytes);
}

void Metrics::SetStagingBytes(absl::string_view device, double bytes) {
  staging_bytes_->Add({{"device", std::string(device)}}).Set(bytes);
}

void Metrics::SetPinnedSharedMemory(double regions, double bytes) {
  shm_pinned_regions_->Set(regions);
  shm_pinned_bytes_->Set(bytes);
}

void Metrics::SetCudaIpcMappings(double mappings, double bytes) {
  ipc_mappings_->Set(mappings);
  ipc_mapped_bytes_->Set(bytes);
}

void Metrics::RecordCollective(absl::string_view op, double bytes,
                               double seconds, double bus_bytes_per_second) {
  const prometheus::Labels labels{{"op", std::string(op)}};
  group_seconds_->Add(labels, LatencyBuckets()).Observe(seconds);
  group_bytes_->Add(labels).Increment(bytes);
  group_bus_bandwidth_->Add(labels, BandwidthBuckets())
      .Observe(bus_bytes_per_second);
}

void Metrics::SetGroups(absl::string_view state, double count) {
  groups_->Add({{"state", std::string(state)}}).Set(count);
}

void Metrics::RecordHostSync(absl::string_view device, absl::string_view reason,
                             double count) {
  host_syncs_
      ->Add({{"device", std::string(device)}, {"reason", std::string(reason)}})
      .Increment(count);
}

void Metrics::SetSharedMemory(absl::string_view kind, double regions,
                              double bytes) {
  const prometheus::Labels labels{{"kind", std::string(kind)}};
  shm_regions_->Add(labels).Set(regions);
  shm_bytes_->Add(labels).Set(bytes);
}

void Metrics::RecordDeterminismCheck(OpKind kind, absl::string_view check,
                                     bool match, uint64_t ulp_difference) {
  prometheus::Labels labels{{"op", std::string(OpFamilyName(kind))},
                            {"direction", std::string(OpDirectionName(kind))},
                            {"check", std::string(check)}};
  prometheus::Gauge& max_ulp = determinism_max_ulp_->Add(labels);
  labels["result"] = "mismatch";
  prometheus::Counter& mismatches = determinism_checks_->Add(labels);
  labels["result"] = "match";
  prometheus::Counter& matches = determinism_checks_->Add(labels);
  (match ? matches : mismatches).Increment();
  if (!match) last_mismatch_->Set(absl::ToUnixMicros(absl::Now()) * 1e-6);
  absl::MutexLock lock(&ulp_mu_);
  const double ulp = static_cast<double>(ulp_difference);
  if (ulp > max_ulp.Value()) max_ulp.Set(ulp);
}

void Metrics::RecordCheckpoint(absl::string_view direction, uint64_t bytes,
                               double seconds) {
  const prometheus::Labels labels{{"direction", std::string(direction)}};
  checkpoint_bytes_->Add(labels).Increment(static_cast<double>(bytes));
  checkpoint_seconds_->Add(labels, CheckpointBuckets()).Observe(seconds);
  checkpoint_last_success_->Add(labels).Set(absl::ToUnixMicros(absl::Now()) *
                                            1e-6);
}

}  // namespace mhc::server
