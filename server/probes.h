// Liveness and readiness over HTTP, on the metrics endpoint's port:
//
//   /healthz  200 "ok" while the process answers HTTP (liveness).
//   /readyz   200 "ready" while the daemon is SERVING and not draining,
//             else 503 with the reason (starting, draining, a failed
//             device): what a load balancer or orchestrator routes on.
//
// prometheus-cpp keeps its HTTP server private, so the probes are answered
// by a civetweb begin_request callback given to the Exposer, which finds
// the daemon's readiness by the port the request arrived on.
#ifndef MHC_SERVER_PROBES_H_
#define MHC_SERVER_PROBES_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

struct CivetCallbacks;

namespace mhc::server {

// Starts not ready ("starting").
class Readiness {
 public:
  void SetReady();
  void SetNotReady(std::string reason);
  // OK when ready, else UNAVAILABLE with the reason.
  absl::Status Check() const;

 private:
  mutable absl::Mutex mu_;
  bool ready_ ABSL_GUARDED_BY(mu_) = false;
  std::string reason_ ABSL_GUARDED_BY(mu_) = "starting";
};

// For prometheus::Exposer: answers the probes, leaves every other path to
// the exposer.
const CivetCallbacks* ProbeCallbacks();

// Routes probes arriving on `port` to `readiness` while it lives.
class ProbeRoute {
 public:
  ProbeRoute(int port, std::shared_ptr<const Readiness> readiness);
  ~ProbeRoute();
  ProbeRoute(const ProbeRoute&) = delete;
  ProbeRoute& operator=(const ProbeRoute&) = delete;

 private:
  const int port_;
};

}  // namespace mhc::server

#endif  // MHC_SERVER_PROBES_H_
