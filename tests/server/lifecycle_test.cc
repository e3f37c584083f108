// Daemon lifecycle over a real mhcd: the in-flight limit, draining on
// SIGTERM, the Prometheus endpoint, and mhcctl end to end.
#include <signal.h>

#include <future>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

using client::HostTensor;
using client::ToTensorRef;

constexpr int kSlowN = 16;

// A slow request: a chain of Sinkhorn ops (n = 16, T = 1000, float64
// reference backend) where each op reads the previous op's output, sized
// from a measured single op so it runs about `seconds` on any machine.
class SlowBatch {
 public:
  static absl::StatusOr<v1::ExecuteRequest> Make(client::Client& c,
                                                 double seconds) {
    v1::CreateLayerRequest create = LayerRequest("slow", kSlowN, 1);
    create.mutable_spec()->set_sinkhorn_iterations(1000);
    if (auto info = c.CreateLayer(create); !info.ok()) return info.status();
    const int64_t probe_m = 32;
    v1::SinkhornRequest probe = Request(probe_m);
    absl::Time start = absl::Now();
    if (auto out = c.Sinkhorn(probe); !out.ok()) return out.status();
    double per_token = absl::ToDoubleSeconds(absl::Now() - start) / probe_m;
    const int ops = 128;
    int64_t m =
        std::max<int64_t>(1, static_cast<int64_t>(seconds / per_token / ops));
    v1::ExecuteRequest batch;
    for (int i = 0; i < ops; ++i) {
      v1::Op* op = batch.add_ops();
      op->set_id(absl::StrCat("s", i));
      *op->mutable_sinkhorn() = Request(m);
      if (i > 0) {
        op->mutable_sinkhorn()->mutable_logits()->Clear();
        op->mutable_sinkhorn()->mutable_logits()->set_ref(
            absl::StrCat("s", i - 1, ".h_res"));
      }
    }
    batch.add_fetch(absl::StrCat("s", ops - 1, ".h_res"));
    return batch;
  }

  static v1::SinkhornRequest Request(int64_t m) {
    v1::SinkhornRequest r;
    r.set_layer("slow");
    *r.mutable_logits() = ToTensorRef(RandomF32({m, kSlowN, kSlowN}, -2, 2));
    return r;
  }
};

TEST(ServerLifecycleTest, MaxInflightRejectsTheExcess) {
  MHC_ASSERT_OK_AND_ASSIGN(
      auto daemon, Daemon::Start({"--backend=reference", "--max_inflight=1"}));
  MHC_ASSERT_OK_AND_ASSIGN(auto slow_client, daemon->Connect());
  MHC_ASSERT_OK_AND_ASSIGN(auto client, daemon->Connect());
  MHC_ASSERT_OK(client->WaitForReady(absl::Seconds(10)));
  MHC_ASSERT_OK_AND_ASSIGN(v1::ExecuteRequest slow,
                           SlowBatch::Make(*client, 3.0));
  auto in_flight = std::async(
      std::launch::async, [&] { return slow_client->Execute(slow).status(); });
  absl::SleepFor(absl::Milliseconds(500));
  ASSERT_EQ(in_flight.wait_for(std::chrono::seconds(0)),
            std::future_status::timeout)
      << "the slow request finished too early to test the limit";
  absl::Status second = client->Sinkhorn(SlowBatch::Request(1)).status();
  EXPECT_EQ(second.code(), absl::StatusCode::kResourceExhausted) << second;
  MHC_ASSERT_OK(in_flight.get());
  // The slot is free again.
  MHC_ASSERT_OK(client->Sinkhorn(SlowBatch::Request(1)).status());
}

TEST(ServerLifecycleTest, SigtermDrainsInFlightRequests) {
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start({"--backend=reference",
                                                       "--drain_timeout=60s"}));
  MHC_ASSERT_OK_AND_ASSIGN(auto slow_client, daemon->Connect());
  MHC_ASSERT_OK_AND_ASSIGN(auto client, daemon->Connect());
  MHC_ASSERT_OK(client->WaitForReady(absl::Seconds(10)));
  MHC_ASSERT_OK_AND_ASSIGN(v1::ExecuteRequest slow,
                           SlowBatch::Make(*client, 3.0));
  auto in_flight = std::async(std::launch::async,
                              [&] { return slow_client->Execute(slow); });
  absl::SleepFor(absl::Milliseconds(500));
  ASSERT_EQ(in_flight.wait_for(std::chrono::seconds(0)),
            std::future_status::timeout);
  daemon->Signal(SIGTERM);
  absl::SleepFor(absl::Milliseconds(300));
  absl::Status late = client->Sinkhorn(SlowBatch::Request(1)).status();
  EXPECT_EQ(late.code(), absl::StatusCode::kUnavailable) << late;

  auto result = in_flight.get();
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->outputs_size(), 1);
  MHC_ASSERT_OK_AND_ASSIGN(
      HostTensor h_res,
      client::FromTensorRef(result->outputs().begin()->second));
  EXPECT_LE(client::MaxColumnSumError(h_res.ToFloats(), kSlowN), 1e-5);

  MHC_ASSERT_OK_AND_ASSIGN(int code, daemon->Wait(absl::Seconds(60)));
  EXPECT_EQ(code, 0);
  EXPECT_TRUE(absl::StrContains(daemon->Stdout(), "mhcd: drained"))
      << daemon->Stdout();
  EXPECT_FALSE(client->GetServerInfo().ok());
}

TEST(ServerLifecycleTest, MetricsCountRequestsByRpcAndCode) {
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start());
  ASSERT_GT(daemon->metrics_port(), 0) << daemon->Stdout();
  MHC_ASSERT_OK_AND_ASSIGN(auto client, daemon->Connect());
  MHC_ASSERT_OK(client->GetServerInfo().status());
  EXPECT_EQ(client->GetLayer("nope").status().code(),
            absl::StatusCode::kNotFound);
  MHC_ASSERT_OK_AND_ASSIGN(
      std::string response,
      HttpGet(daemon->metrics_host(), daemon->metrics_port(), "/metrics"));
  EXPECT_TRUE(absl::StartsWith(response, "HTTP/1.")) << response;
  EXPECT_TRUE(absl::StrContains(response, " 200 ")) << response;
  bool ok_line = false, not_found_line = false;
  for (absl::string_view line : absl::StrSplit(response, '\n')) {
    if (!absl::StartsWith(line, "mhcd_requests_total{")) continue;
    ok_line |= absl::StrContains(line, "GetServerInfo") &&
               absl::StrContains(line, "code=\"OK\"");
    not_found_line |= absl::StrContains(line, "GetLayer") &&
                      absl::StrContains(line, "code=\"NOT_FOUND\"");
  }
  EXPECT_TRUE(ok_line) << response;
  EXPECT_TRUE(not_found_line) << response;
}

// An idle ExecuteStream does not hold the exit: a drain ends a stream that
// waits for its next batch at once (a stream running a batch ends after
// it), and the daemon exits well within --drain_timeout.
TEST(ServerLifecycleTest, DrainEndsIdleStreams) {
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start({"--drain_timeout=30s"}));
  MHC_ASSERT_OK_AND_ASSIGN(auto client, daemon->Connect());
  MHC_ASSERT_OK(client->WaitForReady(absl::Seconds(10)));
  grpc::ClientContext context;
  auto stream = client->stub()->ExecuteStream(&context);
  // One batch, so that the stream is known to run before it idles.
  v1::ExecuteRequest empty;
  ASSERT_TRUE(stream->Write(empty));
  v1::ExecuteResponse answer;
  ASSERT_TRUE(stream->Read(&answer));

  const absl::Time start = absl::Now();
  daemon->Signal(SIGTERM);
  EXPECT_FALSE(stream->Read(&answer));
  const grpc::StatusCode ended = stream->Finish().error_code();
  EXPECT_TRUE(ended == grpc::StatusCode::CANCELLED ||
              ended == grpc::StatusCode::UNAVAILABLE)
      << ended;
  MHC_ASSERT_OK_AND_ASSIGN(int code, daemon->Wait(absl::Seconds(40)));
  EXPECT_EQ(code, 0);
  // Far under the drain timeout (generous for a loaded machine).
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

// A second daemon on a TCP port that is taken fails at start, saying which
// address, instead of sharing the port (and its connections) with the
// first.
TEST(ServerLifecycleTest, SecondDaemonOnATakenPortFailsAtStart) {
  MHC_ASSERT_OK_AND_ASSIGN(auto first, Daemon::Start({"--listen=127.0.0.1:0"}));
  std::string port;
  for (absl::string_view line : absl::StrSplit(first->Stdout(), '\n')) {
    if (absl::ConsumePrefix(&line, "mhcd: listening on 127.0.0.1:")) {
      port = std::string(line);
    }
  }
  ASSERT_FALSE(port.empty()) << first->Stdout();
  const std::string address = absl::StrCat("127.0.0.1:", port);
  // Bounded: a second daemon that does start would otherwise serve on.
  MHC_ASSERT_OK_AND_ASSIGN(
      auto second,
      RunCommand({"timeout", "20", MHC_MHCD_PATH, "--listen=" + address,
                  "--metrics_listen=", "--backend=cpu", "--threads=1"}));
  EXPECT_NE(second.first, 0) << second.second;
  EXPECT_FALSE(absl::StrContains(second.second, "mhcd: ready"))
      << second.second;
}

// --max_parameter_bytes bounds the layers' device memory together: a layer
// past it is refused, and deleting one makes room again.
TEST(ServerLifecycleTest, ParameterBytesBoundAllLayers) {
  // A deepseek_v4 layer with n = 4, C = 256 holds phi [24, 1024] and 27
  // more floats, twice (gradients): about 197 KB.
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon,
                           Daemon::Start({"--max_parameter_bytes=300000"}));
  MHC_ASSERT_OK_AND_ASSIGN(auto client, daemon->Connect());
  MHC_ASSERT_OK(client->CreateLayer(LayerRequest("a", 4, 256)).status());
  absl::Status refused =
      client->CreateLayer(LayerRequest("b", 4, 256)).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "--max_parameter_bytes"))
      << refused;
  MHC_ASSERT_OK_AND_ASSIGN(auto info, client->GetServerInfo());
  EXPECT_EQ(info.limits().max_parameter_bytes(), 300000u);
  MHC_ASSERT_OK(client->DeleteLayer("a").status());
  MHC_ASSERT_OK(client->CreateLayer(LayerRequest("b", 4, 256)).status());
  // A layer larger than the whole limit is refused on an empty daemon too.
  MHC_ASSERT_OK(client->DeleteLayer("b").status());
  EXPECT_EQ(client->CreateLayer(LayerRequest("c", 4, 1024)).status().code(),
            absl::StatusCode::kResourceExhausted);
}

// mhcctl's --help lists its flags and --version its version, both with exit
// code 0 (mhcd: --version).
TEST(ServerLifecycleTest, HelpAndVersionExitZero) {
  MHC_ASSERT_OK_AND_ASSIGN(auto mhcd, RunCommand({MHC_MHCD_PATH, "--version"}));
  EXPECT_EQ(mhcd.first, 0) << mhcd.second;
  EXPECT_TRUE(absl::StrContains(mhcd.second, "mhcd 0.")) << mhcd.second;
  for (const char* program : {MHC_MHCD_PATH, MHC_MHCCTL_PATH}) {
    MHC_ASSERT_OK_AND_ASSIGN(auto help, RunCommand({program, "--help"}));
    EXPECT_EQ(help.first, 0) << program << "\n" << help.second;
    EXPECT_TRUE(absl::StrContains(help.second, "--listen") ||
                absl::StrContains(help.second, "--address"))
        << program << "\n"
        << help.second;
    MHC_ASSERT_OK_AND_ASSIGN(auto version, RunCommand({program, "--version"}));
    EXPECT_EQ(version.first, 0) << program << "\n" << version.second;
    EXPECT_TRUE(absl::StrContains(version.second, "0.")) << program << "\n"
                                                         << version.second;
  }
}

TEST(ServerLifecycleTest, MhcctlCommands) {
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start());
  const std::string address = "--address=" + daemon->address();
  auto run = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {MHC_MHCCTL_PATH, address, "--json"});
    return RunCommand(args);
  };
  MHC_ASSERT_OK_AND_ASSIGN(auto result, run({"run", "--tokens=24",
                                             "--hidden=96", "--iterations=2"}));
  EXPECT_EQ(result.first, 0) << result.second;
  EXPECT_TRUE(absl::StrContains(result.second, "\"ok\":true")) << result.second;
  EXPECT_TRUE(absl::StrContains(result.second, "\"failed_checks\":0"));

  MHC_ASSERT_OK_AND_ASSIGN(
      result, run({"run", "--tokens=7", "--hidden=33", "--dtype=fp32",
                   "--f=identity", "--preset=transformer_engine"}));
  EXPECT_EQ(result.first, 0) << result.second;

  MHC_ASSERT_OK_AND_ASSIGN(result,
                           run({"layer", "create", "--name=cli", "--hidden=16",
                                "--sinkhorn_iterations=5"}));
  EXPECT_EQ(result.first, 0) << result.second;
  EXPECT_TRUE(absl::StrContains(result.second, "\"sinkhorn_iterations\":5"))
      << result.second;
  // run on an existing layer leaves it in place.
  MHC_ASSERT_OK_AND_ASSIGN(result, run({"run", "--layer=cli", "--tokens=4"}));
  EXPECT_EQ(result.first, 0) << result.second;
  MHC_ASSERT_OK_AND_ASSIGN(result, run({"layer", "list"}));
  EXPECT_TRUE(absl::StrContains(result.second, "\"cli\"")) << result.second;
  EXPECT_FALSE(absl::StrContains(result.second, "mhcctl-run-"))
      << "run did not delete its layer: " << result.second;
  MHC_ASSERT_OK_AND_ASSIGN(result, run({"layer", "show", "cli"}));
  EXPECT_EQ(result.first, 0);
  MHC_ASSERT_OK_AND_ASSIGN(result, run({"layer", "delete", "--name=cli"}));
  EXPECT_EQ(result.first, 0);
  MHC_ASSERT_OK_AND_ASSIGN(result, run({"layer", "show", "cli"}));
  EXPECT_EQ(result.first, 1);
  EXPECT_TRUE(absl::StrContains(result.second, "NOT_FOUND")) << result.second;
  MHC_ASSERT_OK_AND_ASSIGN(result, run({"info"}));
  EXPECT_EQ(result.first, 0);
  EXPECT_TRUE(absl::StrContains(result.second, "\"backend\":\"cpu\""))
      << result.second;
  MHC_ASSERT_OK_AND_ASSIGN(result, run({"health"}));
  EXPECT_EQ(result.first, 0);
  EXPECT_TRUE(absl::StrContains(result.second, "SERVING"));
}

}  // namespace
}  // namespace mhc::testing
