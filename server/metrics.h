// Prometheus metrics of the daemon, served by prometheus-cpp on
// --metrics_listen. All durations in seconds (base units).
#ifndef MHC_SERVER_METRICS_H_
#define MHC_SERVER_METRICS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace mhc::server {

class Metrics {
 public:
  Metrics(absl::string_view version, absl::string_view backend);

  // Starts the HTTP endpoint; returns "host:port" with the bound port (port
  // 0 picks a free one). Not calling it keeps the metrics in memory only.
  absl::StatusOr<std::string> Serve(const std::string& listen);

  void RecordRequest(absl::string_view rpc, grpc::StatusCode code,
                     double seconds);
  void AddInflight(double delta) { inflight_->Increment(delta); }
  void SetLayers(double count) { layers_->Set(count); }

  prometheus::Registry& registry() { return *registry_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Histogram>* durations_;
  prometheus::Gauge* inflight_;
  prometheus::Gauge* layers_;
  std::unique_ptr<prometheus::Exposer> exposer_;
};

}  // namespace mhc::server

#endif  // MHC_SERVER_METRICS_H_
