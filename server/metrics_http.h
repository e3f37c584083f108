// The metrics endpoint's HTTP server (civetweb, inside prometheus-cpp's
// Exposer): how it is bounded and how it stops.
//
// civetweb serves one connection per worker thread, so connections that
// open and send nothing (or only part of a request) would hold every
// worker and starve real scrapes and probes. The workers are bounded and a
// request must arrive whole within a short timeout; a slow or idle
// connection is closed when it runs out.
#ifndef MHC_SERVER_METRICS_HTTP_H_
#define MHC_SERVER_METRICS_HTTP_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "prometheus/exposer.h"

namespace mhc::server {

// Worker threads of the endpoint: each idle connection holds one for at
// most kMetricsRequestTimeout.
inline constexpr int kMetricsThreads = 64;
// How long a connection has to send its whole request.
inline constexpr absl::Duration kMetricsRequestTimeout = absl::Seconds(1);

// civetweb options for an endpoint on `listen` ("host:port").
std::vector<std::string> MetricsHttpOptions(const std::string& listen);

// Destroys `exposer`, listening on `host`:`port`, promptly: civetweb's
// accept loop only notices a stop between connections or every two
// seconds, so connections are made to it until it has stopped.
void StopMetricsHttp(std::unique_ptr<prometheus::Exposer> exposer,
                     const std::string& host, int port);

}  // namespace mhc::server

#endif  // MHC_SERVER_METRICS_HTTP_H_
