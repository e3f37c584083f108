#include "server/metrics.h"

#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
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

}  // namespace

Metrics::Metrics(absl::string_view version, absl::string_view backend)
    : registry_(std::make_shared<prometheus::Registry>()) {
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
  inflight_ = &prometheus::BuildGauge()
                   .Name("mhcd_inflight_requests")
                   .Help("Requests admitted and not yet answered.")
                   .Register(*registry_)
                   .Add({});
  layers_ = &prometheus::BuildGauge()
                 .Name("mhcd_layers")
                 .Help("Layers held by the daemon.")
                 .Register(*registry_)
                 .Add({});
  prometheus::BuildGauge()
      .Name("mhcd_build_info")
      .Help("Always 1; the labels say which build and backend run.")
      .Register(*registry_)
      .Add({{"version", std::string(version)},
            {"backend", std::string(backend)}})
      .Set(1);
}

absl::StatusOr<std::string> Metrics::Serve(const std::string& listen) {
  size_t colon = listen.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_listen: expected host:port, got '", listen, "'"));
  }
  std::string host = listen.substr(0, colon);
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(listen);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(
        "--metrics_listen: cannot listen on ", listen, ": ", e.what()));
  }
  exposer_->RegisterCollectable(registry_);
  std::vector<int> ports = exposer_->GetListeningPorts();
  if (ports.empty()) {
    return absl::UnavailableError(
        absl::StrCat("--metrics_listen: no port bound for ", listen));
  }
  return absl::StrCat(host, ":", ports.front());
}

void Metrics::RecordRequest(absl::string_view rpc, grpc::StatusCode code,
                            double seconds) {
  prometheus::Labels labels{{"rpc", std::string(rpc)},
                            {"code", StatusCodeName(code)}};
  requests_->Add(labels).Increment();
  durations_->Add(labels, LatencyBuckets()).Observe(seconds);
}

}  // namespace mhc::server
