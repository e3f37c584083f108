// Metrics and the determinism audit of the real daemon: what a scrape
// contains after real work, and that the audit re-runs real kernels without
// disturbing results or gradients.
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

TEST(ObservabilityTest, AuditedDaemonReportsKernelsAndDeterminism) {
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon,
                           Daemon::Start({"--determinism_audit_rate=1",
                                          "--batch_invariance_audit_rate=1"}));
  // mhcctl run checks every output and parameter gradient against the
  // float64 reference: a re-run that leaked into the gradients fails it.
  MHC_ASSERT_OK_AND_ASSIGN(
      auto result,
      RunCommand({MHC_MHCCTL_PATH, "--address=" + daemon->address(), "--json",
                  "run", "--tokens=9", "--hidden=40", "--iterations=2"}));
  ASSERT_EQ(result.first, 0) << result.second;

  MHC_ASSERT_OK_AND_ASSIGN(auto client, daemon->Connect());
  MHC_ASSERT_OK_AND_ASSIGN(auto report, client->GetDeterminismReport());
  EXPECT_EQ(report.determinism_audit_rate(), 1.0);
  EXPECT_EQ(report.batch_invariance_audit_rate(), 1.0);
  EXPECT_EQ(report.recent_mismatches_size(), 0) << report.DebugString();
  int replay = 0, batch = 0;
  for (const auto& check : report.checks()) {
    EXPECT_EQ(check.mismatches(), 0u) << check.DebugString();
    EXPECT_EQ(check.matches(), 2u) << check.DebugString();  // 2 iterations
    replay += check.check() == "replay";
    batch += check.check() == "batch_invariance";
  }
  // pre and post, forward and backward.
  EXPECT_EQ(replay, 4) << report.DebugString();
  EXPECT_EQ(batch, 4) << report.DebugString();

  MHC_ASSERT_OK_AND_ASSIGN(
      std::string scrape,
      HttpGet(daemon->metrics_host(), daemon->metrics_port(), "/metrics"));
  EXPECT_EQ(
      MetricSample(scrape, "mhcd_kernel_duration_seconds_count{",
                   {"op=\"pre\"", "direction=\"forward\"", "dtype=\"bf16\"",
                    "n=\"4\"", "device=\"cpu\"", "variant=\"default\""}),
      2);
  EXPECT_EQ(MetricSample(scrape, "mhcd_kernel_tokens_sum{",
                         {"op=\"post\"", "direction=\"backward\""}),
            18);
  EXPECT_GT(MetricSample(scrape, "mhcd_kernel_bytes_total{", {"op=\"pre\""}),
            0);
  EXPECT_GT(MetricSample(scrape, "mhcd_kernel_roofline_ratio_count{", {}), 0);
  EXPECT_GT(
      MetricSample(scrape, "mhcd_device_copy_bandwidth_bytes_per_second{", {}),
      1e8);
  EXPECT_EQ(MetricSample(scrape, "mhcd_determinism_checks_total{",
                         {"op=\"pre\"", "direction=\"backward\"",
                          "check=\"batch_invariance\"", "result=\"match\""}),
            2);
  EXPECT_EQ(MetricSample(scrape, "mhcd_determinism_checks_total{",
                         {"op=\"pre\"", "result=\"mismatch\""}),
            0);
  EXPECT_EQ(MetricSample(
                scrape, "mhcd_determinism_last_mismatch_timestamp_seconds", {}),
            0);
  EXPECT_GT(MetricSample(scrape, "mhcd_queue_wait_seconds_count{", {}), 0);
  EXPECT_GT(MetricSample(scrape, "mhcd_workspace_bytes{", {}), 0);
  EXPECT_EQ(MetricSample(scrape, "mhcd_shm_regions{", {"kind=\"system\""}), 0);
  // A cpu daemon reads host memory in place: nothing staged, nothing locked.
  EXPECT_EQ(MetricSample(scrape, "mhcd_staging_bytes{", {"device=\"cpu\""}), 0);
  EXPECT_EQ(MetricSample(scrape, "mhcd_shm_pinned_regions", {}), 0);
  EXPECT_EQ(MetricSample(scrape, "mhcd_shm_pinned_bytes", {}), 0);
  EXPECT_EQ(MetricSample(scrape, "mhcd_shm_pin_failures_total", {}), 0);
  EXPECT_EQ(MetricSample(scrape, "mhcd_build_info{",
                         {"backend=\"cpu\"", "commit=\"", "cuda_version=\""}),
            1);
  EXPECT_GT(MetricSample(scrape, "process_cpu_seconds_total", {}), 0);
  EXPECT_GT(MetricSample(scrape, "process_resident_memory_bytes", {}), 1e6);
  EXPECT_GT(MetricSample(scrape, "process_open_fds", {}), 2);
  EXPECT_GT(MetricSample(scrape, "process_start_time_seconds", {}), 1.7e9);
}

TEST(ObservabilityTest, LayerMemoryFollowsLayers) {
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start());
  MHC_ASSERT_OK_AND_ASSIGN(auto client, daemon->Connect());
  v1::CreateLayerRequest request;
  request.set_name("l1");
  request.mutable_spec()->set_n(4);
  request.mutable_spec()->set_hidden(8);
  MHC_ASSERT_OK(client->CreateLayer(request).status());
  MHC_ASSERT_OK_AND_ASSIGN(
      std::string scrape,
      HttpGet(daemon->metrics_host(), daemon->metrics_port(), "/metrics"));
  EXPECT_EQ(MetricSample(scrape, "mhcd_layers{", {"device=\"cpu\""}), 1);
  // phi [24, 32] + alpha 3 + beta 24 floats, and as many gradients.
  EXPECT_EQ(MetricSample(scrape, "mhcd_parameter_bytes{", {}),
            4 * (24 * 32 + 27));
  EXPECT_EQ(MetricSample(scrape, "mhcd_gradient_bytes{", {}),
            4 * (24 * 32 + 27));
  MHC_ASSERT_OK(client->DeleteLayer("l1").status());
  MHC_ASSERT_OK_AND_ASSIGN(scrape, HttpGet(daemon->metrics_host(),
                                           daemon->metrics_port(), "/metrics"));
  EXPECT_EQ(MetricSample(scrape, "mhcd_layers{", {}), 0);
  EXPECT_EQ(MetricSample(scrape, "mhcd_parameter_bytes{", {}), 0);

  // Without the audit flags nothing is checked.
  MHC_ASSERT_OK_AND_ASSIGN(auto report, client->GetDeterminismReport());
  EXPECT_EQ(report.determinism_audit_rate(), 0);
  EXPECT_EQ(report.checks_size(), 0);
}

TEST(ObservabilityTest, AuditRatesOutsideZeroToOneAreRefused) {
  for (const char* flag :
       {"--determinism_audit_rate=1.5", "--batch_invariance_audit_rate=-0.1"}) {
    MHC_ASSERT_OK_AND_ASSIGN(auto result,
                             RunCommand({MHC_MHCD_PATH, "--listen=127.0.0.1:0",
                                         "--metrics_listen=", flag}));
    EXPECT_EQ(result.first, 1) << flag << ": " << result.second;
  }
}

}  // namespace
}  // namespace mhc::testing
