// Draining under load over a real mhcd: client threads hammering unary
// compute calls, idle shared-memory sessions and idle ExecuteStreams, then
// SIGTERM. The daemon must exit within --drain_timeout + 1 s and every unary
// call must end OK (it ran) or UNAVAILABLE (it was turned away), never
// CANCELLED or anything else.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "mhc/client/shm.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

constexpr int kN = 4;
constexpr int kHammerThreads = 24;
constexpr int kIdleSessions = 4;
constexpr int kIdleStreams = 4;

v1::SinkhornRequest SinkhornCall(int64_t tokens) {
  v1::SinkhornRequest request;
  request.set_layer("load");
  *request.mutable_logits() =
      client::ToTensorRef(RandomF32({tokens, kN, kN}, -2, 2));
  return request;
}

// Status codes of every unary call, counted across threads.
class Outcomes {
 public:
  void Add(absl::StatusCode code, const std::string& message) {
    absl::MutexLock lock(&mu_);
    ++counts_[code];
    if (code != absl::StatusCode::kOk &&
        code != absl::StatusCode::kUnavailable && first_unexpected_.empty()) {
      first_unexpected_ = absl::StrCat(CodeName(code), ": ", message);
    }
  }
  int Count(absl::StatusCode code) {
    absl::MutexLock lock(&mu_);
    return counts_[code];
  }
  int Unexpected() {
    absl::MutexLock lock(&mu_);
    int total = 0;
    for (const auto& [code, count] : counts_) {
      if (code != absl::StatusCode::kOk &&
          code != absl::StatusCode::kUnavailable) {
        total += count;
      }
    }
    return total;
  }
  std::string FirstUnexpected() {
    absl::MutexLock lock(&mu_);
    return first_unexpected_;
  }

 private:
  absl::Mutex mu_;
  std::map<absl::StatusCode, int> counts_ ABSL_GUARDED_BY(mu_);
  std::string first_unexpected_ ABSL_GUARDED_BY(mu_);
};

// SIGTERM while `kHammerThreads` threads call Sinkhorn over `tokens`
// tokens back to back, next to idle sessions and streams.
void DrainUnderLoad(absl::Duration drain_timeout, int64_t tokens) {
  MHC_ASSERT_OK_AND_ASSIGN(
      auto daemon,
      Daemon::Start({absl::StrCat("--drain_timeout=",
                                  absl::FormatDuration(drain_timeout)),
                     "--max_inflight=256", "--allow_shm"}));
  MHC_ASSERT_OK_AND_ASSIGN(auto setup, daemon->Connect());
  MHC_ASSERT_OK(setup->WaitForReady(absl::Seconds(30)));
  MHC_ASSERT_OK(setup->CreateLayer(LayerRequest("load", kN, 64)).status());

  // Idle sessions and streams, each on its own connection; none of them
  // reads again after its first answer.
  std::vector<std::unique_ptr<client::Client>> idle_clients;
  std::vector<std::unique_ptr<client::Session>> sessions;
  for (int i = 0; i < kIdleSessions; ++i) {
    MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
    MHC_ASSERT_OK_AND_ASSIGN(auto session, client::Session::Open(*c));
    sessions.push_back(std::move(session));
    idle_clients.push_back(std::move(c));
  }
  std::vector<std::unique_ptr<grpc::ClientContext>> stream_contexts;
  std::vector<std::unique_ptr<
      grpc::ClientReaderWriter<v1::ExecuteRequest, v1::ExecuteResponse>>>
      streams;
  for (int i = 0; i < kIdleStreams; ++i) {
    MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
    stream_contexts.push_back(std::make_unique<grpc::ClientContext>());
    streams.push_back(c->stub()->ExecuteStream(stream_contexts.back().get()));
    ASSERT_TRUE(streams.back()->Write(v1::ExecuteRequest()));
    v1::ExecuteResponse answer;
    ASSERT_TRUE(streams.back()->Read(&answer));
    idle_clients.push_back(std::move(c));
  }

  // Each hammer thread has its own connection and calls until the daemon
  // is gone (a few calls after the first refusal are enough).
  Outcomes outcomes;
  std::atomic<int> started{0};
  std::vector<std::thread> hammers;
  for (int t = 0; t < kHammerThreads; ++t) {
    MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
    hammers.emplace_back([c = std::shared_ptr<client::Client>(std::move(c)),
                          &outcomes, &started, tokens] {
      const v1::SinkhornRequest request = SinkhornCall(tokens);
      int refusals = 0;
      bool counted = false;
      while (refusals < 20) {
        absl::Status status = c->Sinkhorn(request).status();
        outcomes.Add(status.code(), std::string(status.message()));
        if (status.ok() && !counted) {
          counted = true;
          started.fetch_add(1);
        }
        if (!status.ok()) ++refusals;
      }
    });
  }
  // Every thread has had a call through: the daemon is saturated.
  const absl::Time warm_deadline = absl::Now() + absl::Seconds(60);
  while (started.load() < kHammerThreads && absl::Now() < warm_deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(started.load(), kHammerThreads);

  const absl::Time signalled = absl::Now();
  daemon->Signal(SIGTERM);
  absl::StatusOr<int> code = daemon->Wait(absl::Seconds(60));
  const absl::Duration exit_time = absl::Now() - signalled;
  for (std::thread& hammer : hammers) hammer.join();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << daemon->Stdout();
  std::cout << "exit " << absl::FormatDuration(exit_time) << " after SIGTERM; "
            << outcomes.Count(absl::StatusCode::kOk) << " OK, "
            << outcomes.Count(absl::StatusCode::kUnavailable)
            << " UNAVAILABLE\n";
  EXPECT_LT(exit_time, drain_timeout + absl::Seconds(1));
  EXPECT_EQ(outcomes.Unexpected(), 0) << outcomes.FirstUnexpected();
  EXPECT_GT(outcomes.Count(absl::StatusCode::kOk), kHammerThreads);

  // The idle streams and sessions were ended by the daemon, not left open.
  for (auto& stream : streams) {
    v1::ExecuteResponse answer;
    EXPECT_FALSE(stream->Read(&answer));
    EXPECT_FALSE(stream->Finish().ok());
  }
  for (auto& session : sessions) session->Close().IgnoreError();
}

// A C++ client process that holds a session and never reads its stream
// again (shm_peer hold) does not hold the exit for --drain_timeout: its
// connection is cut shortly after the drain has ended every call.
TEST(DrainTest, SessionOfAClientThatNeverReadsDoesNotHoldTheExit) {
  MHC_ASSERT_OK_AND_ASSIGN(
      auto daemon, Daemon::Start({"--drain_timeout=30s", "--allow_shm"}));
  MHC_ASSERT_OK_AND_ASSIGN(
      HoldingPeer peer, StartHoldingPeer(MHC_SHM_PEER_PATH, daemon->address()));

  const absl::Time signalled = absl::Now();
  daemon->Signal(SIGTERM);
  absl::StatusOr<int> code = daemon->Wait(absl::Seconds(60));
  const absl::Duration exit_time = absl::Now() - signalled;
  close(peer.stdin_fd);  // the peer exits once its stdin closes
  waitpid(peer.pid, nullptr, 0);
  shm_unlink(absl::StrCat("/", peer.shm_key).c_str());
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  std::cout << "exit " << absl::FormatDuration(exit_time)
            << " after SIGTERM with a session that is never read\n";
  // The drain takes well under a second; without the short connection
  // grace the exit waited for the client's channel to be polled (about
  // 5 s, gRPC's backup poller) or for --drain_timeout.
  EXPECT_LT(exit_time, absl::Seconds(3));
}

// The queued work finishes well within the drain timeout.
TEST(DrainTest, ExitsInTimeUnderLoadWithIdleStreamsAndSessions) {
  DrainUnderLoad(absl::Seconds(5), 2048);
}

// The queue holds more work than the drain timeout allows: what has not
// started by then is refused with UNAVAILABLE, never cancelled.
TEST(DrainTest, ExitsInTimeWhenTheQueueOutlastsTheTimeout) {
  DrainUnderLoad(absl::Seconds(1), 8192);
}

}  // namespace
}  // namespace mhc::testing
