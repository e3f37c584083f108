#include "server/probes.h"

#include <cstring>
#include <utility>

#include "CivetServer.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "civetweb.h"

namespace mhc::server {

namespace {

// Port -> readiness of the daemon whose metrics endpoint listens there.
// Several daemons may live in one process (tests), each on its own port.
struct Routes {
  absl::Mutex mu;
  absl::flat_hash_map<int, std::shared_ptr<const Readiness>> by_port
      ABSL_GUARDED_BY(mu);
};

Routes& AllRoutes() {
  static Routes* routes = new Routes;
  return *routes;
}

int Reply(mg_connection* connection, int code, const char* reason,
          const std::string& body) {
  mg_printf(connection,
            "HTTP/1.1 %d %s\r\n"
            "Content-Type: text/plain; charset=utf-8\r\n"
            "Cache-Control: no-store\r\n"
            "Content-Length: %zu\r\n"
            "Connection: close\r\n\r\n",
            code, reason, body.size());
  mg_write(connection, body.data(), body.size());
  return code;
}

int BeginRequest(mg_connection* connection) {
  const mg_request_info* request = mg_get_request_info(connection);
  if (request == nullptr || request->local_uri == nullptr) return 0;
  const bool liveness = std::strcmp(request->local_uri, "/healthz") == 0;
  const bool readiness = std::strcmp(request->local_uri, "/readyz") == 0;
  if (!liveness && !readiness) return 0;
  if (liveness) return Reply(connection, 200, "OK", "ok\n");
  absl::Status ready = absl::UnavailableError("starting");
  {
    Routes& routes = AllRoutes();
    absl::MutexLock lock(&routes.mu);
    auto it = routes.by_port.find(request->server_port);
    if (it != routes.by_port.end()) ready = it->second->Check();
  }
  if (ready.ok()) return Reply(connection, 200, "OK", "ready\n");
  return Reply(connection, 503, "Service Unavailable",
               absl::StrCat("not ready: ", ready.message(), "\n"));
}

}  // namespace

void Readiness::SetReady() {
  absl::MutexLock lock(&mu_);
  ready_ = true;
  reason_.clear();
}

void Readiness::SetNotReady(std::string reason) {
  absl::MutexLock lock(&mu_);
  ready_ = false;
  reason_ = std::move(reason);
}

absl::Status Readiness::Check() const {
  absl::MutexLock lock(&mu_);
  return ready_ ? absl::OkStatus() : absl::UnavailableError(reason_);
}

const CivetCallbacks* ProbeCallbacks() {
  static const CivetCallbacks* callbacks = [] {
    auto* c = new CivetCallbacks;  // all callbacks unset
    c->begin_request = BeginRequest;
    return c;
  }();
  return callbacks;
}

ProbeRoute::ProbeRoute(int port, std::shared_ptr<const Readiness> readiness)
    : port_(port) {
  Routes& routes = AllRoutes();
  absl::MutexLock lock(&routes.mu);
  routes.by_port[port_] = std::move(readiness);
}

ProbeRoute::~ProbeRoute() {
  Routes& routes = AllRoutes();
  absl::MutexLock lock(&routes.mu);
  routes.by_port.erase(port_);
}

}  // namespace mhc::server
