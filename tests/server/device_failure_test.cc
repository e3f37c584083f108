// A device that fails for good, without a GPU: LostDeviceBackend keeps its
// memory on the host but fails every op and from then on reports the
// device lost, as a CUDA context does after a fault. The daemon must take
// health to NOT_SERVING and call its device-failure hook once (mhcd's main
// then drains and exits 3; tests/server/fault_injection_test.cc checks that
// on a GPU).
#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/server.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

class LostDeviceBackend final : public Backend {
 public:
  LostDeviceBackend() : cpu_(MakeCpuBackend(1)) {}

  std::string Name() const override { return "lost"; }
  std::string DeviceDescription() const override { return "fails its ops"; }
  bool HostAccessible() const override { return true; }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    return cpu_->Allocate(bytes);
  }
  void Free(void* pointer) override { cpu_->Free(pointer); }
  absl::Status CopyToDevice(void* dst, const void* src, size_t n) override {
    return cpu_->CopyToDevice(dst, src, n);
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t n) override {
    return cpu_->CopyToHost(dst, src, n);
  }
  absl::Status Memset(void* dst, int value, size_t n) override {
    return cpu_->Memset(dst, value, n);
  }
  absl::Status Synchronize() override { return CheckDevice(); }
  absl::Status CheckDevice() override {
    if (!lost_) return absl::OkStatus();
    return absl::InternalError("the device was lost");
  }
  size_t WorkspaceBytes(OpKind op, const LayerSpec& spec, int64_t tokens,
                        DType act_dtype) const override {
    return cpu_->WorkspaceBytes(op, spec, tokens, act_dtype);
  }

 protected:
#define MHC_LOST_OP_(Name, Params)                            \
  absl::Status Run##Name(const Params&, Workspace) override { \
    lost_ = true;                                             \
    return absl::InternalError("op fault");                   \
  }
  MHC_LOST_OP_(ProjectionForward, ProjectionForwardParams)
  MHC_LOST_OP_(ProjectionBackward, ProjectionBackwardParams)
  MHC_LOST_OP_(ScaleForward, ScaleForwardParams)
  MHC_LOST_OP_(ScaleBackward, ScaleBackwardParams)
  MHC_LOST_OP_(SinkhornForward, SinkhornForwardParams)
  MHC_LOST_OP_(SinkhornBackward, SinkhornBackwardParams)
  MHC_LOST_OP_(AggregateForward, AggregateForwardParams)
  MHC_LOST_OP_(AggregateBackward, AggregateBackwardParams)
  MHC_LOST_OP_(PostForward, PostForwardParams)
  MHC_LOST_OP_(PostBackward, PostBackwardParams)
  MHC_LOST_OP_(ExpandForward, ExpandForwardParams)
  MHC_LOST_OP_(ExpandBackward, ExpandBackwardParams)
  MHC_LOST_OP_(PreForward, PreForwardParams)
  MHC_LOST_OP_(PreBackward, PreBackwardParams)
  MHC_LOST_OP_(HeadForward, HeadForwardParams)
  MHC_LOST_OP_(HeadBackward, HeadBackwardParams)
  MHC_LOST_OP_(OptimizerStep, OptimizerStepParams)
#undef MHC_LOST_OP_

 private:
  std::unique_ptr<Backend> cpu_;
  bool lost_ = false;  // used under the executor's lock
};

TEST(DeviceFailureTest, ALostDeviceIsTakenOutOfServiceAndReportedOnce) {
  const std::string socket =
      absl::StrCat("/tmp/mhc_device_failure_", getpid(), ".sock");
  std::atomic<int> failures{0};
  server::ServerConfig config;
  config.listen.push_back(absl::StrCat("unix:", socket));
  config.on_device_failure = [&failures] { ++failures; };
  std::vector<server::DeviceBackend> devices;
  devices.push_back({"lost", std::make_unique<LostDeviceBackend>()});
  MHC_ASSERT_OK_AND_ASSIGN(
      auto server, server::MhcServer::Start(config, std::move(devices)));
  MHC_ASSERT_OK_AND_ASSIGN(auto client,
                           client::Client::Connect(config.listen[0]));
  MHC_ASSERT_OK(client->WaitForReady(absl::Seconds(10)));
  MHC_ASSERT_OK(client->CreateLayer(LayerRequest("l", 4, 64)).status());
  MHC_ASSERT_OK_AND_ASSIGN(std::string health, client->Health());
  EXPECT_EQ(health, "SERVING");

  v1::SinkhornRequest sinkhorn;
  sinkhorn.set_layer("l");
  *sinkhorn.mutable_logits() = client::ToTensorRef(RandomF32({2, 4, 4}));
  for (int call = 0; call < 2; ++call) {
    const absl::Status failed = client->Sinkhorn(sinkhorn).status();
    EXPECT_EQ(failed.code(), absl::StatusCode::kInternal) << failed;
    EXPECT_TRUE(absl::StrContains(failed.message(), "serves no more requests"))
        << failed;
  }
  MHC_ASSERT_OK_AND_ASSIGN(health, client->Health());
  EXPECT_EQ(health, "NOT_SERVING");
  EXPECT_EQ(failures.load(), 1);
  client.reset();
  server.reset();
  unlink(socket.c_str());
}

}  // namespace
}  // namespace mhc::testing
