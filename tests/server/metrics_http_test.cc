// The metrics endpoint under idle connections over a real mhcd: connections
// that send a request line and then nothing must neither starve a scrape
// nor the readiness probe, and are closed by the daemon.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

constexpr int kIdleConnections = 200;
// Far above what the endpoint needs (about kIdleConnections / its threads
// x its request timeout), far below what it needed with civetweb's
// defaults (two threads, 30 s each).
constexpr absl::Duration kAnswerDeadline = absl::Seconds(25);

// A connection to 127.0.0.1:`port` that has sent only "GET /metrics
// HTTP/1.1\r\n"; -1 when it could not be made.
int OpenIdleConnection(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  const timeval limit = absl::ToTimeval(absl::Seconds(10));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  const std::string line = "GET /metrics HTTP/1.1\r\n";
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      write(fd, line.data(), line.size()) !=
          static_cast<ssize_t>(line.size())) {
    close(fd);
    return -1;
  }
  return fd;
}

// Whether the daemon closed `fd` (end of stream or reset) before `deadline`;
// whatever it wrote first (a 408 answer) is read past.
bool ClosedByPeer(int fd, absl::Time deadline) {
  char buffer[512];
  while (absl::Now() < deadline) {
    ssize_t got = read(fd, buffer, sizeof(buffer));
    if (got == 0) return true;
    if (got < 0) return errno == ECONNRESET;
  }
  return false;
}

TEST(MetricsHttpTest, IdleConnectionsStarveNeitherScrapesNorProbes) {
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start());
  ASSERT_GT(daemon->metrics_port(), 0) << daemon->Stdout();
  std::vector<int> idle;
  for (int i = 0; i < kIdleConnections; ++i) {
    int fd = OpenIdleConnection(daemon->metrics_port());
    ASSERT_GE(fd, 0) << "idle connection " << i << ": " << strerror(errno);
    idle.push_back(fd);
  }

  absl::Time start = absl::Now();
  absl::StatusOr<std::string> scrape =
      HttpGet(daemon->metrics_host(), daemon->metrics_port(), "/metrics",
              kAnswerDeadline);
  const absl::Duration scrape_time = absl::Now() - start;
  start = absl::Now();
  absl::StatusOr<std::string> ready =
      HttpGet(daemon->metrics_host(), daemon->metrics_port(), "/readyz",
              kAnswerDeadline);
  const absl::Duration ready_time = absl::Now() - start;
  std::cout << "with " << kIdleConnections << " idle connections: scrape in "
            << absl::FormatDuration(scrape_time) << ", /readyz in "
            << absl::FormatDuration(ready_time) << "\n";

  ASSERT_TRUE(scrape.ok()) << scrape.status();
  EXPECT_TRUE(absl::StrContains(*scrape, " 200 ")) << *scrape;
  EXPECT_TRUE(absl::StrContains(*scrape, "mhcd_build_info")) << *scrape;
  EXPECT_LT(scrape_time, kAnswerDeadline);
  ASSERT_TRUE(ready.ok()) << ready.status();
  EXPECT_TRUE(absl::StrContains(*ready, "ready")) << *ready;
  EXPECT_LT(ready_time, kAnswerDeadline);

  // The daemon ends the idle connections itself (request timeout).
  const absl::Time deadline = absl::Now() + kAnswerDeadline;
  EXPECT_TRUE(ClosedByPeer(idle.back(), deadline));
  for (int fd : idle) close(fd);
}

}  // namespace
}  // namespace mhc::testing
