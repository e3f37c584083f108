// Soak: 64 clients send a mix of read-only requests to one CPU daemon at
// saturation (more clients than --max_inflight). Every answer must be OK
// and bit-identical to the same request answered to a single client, or
// RESOURCE_EXHAUSTED; the daemon's resident memory must stay flat after
// the warm-up.
//
// CI runs it for kDefaultDuration; longer runs:
//   server_soak_test --duration=30m
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

constexpr absl::Duration kDefaultDuration = absl::Seconds(24);
constexpr int kClients = 64;
constexpr int kMaxInflight = 16;
constexpr int kN = 4;
constexpr int64_t kHidden = 256;
constexpr int64_t kTokens = 32;

absl::Duration g_duration = kDefaultDuration;

// One request of the mix: calls the daemon and returns its answer.
struct Call {
  std::string name;
  std::function<absl::StatusOr<std::unique_ptr<google::protobuf::Message>>(
      client::Client&)>
      run;
};

template <typename Response>
absl::StatusOr<std::unique_ptr<google::protobuf::Message>> Boxed(
    absl::StatusOr<Response> response) {
  if (!response.ok()) return response.status();
  return std::make_unique<Response>(*std::move(response));
}

// Read-only requests (nothing accumulates gradients), so that an answer
// does not depend on what other clients did before it.
std::vector<Call> MakeMix() {
  std::vector<Call> mix;
  for (int layer = 0; layer < 2; ++layer) {
    const std::string name = absl::StrCat("soak", layer);
    v1::ProjectionRequest projection;
    projection.set_layer(name);
    *projection.mutable_x() =
        client::ToTensorRef(RandomF32({kTokens, kN, kHidden}));
    mix.push_back({absl::StrCat("Projection/", name), [projection](auto& c) {
                     return Boxed(c.Projection(projection));
                   }});
    v1::ProjectionBackwardRequest backward;
    backward.set_layer(name);
    *backward.mutable_x() = projection.x();
    *backward.mutable_dh() =
        client::ToTensorRef(RandomF32({kTokens, kN * kN + 2 * kN}));
    *backward.mutable_dmean_square() =
        client::ToTensorRef(RandomF32({kTokens}));
    backward.set_skip_parameter_gradients(true);
    mix.push_back(
        {absl::StrCat("ProjectionBackward/", name), [backward](auto& c) {
           return Boxed(c.ProjectionBackward(backward));
         }});
    v1::SinkhornRequest sinkhorn;
    sinkhorn.set_layer(name);
    *sinkhorn.mutable_logits() =
        client::ToTensorRef(RandomF32({kTokens, kN, kN}, -2, 2));
    mix.push_back({absl::StrCat("Sinkhorn/", name), [sinkhorn](auto& c) {
                     return Boxed(c.Sinkhorn(sinkhorn));
                   }});
    // A batch whose second op reads the first one's output.
    v1::ExecuteRequest batch;
    v1::Op* first = batch.add_ops();
    first->set_id("s0");
    *first->mutable_sinkhorn() = sinkhorn;
    v1::Op* second = batch.add_ops();
    second->set_id("s1");
    *second->mutable_sinkhorn() = sinkhorn;
    second->mutable_sinkhorn()->mutable_logits()->Clear();
    second->mutable_sinkhorn()->mutable_logits()->set_ref("s0.h_res");
    batch.add_fetch("s1.h_res");
    mix.push_back({absl::StrCat("Execute/", name),
                   [batch](auto& c) { return Boxed(c.Execute(batch)); }});
    mix.push_back({absl::StrCat("GetParameters/", name),
                   [name](auto& c) { return Boxed(c.GetParameters(name)); }});
  }
  return mix;
}

// VmRSS of `pid` in bytes; 0 when it cannot be read.
int64_t ResidentBytes(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, "VmRSS:")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    absl::ConsumeSuffix(&rest, " kB");
    int64_t kib = 0;
    if (absl::SimpleAtoi(rest, &kib)) return kib << 10;
  }
  return 0;
}

struct Tally {
  absl::Mutex mu;
  int64_t ok ABSL_GUARDED_BY(mu) = 0;
  int64_t exhausted ABSL_GUARDED_BY(mu) = 0;
  int64_t errors ABSL_GUARDED_BY(mu) = 0;
  int64_t mismatches ABSL_GUARDED_BY(mu) = 0;
  std::string first_problem ABSL_GUARDED_BY(mu);

  void Problem(int64_t& counter, std::string what) {
    absl::MutexLock lock(&mu);
    ++counter;
    if (first_problem.empty()) first_problem = std::move(what);
  }
};

TEST(SoakTest, MixedClientsAtSaturation) {
  MHC_ASSERT_OK_AND_ASSIGN(
      auto daemon,
      Daemon::Start({absl::StrCat("--max_inflight=", kMaxInflight)}));
  MHC_ASSERT_OK_AND_ASSIGN(auto setup, daemon->Connect());
  MHC_ASSERT_OK(setup->WaitForReady(absl::Seconds(30)));
  for (int layer = 0; layer < 2; ++layer) {
    v1::CreateLayerRequest create =
        LayerRequest(absl::StrCat("soak", layer), kN, kHidden);
    create.set_seed(11 + layer);
    MHC_ASSERT_OK(setup->CreateLayer(create).status());
  }
  const std::vector<Call> mix = MakeMix();

  // What a single client gets.
  std::vector<std::unique_ptr<google::protobuf::Message>> expected;
  for (const Call& call : mix) {
    auto answer = call.run(*setup);
    ASSERT_TRUE(answer.ok()) << call.name << ": " << answer.status();
    expected.push_back(*std::move(answer));
  }

  Tally tally;
  std::atomic<bool> stop{false};
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
    clients.emplace_back([c = std::shared_ptr<client::Client>(std::move(c)), i,
                          &mix, &expected, &tally, &stop] {
      for (size_t k = static_cast<size_t>(i); !stop.load(); ++k) {
        const size_t which = k % mix.size();
        auto answer = mix[which].run(*c);
        if (answer.ok()) {
          if (!google::protobuf::util::MessageDifferencer::Equals(
                  **answer, *expected[which])) {
            tally.Problem(tally.mismatches,
                          absl::StrCat(mix[which].name, ": answer differs"));
          } else {
            absl::MutexLock lock(&tally.mu);
            ++tally.ok;
          }
        } else if (answer.status().code() ==
                   absl::StatusCode::kResourceExhausted) {
          {
            absl::MutexLock lock(&tally.mu);
            ++tally.exhausted;
          }
          // Refused at once: give the admitted ones room instead of spinning.
          absl::SleepFor(absl::Milliseconds(1));
        } else {
          tally.Problem(tally.errors, absl::StrCat(mix[which].name, ": ",
                                                   answer.status().ToString()));
        }
      }
    });
  }

  // Resident memory: the peak of the warm-up (the first third) against the
  // peak of the rest.
  const absl::Time start = absl::Now();
  const absl::Time warm_end = start + g_duration / 3;
  const absl::Time end = start + g_duration;
  int64_t warm_peak = 0, later_peak = 0, last = 0;
  while (absl::Now() < end) {
    last = ResidentBytes(daemon->pid());
    int64_t& peak = absl::Now() < warm_end ? warm_peak : later_peak;
    peak = std::max(peak, last);
    absl::SleepFor(absl::Milliseconds(200));
  }
  stop.store(true);
  for (std::thread& t : clients) t.join();

  absl::MutexLock lock(&tally.mu);
  std::cout << "soak " << absl::FormatDuration(g_duration) << ": " << tally.ok
            << " OK, " << tally.exhausted << " RESOURCE_EXHAUSTED; RSS peak "
            << (warm_peak >> 20) << " MiB warm-up, " << (later_peak >> 20)
            << " MiB after, " << (last >> 20) << " MiB at the end\n";
  EXPECT_EQ(tally.errors, 0) << tally.first_problem;
  EXPECT_EQ(tally.mismatches, 0) << tally.first_problem;
  EXPECT_GT(tally.ok, static_cast<int64_t>(mix.size()));
  EXPECT_GT(tally.exhausted, 0) << "the clients did not saturate the daemon";
  ASSERT_GT(warm_peak, 0) << "could not read VmRSS";
  // Flat: allocator noise only, no growth with the number of requests.
  const int64_t allowance =
      std::max<int64_t>(int64_t{16} << 20, warm_peak / 10);
  EXPECT_LE(later_peak, warm_peak + allowance)
      << "resident memory grew after the warm-up";
}

}  // namespace
}  // namespace mhc::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (!absl::ConsumePrefix(&arg, "--duration=")) continue;
    if (!absl::ParseDuration(arg, &mhc::testing::g_duration) ||
        mhc::testing::g_duration <= absl::ZeroDuration()) {
      std::cerr << "--duration: expected a duration like 90s or 30m\n";
      return 2;
    }
  }
  return RUN_ALL_TESTS();
}
