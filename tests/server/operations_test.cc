// What operators and orchestrators rely on: the HTTP probes, the
// conventional gRPC server metrics, request ids and the log formats
// (--help/--version: lifecycle_test.cc).
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "server/log.h"
#include "server/metrics.h"
#include "server/rpc_observer.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

TEST(OperationsTest, BadLogFlagsStopTheStart) {
  MHC_ASSERT_OK_AND_ASSIGN(
      auto format, RunCommand({MHC_MHCD_PATH, "--log_format=xml",
                               "--listen=127.0.0.1:0", "--metrics_listen="}));
  EXPECT_EQ(format.first, 1);
  MHC_ASSERT_OK_AND_ASSIGN(
      auto requests, RunCommand({MHC_MHCD_PATH, "--log_requests=some",
                                 "--listen=127.0.0.1:0", "--metrics_listen="}));
  EXPECT_EQ(requests.first, 1);
}

// The probes answer from the metrics endpoint, readiness as the daemon
// sets it.
TEST(OperationsTest, ReadyzFollowsReadiness) {
  server::Metrics metrics(server::BuildInfo{"0", "test", "cpu", "none"});
  MHC_ASSERT_OK_AND_ASSIGN(std::string address, metrics.Serve("127.0.0.1:0"));
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  auto get = [port](const std::string& path) {
    absl::StatusOr<std::string> response = HttpGet("127.0.0.1", port, path);
    return response.ok() ? *response : response.status().ToString();
  };
  EXPECT_TRUE(absl::StartsWith(get("/healthz"), "HTTP/1.1 200"));
  std::string starting = get("/readyz");
  EXPECT_TRUE(absl::StartsWith(starting, "HTTP/1.1 503")) << starting;
  EXPECT_TRUE(absl::StrContains(starting, "not ready: starting")) << starting;
  metrics.readiness().SetReady();
  std::string ready = get("/readyz");
  EXPECT_TRUE(absl::StartsWith(ready, "HTTP/1.1 200")) << ready;
  EXPECT_TRUE(absl::EndsWith(ready, "ready\n")) << ready;
  metrics.readiness().SetNotReady("draining");
  std::string draining = get("/readyz");
  EXPECT_TRUE(absl::StartsWith(draining, "HTTP/1.1 503")) << draining;
  EXPECT_TRUE(absl::StrContains(draining, "draining")) << draining;
  // The exposer still serves its own path.
  EXPECT_TRUE(absl::StrContains(get("/metrics"), "mhcd_build_info"));
}

// GetLayer of a layer that does not exist, with the client's request id;
// returns the id the daemon sent back.
std::string FailedGetLayer(client::Client& client, const std::string& id) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  if (!id.empty()) context.AddMetadata("x-request-id", id);
  v1::GetLayerRequest request;
  request.set_name("missing");
  v1::LayerInfo response;
  grpc::Status status = client.stub()->GetLayer(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  auto trailer = context.GetServerTrailingMetadata().find("x-request-id");
  if (trailer == context.GetServerTrailingMetadata().end()) return "";
  return std::string(trailer->second.data(), trailer->second.size());
}

// Waits up to 10 s for a line of the daemon's output that has every part.
std::string AwaitLine(const Daemon& daemon,
                      const std::vector<std::string>& parts) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    for (absl::string_view line : absl::StrSplit(daemon.Stdout(), '\n')) {
      bool all = true;
      for (const std::string& part : parts) {
        all = all && absl::StrContains(line, part);
      }
      if (all) return std::string(line);
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return "";
}

TEST(OperationsTest, DaemonServesProbesAndGrpcMetrics) {
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start({}, true));
  MHC_ASSERT_OK_AND_ASSIGN(
      std::string ready,
      HttpGet(daemon->metrics_host(), daemon->metrics_port(), "/readyz"));
  EXPECT_TRUE(absl::StartsWith(ready, "HTTP/1.1 200")) << ready;
  MHC_ASSERT_OK_AND_ASSIGN(auto client, daemon->Connect());
  MHC_ASSERT_OK(client->GetServerInfo().status());
  EXPECT_EQ(FailedGetLayer(*client, "op-test-1"), "op-test-1");
  // An id that is not a token is replaced by the daemon's own.
  const std::string fresh = FailedGetLayer(*client, "bad id!");
  EXPECT_EQ(fresh.size(), 16u) << fresh;

  MHC_ASSERT_OK_AND_ASSIGN(
      std::string scrape,
      HttpGet(daemon->metrics_host(), daemon->metrics_port(), "/metrics"));
  const std::vector<std::string> get_layer = {"grpc_service=\"mhc.v1.Mhc\"",
                                              "grpc_method=\"GetLayer\"",
                                              "grpc_type=\"unary\""};
  EXPECT_EQ(MetricSample(scrape, "grpc_server_started_total{", get_layer), 2);
  std::vector<std::string> not_found = get_layer;
  not_found.push_back("grpc_code=\"NOT_FOUND\"");
  EXPECT_EQ(MetricSample(scrape, "grpc_server_handled_total{", not_found), 2);
  EXPECT_EQ(MetricSample(scrape, "grpc_server_handled_total{",
                         {"grpc_method=\"GetServerInfo\"", "grpc_code=\"OK\""}),
            1);
  EXPECT_EQ(
      MetricSample(scrape, "grpc_server_handling_seconds_count{", get_layer),
      2);
  // The default --log_requests=failed: a text line for each failure, none
  // for the success.
  EXPECT_NE(AwaitLine(*daemon, {"mhcd: request request_id=op-test-1",
                                "grpc_method=GetLayer", "grpc_code=NOT_FOUND"}),
            "")
      << daemon->Stdout();
  // Lines are written before the status is sent, so all are out by now.
  EXPECT_FALSE(absl::StrContains(daemon->Stdout(), "grpc_method=GetServer"))
      << daemon->Stdout();
}

TEST(OperationsTest, JsonLogsCarryTimeLevelAndRequestIds) {
  MHC_ASSERT_OK_AND_ASSIGN(
      auto daemon,
      Daemon::Start({"--log_format=json", "--log_requests=all"}, true));
  ASSERT_NE(daemon->metrics_port(), 0) << daemon->Stdout();
  MHC_ASSERT_OK_AND_ASSIGN(auto client, daemon->Connect());
  MHC_ASSERT_OK(client->GetServerInfo().status());
  FailedGetLayer(*client, "json-1");
  const std::string failure = AwaitLine(*daemon, {"\"request_id\":\"json-1\""});
  EXPECT_TRUE(absl::StrContains(failure, "\"level\":\"warning\"")) << failure;
  EXPECT_TRUE(absl::StrContains(failure, "\"grpc_code\":\"NOT_FOUND\""))
      << failure;
  EXPECT_TRUE(absl::StrContains(failure, "\"error\":\"")) << failure;
  const std::string success =
      AwaitLine(*daemon, {"\"grpc_method\":\"GetServerInfo\""});
  EXPECT_TRUE(absl::StrContains(success, "\"level\":\"info\"")) << success;
  // Every line is one object with time, level and msg first.
  for (absl::string_view line :
       absl::StrSplit(daemon->Stdout(), '\n', absl::SkipEmpty())) {
    EXPECT_TRUE(absl::StartsWith(line, "{\"time\":\"") &&
                absl::StrContains(line, "\",\"level\":\"") &&
                absl::StrContains(line, ",\"msg\":\"") &&
                absl::EndsWith(line, "}"))
        << line;
  }
}

TEST(OperationsTest, LogLinesEscapeTheirValues) {
  const std::vector<server::LogField> fields = {
      {"error", "say \"no\"\nnow"}, {"seconds", 0.25}, {"id", "a-1"}};
  EXPECT_EQ(
      server::FormatLogLine(server::LogFormat::kText,
                            server::LogLevel::kWarning, "request", fields),
      "mhcd: request error=\"say \\\"no\\\"\\nnow\" seconds=0.25 id=a-1");
  const std::string json = server::FormatLogLine(
      server::LogFormat::kJson, server::LogLevel::kWarning, "request", fields);
  EXPECT_TRUE(absl::EndsWith(
      json,
      "\"level\":\"warning\",\"msg\":\"request\",\"error\":\"say "
      "\\\"no\\\"\\nnow\",\"seconds\":0.25,\"id\":\"a-1\"}"))
      << json;
  EXPECT_EQ(server::RequestId("abc.DEF_1:2-3"), "abc.DEF_1:2-3");
  EXPECT_EQ(server::RequestId(std::string(129, 'a')).size(), 16u);
  EXPECT_NE(server::RequestId(""), server::RequestId(""));
}

}  // namespace
}  // namespace mhc::testing
