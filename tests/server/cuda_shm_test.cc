// Host shared memory on the CUDA daemon (mhcd --backend=cuda): system
// regions are page-locked while registered (--shm_pin_host, on by default),
// host tensors are staged in the executor's staging memory, and the copies
// of an Execute batch overlap its compute. Each check compares bytes that
// must agree bit for bit (the CUDA kernels are deterministic): shared memory
// against inline, an Execute batch against its ops run one by one, on a
// daemon that pins and on one that does not; and one op against the float64
// reference, so that a path broken the same way everywhere still fails.
// Outputs start poisoned and inputs are fresh every round: an op that ran
// before its upload, or an answer sent before its download, gives wrong
// bytes. Every test skips without a CUDA device.
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "mhc/client/shm.h"
#include "mhc/cuda.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

using client::HostTensor;
using client::ShmRef;
using client::ShmTensorRef;
using client::ToTensorRef;

constexpr int kN = 4;
constexpr int64_t kC = 1024;
constexpr int64_t kM = 2048;  // x is 16 MiB of bf16
constexpr DType kBf16 = DType::kBF16;
constexpr uint64_t kXBytes = kM * kN * kC * 2;
constexpr uint64_t kYBytes = kM * kC * 2;
constexpr uint64_t kHPostBytes = kM * kN * 4;
constexpr uint64_t kHResBytes = kM * kN * kN * 4;

std::string Bytes(const client::SharedMemoryObject& object, uint64_t offset,
                  uint64_t bytes) {
  return std::string(object.data() + offset, bytes);
}

// The parameter: whether the daemon page-locks system regions.
class CudaShmTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) {
      GTEST_SKIP() << "no CUDA device: CUDA daemon tests are skipped";
    }
    MHC_ASSERT_OK_AND_ASSIGN(
        daemon_, Daemon::Start({"--backend=cuda", "--devices=0", "--allow_shm",
                                absl::StrCat("--shm_pin_host=",
                                             pinned() ? "true" : "false")}));
    MHC_ASSERT_OK_AND_ASSIGN(client_, daemon_->Connect());
    MHC_ASSERT_OK(client_->WaitForReady(absl::Seconds(30)));
    MHC_ASSERT_OK_AND_ASSIGN(session_, client::Session::Open(*client_));
    for (const char* name : {"a", "b"}) {
      auto request = LayerRequest(name, kN, kC);
      // IEEE fp32 projection: the reference check below holds at 1e-2.
      request.mutable_spec()->set_matmul_precision(v1::MATMUL_PRECISION_IEEE);
      MHC_ASSERT_OK_AND_ASSIGN(client::HostLayer host,
                               CreateRandomLayer(*client_, request));
      hosts_.push_back(std::move(host));
    }
  }

  bool pinned() const { return GetParam(); }

  // A registered shared-memory object of `bytes`, poisoned (0xFF is NaN in
  // every dtype).
  client::SharedMemoryObject* Region(const std::string& name, size_t bytes) {
    auto object = client::SharedMemoryObject::Create(
        client::UniqueShmKey("mhcd_cudashm_", name), bytes);
    EXPECT_TRUE(object.ok()) << object.status();
    if (!object.ok()) return nullptr;
    std::memset((*object)->data(), 0xFF, bytes);
    absl::Status registered =
        client_->RegisterSystemSharedMemory(name, (*object)->key(), 0, bytes);
    EXPECT_TRUE(registered.ok()) << registered;
    if (!registered.ok()) return nullptr;
    objects_.push_back(std::move(*object));
    return objects_.back().get();
  }

  double Metric(const std::string& prefix,
                const std::vector<std::string>& parts = {}) {
    auto scrape =
        HttpGet(daemon_->metrics_host(), daemon_->metrics_port(), "/metrics");
    EXPECT_TRUE(scrape.ok()) << scrape.status();
    return scrape.ok() ? MetricSample(*scrape, prefix, parts) : -1;
  }

  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<client::Session> session_;
  std::vector<client::HostLayer> hosts_;  // "a", "b"
  std::vector<std::unique_ptr<client::SharedMemoryObject>> objects_;
};

TEST_P(CudaShmTest, ShmGivesTheInlineBytesAndTheReference) {
  // Odd offsets: device copies have no alignment needs.
  constexpr uint64_t kX = 6, kY = kX + kXBytes, kHPost = kY + kYBytes + 2,
                     kHRes = kHPost + kHPostBytes, kF = kHRes + kHResBytes,
                     kXNext = kF + kYBytes + 4;
  client::SharedMemoryObject* io = Region("io", kXNext + kXBytes);
  ASSERT_NE(io, nullptr);
  std::unique_ptr<Backend> reference = MakeReferenceBackend();
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    HostTensor x = client::RandomTensor(kBf16, {kM, kN, kC}, FreshSeed());
    HostTensor f = client::RandomTensor(kBf16, {kM, kC}, FreshSeed());
    std::memset(io->data(), 0xFF, io->size());
    std::memcpy(io->data() + kX, x.data(), kXBytes);
    std::memcpy(io->data() + kF, f.data(), kYBytes);

    v1::PreRequest inline_pre;
    inline_pre.set_layer("a");
    *inline_pre.mutable_x() = ToTensorRef(x);
    MHC_ASSERT_OK_AND_ASSIGN(auto want, client_->Pre(inline_pre));
    v1::PreRequest shm_pre;
    shm_pre.set_layer("a");
    *shm_pre.mutable_x() = ShmTensorRef(kBf16, {kM, kN, kC}, "io", kX);
    auto& pre_regions = *shm_pre.mutable_output_regions();
    pre_regions["y"] = ShmRef("io", kY, kYBytes);
    pre_regions["h_post"] = ShmRef("io", kHPost, kHPostBytes);
    pre_regions["h_res"] = ShmRef("io", kHRes, kHResBytes);
    MHC_ASSERT_OK_AND_ASSIGN(auto got, client_->Pre(shm_pre));
    EXPECT_TRUE(got.y().has_shm());
    EXPECT_TRUE(Bytes(*io, kY, kYBytes) == want.y().inline_data());
    EXPECT_TRUE(Bytes(*io, kHPost, kHPostBytes) == want.h_post().inline_data());
    EXPECT_TRUE(Bytes(*io, kHRes, kHResBytes) == want.h_res().inline_data());
    EXPECT_TRUE(got.h_pre().inline_data() == want.h_pre().inline_data());

    if (round == 0) {
      const client::HostLayer& host = hosts_[0];
      HostTensor y = client::Zeros(kBf16, {kM, kC});
      HostTensor h_pre = client::Zeros(DType::kF32, {kM, kN});
      HostTensor h_post = client::Zeros(DType::kF32, {kM, kN});
      HostTensor h_res = client::Zeros(DType::kF32, {kM, kN, kN});
      MHC_ASSERT_OK(reference->PreForward(
          {&host.spec, kM, kBf16, x.data(), host.Weights(), y.data(),
           h_pre.f32(), h_post.f32(), h_res.f32()},
          {}));
      ExpectMatches(want.y(), y, 1e-2, "Pre.y");
      ExpectMatches(want.h_post(), h_post, 1e-2, "Pre.h_post");
      ExpectMatches(want.h_res(), h_res, 1e-2, "Pre.h_res");
    }

    // Post reads the mixing values Pre left in shared memory.
    v1::PostRequest inline_post;
    inline_post.set_layer("a");
    *inline_post.mutable_f() = ToTensorRef(f);
    *inline_post.mutable_x() = ToTensorRef(x);
    *inline_post.mutable_h_post() = want.h_post();
    *inline_post.mutable_h_res() = want.h_res();
    MHC_ASSERT_OK_AND_ASSIGN(auto want_post, client_->Post(inline_post));
    v1::PostRequest shm_post;
    shm_post.set_layer("a");
    *shm_post.mutable_f() = ShmTensorRef(kBf16, {kM, kC}, "io", kF);
    *shm_post.mutable_x() = ShmTensorRef(kBf16, {kM, kN, kC}, "io", kX);
    *shm_post.mutable_h_post() =
        ShmTensorRef(DType::kF32, {kM, kN}, "io", kHPost);
    *shm_post.mutable_h_res() =
        ShmTensorRef(DType::kF32, {kM, kN, kN}, "io", kHRes);
    (*shm_post.mutable_output_regions())["x_next"] =
        ShmRef("io", kXNext, kXBytes);
    MHC_ASSERT_OK(client_->Post(shm_post).status());
    EXPECT_TRUE(Bytes(*io, kXNext, kXBytes) ==
                want_post.x_next().inline_data());
  }
}

TEST_P(CudaShmTest, RegionsArePageLockedExactlyWhileRegistered) {
  constexpr uint64_t kBytes = 64 << 20;
  client::SharedMemoryObject* r = Region("r", kBytes);
  ASSERT_NE(r, nullptr);
  MHC_ASSERT_OK_AND_ASSIGN(auto status, client_->SharedMemoryStatus("r"));
  ASSERT_EQ(status.regions_size(), 1);
  EXPECT_EQ(status.regions(0).pinned(), pinned()) << "daemon log:\n"
                                                  << daemon_->Stdout();
  EXPECT_EQ(Metric("mhcd_shm_pinned_regions"), pinned() ? 1 : 0);
  EXPECT_EQ(Metric("mhcd_shm_pinned_bytes"), pinned() ? kBytes : 0);
  // A failure here means this machine refuses page locks (see the log).
  EXPECT_EQ(Metric("mhcd_shm_pin_failures_total"), 0);

  // Staging memory grows to the first request and is then reused.
  HostTensor x = client::RandomTensor(kBf16, {kM, kN, kC}, FreshSeed());
  std::memcpy(r->data(), x.data(), kXBytes);
  v1::PreRequest pre;
  pre.set_layer("a");
  *pre.mutable_x() = ShmTensorRef(kBf16, {kM, kN, kC}, "r", 0);
  (*pre.mutable_output_regions())["y"] = ShmRef("r", kXBytes, kYBytes);
  MHC_ASSERT_OK(client_->Pre(pre).status());
  const double staging = Metric("mhcd_staging_bytes{", {"device=\"cuda:0\""});
  EXPECT_GE(staging, kXBytes + kYBytes);
  for (int i = 0; i < 3; ++i) MHC_ASSERT_OK(client_->Pre(pre).status());
  EXPECT_EQ(Metric("mhcd_staging_bytes{", {"device=\"cuda:0\""}), staging);

  MHC_ASSERT_OK(client_->UnregisterSharedMemory("r").status());
  EXPECT_EQ(Metric("mhcd_shm_pinned_regions"), 0);
  EXPECT_EQ(Metric("mhcd_shm_pinned_bytes"), 0);

  // Registered again, then released by the end of the session.
  MHC_ASSERT_OK(client_->RegisterSystemSharedMemory("r2", r->key(), 0, kBytes));
  EXPECT_EQ(Metric("mhcd_shm_pinned_regions"), pinned() ? 1 : 0);
  MHC_ASSERT_OK(session_->Close());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (Metric("mhcd_shm_pinned_regions") != 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(Metric("mhcd_shm_pinned_regions"), 0);
  EXPECT_EQ(Metric("mhcd_shm_regions{", {"kind=\"system\""}), 0);
}

// A batch of five ops with host shared memory in and out, references to
// earlier outputs, an inline input and an inline fetch equals the same ops
// run one by one, outputs and accumulated gradients alike.
TEST_P(CudaShmTest, ExecuteBatchEqualsItsOpsOneByOne) {
  client::SharedMemoryObject* in = Region("in", 2 * kXBytes + kYBytes);
  client::SharedMemoryObject* out = Region("out", 2 * kXBytes + 2 * kYBytes);
  ASSERT_NE(in, nullptr);
  ASSERT_NE(out, nullptr);
  constexpr uint64_t kInX = 0, kInF = kXBytes, kInX2 = kXBytes + kYBytes;
  constexpr uint64_t kOutY = 0, kOutXNext = kYBytes, kOutDx = kYBytes + kXBytes,
                     kOutAgg = kYBytes + 2 * kXBytes;
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    HostTensor x = client::RandomTensor(kBf16, {kM, kN, kC}, FreshSeed());
    HostTensor x2 = client::RandomTensor(kBf16, {kM, kN, kC}, FreshSeed());
    HostTensor f = client::RandomTensor(kBf16, {kM, kC}, FreshSeed());
    HostTensor dy = client::RandomTensor(kBf16, {kM, kC}, FreshSeed());
    HostTensor dh_post = RandomF32({kM, kN});
    HostTensor dh_res = RandomF32({kM, kN, kN});
    std::memcpy(in->data() + kInX, x.data(), kXBytes);
    std::memcpy(in->data() + kInF, f.data(), kYBytes);
    std::memcpy(in->data() + kInX2, x2.data(), kXBytes);
    std::memset(out->data(), 0xFF, out->size());

    v1::ExecuteRequest batch;
    v1::Op* op = batch.add_ops();
    op->set_id("pre");
    v1::PreRequest* pre = op->mutable_pre();
    pre->set_layer("a");
    *pre->mutable_x() = ShmTensorRef(kBf16, {kM, kN, kC}, "in", kInX);
    (*pre->mutable_output_regions())["y"] = ShmRef("out", kOutY, kYBytes);
    op = batch.add_ops();
    op->set_id("post");
    v1::PostRequest* post = op->mutable_post();
    post->set_layer("a");
    *post->mutable_f() = ShmTensorRef(kBf16, {kM, kC}, "in", kInF);
    *post->mutable_x() = ShmTensorRef(kBf16, {kM, kN, kC}, "in", kInX);
    post->mutable_h_post()->set_ref("pre.h_post");
    post->mutable_h_res()->set_ref("pre.h_res");
    (*post->mutable_output_regions())["x_next"] =
        ShmRef("out", kOutXNext, kXBytes);
    op = batch.add_ops();
    op->set_id("pre_b");
    op->mutable_pre()->set_layer("b");
    op->mutable_pre()->mutable_x()->set_ref("post.x_next");
    op = batch.add_ops();
    op->set_id("bwd");
    v1::PreBackwardRequest* bwd = op->mutable_pre_backward();
    bwd->set_layer("a");
    *bwd->mutable_x() = ShmTensorRef(kBf16, {kM, kN, kC}, "in", kInX);
    *bwd->mutable_dy() = ToTensorRef(dy);
    *bwd->mutable_dh_post() = ToTensorRef(dh_post);
    *bwd->mutable_dh_res() = ToTensorRef(dh_res);
    (*bwd->mutable_output_regions())["dx"] = ShmRef("out", kOutDx, kXBytes);
    op = batch.add_ops();
    op->set_id("agg");
    v1::AggregateRequest* agg = op->mutable_aggregate();
    agg->set_layer("b");
    *agg->mutable_x() = ShmTensorRef(kBf16, {kM, kN, kC}, "in", kInX2);
    agg->mutable_h_pre()->set_ref("pre_b.h_pre");
    (*agg->mutable_output_regions())["y"] = ShmRef("out", kOutAgg, kYBytes);
    batch.add_fetch("pre_b.y");
    MHC_ASSERT_OK(client_->ZeroGradients("a").status());
    MHC_ASSERT_OK_AND_ASSIGN(auto got, client_->Execute(batch));
    MHC_ASSERT_OK_AND_ASSIGN(auto batch_grads, client_->GetGradients("a"));

    MHC_ASSERT_OK(client_->ZeroGradients("a").status());
    v1::PreRequest s_pre;
    s_pre.set_layer("a");
    *s_pre.mutable_x() = ToTensorRef(x);
    MHC_ASSERT_OK_AND_ASSIGN(auto w_pre, client_->Pre(s_pre));
    v1::PostRequest s_post;
    s_post.set_layer("a");
    *s_post.mutable_f() = ToTensorRef(f);
    *s_post.mutable_x() = ToTensorRef(x);
    *s_post.mutable_h_post() = w_pre.h_post();
    *s_post.mutable_h_res() = w_pre.h_res();
    MHC_ASSERT_OK_AND_ASSIGN(auto w_post, client_->Post(s_post));
    v1::PreRequest s_pre_b;
    s_pre_b.set_layer("b");
    *s_pre_b.mutable_x() = w_post.x_next();
    MHC_ASSERT_OK_AND_ASSIGN(auto w_pre_b, client_->Pre(s_pre_b));
    v1::PreBackwardRequest s_bwd = *bwd;
    s_bwd.clear_output_regions();
    *s_bwd.mutable_x() = ToTensorRef(x);
    MHC_ASSERT_OK_AND_ASSIGN(auto w_bwd, client_->PreBackward(s_bwd));
    v1::AggregateRequest s_agg;
    s_agg.set_layer("b");
    *s_agg.mutable_x() = ToTensorRef(x2);
    *s_agg.mutable_h_pre() = w_pre_b.h_pre();
    MHC_ASSERT_OK_AND_ASSIGN(auto w_agg, client_->Aggregate(s_agg));
    MHC_ASSERT_OK_AND_ASSIGN(auto single_grads, client_->GetGradients("a"));

    EXPECT_TRUE(Bytes(*out, kOutY, kYBytes) == w_pre.y().inline_data());
    EXPECT_TRUE(Bytes(*out, kOutXNext, kXBytes) ==
                w_post.x_next().inline_data());
    EXPECT_TRUE(Bytes(*out, kOutDx, kXBytes) == w_bwd.dx().inline_data());
    EXPECT_TRUE(Bytes(*out, kOutAgg, kYBytes) == w_agg.y().inline_data());
    ASSERT_TRUE(got.outputs().contains("pre_b.y"));
    EXPECT_TRUE(got.outputs().at("pre_b.y").inline_data() ==
                w_pre_b.y().inline_data());
    ASSERT_GT(single_grads.gradients().tensors_size(), 0);
    for (const auto& [name, tensor] : single_grads.gradients().tensors()) {
      ASSERT_TRUE(batch_grads.gradients().tensors().contains(name)) << name;
      EXPECT_TRUE(batch_grads.gradients().tensors().at(name).inline_data() ==
                  tensor.inline_data())
          << name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Pinning, CudaShmTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Pinned" : "Pageable";
                         });

}  // namespace
}  // namespace mhc::testing
