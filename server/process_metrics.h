// Process metrics with the names every Prometheus client library uses
// (process_cpu_seconds_total, process_resident_memory_bytes, ...), read from
// /proc/self at scrape time. prometheus-cpp has no collector of its own.
#ifndef MHC_SERVER_PROCESS_METRICS_H_
#define MHC_SERVER_PROCESS_METRICS_H_

#include <memory>

#include "prometheus/collectable.h"

namespace mhc::server {

std::shared_ptr<prometheus::Collectable> MakeProcessCollector();

}  // namespace mhc::server

#endif  // MHC_SERVER_PROCESS_METRICS_H_
