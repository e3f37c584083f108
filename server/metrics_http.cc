#include "server/metrics_http.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace mhc::server {
namespace {

// Where to connect to reach a server bound to `host`: a wildcard bind is
// reached on loopback.
std::string ConnectHost(absl::string_view host) {
  if (absl::ConsumePrefix(&host, "[")) absl::ConsumeSuffix(&host, "]");
  if (host.empty() || host == "0.0.0.0") return "127.0.0.1";
  if (host == "::") return "::1";
  return std::string(host);
}

// Opens and closes one connection; failures are ignored (the server may
// have closed its socket already).
void Poke(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), absl::StrCat(port).c_str(), &hints, &found) !=
      0) {
    return;
  }
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const bool connected = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
    close(fd);
    if (connected) break;
  }
  freeaddrinfo(found);
}

}  // namespace

std::vector<std::string> MetricsHttpOptions(const std::string& listen) {
  const std::string timeout_ms =
      absl::StrCat(absl::ToInt64Milliseconds(kMetricsRequestTimeout));
  return {
      "listening_ports",
      listen,
      "num_threads",
      absl::StrCat(kMetricsThreads),
      // The whole request (line and headers) must arrive in this time.
      "request_timeout_ms",
      timeout_ms,
      // One request per connection, so nothing idles between requests.
      "enable_keep_alive",
      "no",
  };
}

void StopMetricsHttp(std::unique_ptr<prometheus::Exposer> exposer,
                     const std::string& host, int port) {
  if (exposer == nullptr) return;
  std::atomic<bool> stopped{false};
  std::thread waker([&stopped, target = ConnectHost(host), port] {
    while (!stopped.load()) {
      Poke(target, port);
      absl::SleepFor(absl::Milliseconds(50));
    }
  });
  exposer.reset();
  stopped.store(true);
  waker.join();
}

}  // namespace mhc::server
