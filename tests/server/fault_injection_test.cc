// mhcd --fault_injection (test only) on a CUDA daemon: an allocation that
// fails is answered RESOURCE_EXHAUSTED and the daemon serves on; a launch
// or copy that loses the CUDA context takes health to NOT_SERVING and ends
// the daemon with status 3, so that an orchestrator restarts it. The flag's
// checks run anywhere; the CUDA tests skip when `mhcd --backend=cuda`
// cannot start (no GPU, or a build without CUDA).
#include <signal.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

constexpr int kExitDeviceFailed = 3;

TEST(FaultInjectionTest, TheFlagIsCheckedAtStart) {
  for (const char* bad : {"launch:0", "disk:1", "launch", "alloc:1,alloc:2"}) {
    SCOPED_TRACE(bad);
    auto refused = Daemon::Start({absl::StrCat("--fault_injection=", bad)},
                                 /*capture_stderr=*/true);
    ASSERT_FALSE(refused.ok());
    EXPECT_TRUE(
        absl::StrContains(refused.status().message(), "--fault_injection: "))
        << refused.status();
  }
  auto on_cpu = Daemon::Start({"--fault_injection=launch:1"},
                              /*capture_stderr=*/true);
  ASSERT_FALSE(on_cpu.ok());
  EXPECT_TRUE(absl::StrContains(on_cpu.status().message(),
                                "only the CUDA backend injects faults"))
      << on_cpu.status();
}

// A CUDA daemon with `fault`, its client and a health Watch stream.
class CudaFaultTest : public ::testing::Test {
 protected:
  // False when the test skipped (no CUDA daemon) or could not start one.
  bool Started(const std::string& fault) {
    Start(fault);
    return !IsSkipped() && !HasFatalFailure();
  }

  void Start(const std::string& fault) {
    auto daemon = Daemon::Start({"--backend=cuda", "--devices=0",
                                 absl::StrCat("--fault_injection=", fault)},
                                /*capture_stderr=*/true);
    if (!daemon.ok() &&
        (absl::StrContains(daemon.status().message(), "no CUDA device") ||
         absl::StrContains(daemon.status().message(), "no CUDA backend"))) {
      GTEST_SKIP() << "no CUDA device or no CUDA build: "
                   << daemon.status().message();
    }
    MHC_ASSERT_OK_AND_ASSIGN(daemon_, std::move(daemon));
    MHC_ASSERT_OK_AND_ASSIGN(client_, daemon_->Connect());
    MHC_ASSERT_OK(client_->WaitForReady(absl::Seconds(30)));
    health_ = grpc::health::v1::Health::NewStub(client_->channel());
    watch_context_.set_deadline(std::chrono::system_clock::now() +
                                std::chrono::seconds(60));
    watch_ =
        health_->Watch(&watch_context_, grpc::health::v1::HealthCheckRequest());
    ASSERT_EQ(NextHealth(), "SERVING");
  }

  void TearDown() override {
    if (watch_ == nullptr) return;
    watch_context_.TryCancel();
    watch_->Finish().IgnoreError();
  }

  // The next status the health Watch stream reports; "" once it ended.
  // Watching sees NOT_SERVING however soon the daemon exits after it.
  std::string NextHealth() {
    grpc::health::v1::HealthCheckResponse response;
    if (!watch_->Read(&response)) return "";
    return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(
        response.status());
  }

  absl::StatusOr<v1::SinkhornResponse> Sinkhorn() {
    v1::SinkhornRequest request;
    request.set_layer("l");
    *request.mutable_logits() = client::ToTensorRef(RandomF32({2, 4, 4}));
    return client_->Sinkhorn(request);
  }

  // After the device was lost: NOT_SERVING, then exit status 3. (The
  // failed request reports the lost device, which outranks its own error.)
  void ExpectDeviceLost() {
    EXPECT_EQ(NextHealth(), "NOT_SERVING");
    MHC_ASSERT_OK_AND_ASSIGN(int code, daemon_->Wait(absl::Seconds(30)));
    EXPECT_EQ(code, kExitDeviceFailed) << daemon_->Stdout();
    EXPECT_TRUE(
        absl::StrContains(daemon_->Stdout(), "failed and serves no more"))
        << daemon_->Stdout();
    EXPECT_TRUE(
        absl::StrContains(daemon_->Stdout(), "a device failed for good"))
        << daemon_->Stdout();
  }

  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
  grpc::ClientContext watch_context_;
  std::unique_ptr<grpc::ClientReader<grpc::health::v1::HealthCheckResponse>>
      watch_;
};

TEST_F(CudaFaultTest, AFailedAllocationIsAnsweredAndTheDaemonServesOn) {
  if (!Started("alloc:1")) return;
  // The layer's memory is the first allocation.
  auto refused = client_->CreateLayer(LayerRequest("l", 4, 64));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted)
      << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "injected"))
      << refused.status();
  MHC_ASSERT_OK(client_->CreateLayer(LayerRequest("l", 4, 64)).status());
  MHC_ASSERT_OK(Sinkhorn().status());
  MHC_ASSERT_OK_AND_ASSIGN(std::string health, client_->Health());
  EXPECT_EQ(health, "SERVING");
  daemon_->Signal(SIGTERM);
  MHC_ASSERT_OK_AND_ASSIGN(int code, daemon_->Wait(absl::Seconds(30)));
  EXPECT_EQ(code, 0) << daemon_->Stdout();
}

TEST_F(CudaFaultTest, AFailedLaunchLosesTheDeviceAndEndsTheDaemon) {
  if (!Started("launch:1")) return;
  // Creating a layer copies and sets memory but launches no op.
  MHC_ASSERT_OK(client_->CreateLayer(LayerRequest("l", 4, 64)).status());
  const absl::Status failed = Sinkhorn().status();
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal) << failed;
  ExpectDeviceLost();
}

TEST_F(CudaFaultTest, AFailedCopyLosesTheDeviceAndEndsTheDaemon) {
  if (!Started("copy:1")) return;
  // The layer's initial values are the first copy to the device.
  const absl::Status failed =
      client_->CreateLayer(LayerRequest("l", 4, 64)).status();
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal) << failed;
  ExpectDeviceLost();
}

}  // namespace
}  // namespace mhc::testing
