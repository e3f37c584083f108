// The daemon's path for backends without host access (staging memory,
// overlapped copies, one synchronization per request), run without a GPU:
// LazyCopyBackend computes on the CPU but has no host access, and performs
// each overlapped copy as late as the Backend contract allows. A missing
// wait for an upload, a missing synchronization or staging pieces that
// overlap then show up as wrong bytes, compared bit for bit with a daemon on
// the plain cpu backend (same kernels, host path).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "mhc/client/shm.h"
#include "server/executor.h"
#include "server/server.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

using client::HostTensor;
using client::ToTensorRef;
using server::Executor;
using server::StagingArena;

// No host access; memory is host memory nonetheless, poisoned (0xFF: NaN in
// every dtype) when allocated. Uploads happen when an op is made to wait for
// them or at Synchronize, downloads only at Synchronize.
class LazyCopyBackend final : public Backend {
 public:
  LazyCopyBackend() : cpu_(MakeCpuBackend(2)) {}
  ~LazyCopyBackend() override { EXPECT_TRUE(pending_.empty()); }

  int allocations() const { return allocations_; }

  std::string Name() const override { return "lazy"; }
  std::string DeviceDescription() const override { return "lazy copies"; }
  bool HostAccessible() const override { return false; }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    ++allocations_;
    if (bytes == 0) return nullptr;
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (p == nullptr) return absl::ResourceExhaustedError("lazy: no memory");
    std::memset(p, 0xFF, bytes);
    return p;
  }
  void Free(void* pointer) override { std::free(pointer); }
  absl::Status CopyToDevice(void* dst, const void* src, size_t n) override {
    std::memcpy(dst, src, n);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t n) override {
    std::memcpy(dst, src, n);
    return absl::OkStatus();
  }
  absl::Status Memset(void* dst, int value, size_t n) override {
    std::memset(dst, value, n);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override {
    FinishUploads(next_ticket_ - 1);
    for (const Copy& copy : downloads_) {
      std::memcpy(copy.dst, copy.src, copy.bytes);
    }
    downloads_.clear();
    return absl::OkStatus();
  }

  absl::StatusOr<CopyTicket> CopyToDeviceAsync(void* dst, const void* src,
                                               size_t bytes) override {
    if (bytes == 0) return kNoCopy;
    pending_.push_back({dst, src, bytes});
    return next_ticket_++;
  }
  absl::Status OpsWaitForCopy(CopyTicket ticket) override {
    if (ticket >= next_ticket_) {
      return absl::InvalidArgumentError("lazy: ticket never issued");
    }
    FinishUploads(ticket);
    return absl::OkStatus();
  }
  absl::Status CopyToHostAsync(void* dst, const void* src,
                               size_t bytes) override {
    downloads_.push_back({dst, src, bytes});
    return absl::OkStatus();
  }

  size_t WorkspaceBytes(OpKind op, const LayerSpec& spec, int64_t tokens,
                        DType act_dtype) const override {
    return cpu_->WorkspaceBytes(op, spec, tokens, act_dtype);
  }

 protected:
#define MHC_LAZY_OP_(Name, Params)                                 \
  absl::Status Run##Name(const Params& p, Workspace ws) override { \
    return cpu_->Name(p, ws);                                      \
  }
  MHC_LAZY_OP_(ProjectionForward, ProjectionForwardParams)
  MHC_LAZY_OP_(ProjectionBackward, ProjectionBackwardParams)
  MHC_LAZY_OP_(ScaleForward, ScaleForwardParams)
  MHC_LAZY_OP_(ScaleBackward, ScaleBackwardParams)
  MHC_LAZY_OP_(SinkhornForward, SinkhornForwardParams)
  MHC_LAZY_OP_(SinkhornBackward, SinkhornBackwardParams)
  MHC_LAZY_OP_(AggregateForward, AggregateForwardParams)
  MHC_LAZY_OP_(AggregateBackward, AggregateBackwardParams)
  MHC_LAZY_OP_(PostForward, PostForwardParams)
  MHC_LAZY_OP_(PostBackward, PostBackwardParams)
  MHC_LAZY_OP_(ExpandForward, ExpandForwardParams)
  MHC_LAZY_OP_(ExpandBackward, ExpandBackwardParams)
  MHC_LAZY_OP_(PreForward, PreForwardParams)
  MHC_LAZY_OP_(PreBackward, PreBackwardParams)
  MHC_LAZY_OP_(HeadForward, HeadForwardParams)
  MHC_LAZY_OP_(HeadBackward, HeadBackwardParams)
  MHC_LAZY_OP_(OptimizerStep, OptimizerStepParams)
#undef MHC_LAZY_OP_

 private:
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
  };
  // Uploads up to `ticket`, in queue order.
  void FinishUploads(CopyTicket ticket) {
    while (first_pending_ <= ticket && !pending_.empty()) {
      const Copy& copy = pending_.front();
      std::memcpy(copy.dst, copy.src, copy.bytes);
      pending_.erase(pending_.begin());
      ++first_pending_;
    }
  }

  std::unique_ptr<Backend> cpu_;
  std::vector<Copy> pending_;  // uploads first_pending_, first_pending_ + 1..
  CopyTicket first_pending_ = 0;
  CopyTicket next_ticket_ = 0;
  std::vector<Copy> downloads_;
  int allocations_ = 0;
};

TEST(StagingArenaTest, AlignedPiecesWithinTheRequestedBytes) {
  alignas(256) static char memory[1024];
  StagingArena arena(
      memory, StagingArena::Footprint(100) + StagingArena::Footprint(300));
  EXPECT_EQ(StagingArena::Footprint(1), 256u);
  EXPECT_EQ(StagingArena::Footprint(256), 256u);
  EXPECT_EQ(StagingArena::Footprint(257), 512u);
  auto empty = arena.Take(0);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, nullptr);
  auto a = arena.Take(100);
  auto b = arena.Take(300);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, memory);
  EXPECT_EQ(*b, memory + 256);
  EXPECT_EQ(arena.Take(1).status().code(), absl::StatusCode::kInternal);
}

// Staging memory is allocated when a request needs more than the executor
// holds, and never again for requests that fit.
TEST(StagingArenaTest, ExecutorAllocatesOnlyToGrow) {
  auto owned = std::make_unique<LazyCopyBackend>();
  LazyCopyBackend* backend = owned.get();
  Executor executor(std::move(owned), "lazy");
  auto none = [](const Backend&) { return size_t{0}; };
  // Runs a request that asks for `asked` bytes and takes a piece of `bytes`.
  auto run = [&](uint64_t asked, uint64_t bytes) {
    return executor.Run(none, asked,
                        [bytes](Backend&, Workspace, StagingArena& staging) {
                          return staging.Take(bytes).status();
                        });
  };
  auto footprint = StagingArena::Footprint;
  ASSERT_TRUE(run(0, 0).ok());
  EXPECT_EQ(backend->allocations(), 0);
  ASSERT_TRUE(run(footprint(1000), 1000).ok());
  EXPECT_EQ(backend->allocations(), 1);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(run(4096, 4096).ok());
  EXPECT_EQ(backend->allocations(), 1);
  ASSERT_TRUE(run(3 << 20, 3 << 20).ok());
  EXPECT_EQ(backend->allocations(), 2);
  // Asking for fewer bytes than the request takes is a bug, reported as
  // one, even when the buffer is larger from earlier requests.
  EXPECT_EQ(run(100, 300).code(), absl::StatusCode::kInternal);
}

// One in-process daemon on a unix socket.
struct InProcess {
  std::unique_ptr<server::MhcServer> server;
  std::unique_ptr<client::Client> client;
  std::unique_ptr<client::Session> session;
  std::string socket;

  ~InProcess() {
    if (session != nullptr) (void)session->Close();
    client.reset();
    server.reset();
    if (!socket.empty()) unlink(socket.c_str());
  }
};

void Start(std::unique_ptr<Backend> backend, const std::string& device,
           InProcess* daemon) {
  static int count = 0;
  daemon->socket =
      absl::StrCat("/tmp/mhc_device_path_", getpid(), "_", count++, ".sock");
  server::ServerConfig config;
  config.listen.push_back(absl::StrCat("unix:", daemon->socket));
  config.service.shm.enabled = true;
  std::vector<server::DeviceBackend> devices;
  devices.push_back({device, std::move(backend)});
  MHC_ASSERT_OK_AND_ASSIGN(
      daemon->server, server::MhcServer::Start(config, std::move(devices)));
  MHC_ASSERT_OK_AND_ASSIGN(daemon->client,
                           client::Client::Connect(config.listen[0]));
  MHC_ASSERT_OK(daemon->client->WaitForReady(absl::Seconds(10)));
  MHC_ASSERT_OK_AND_ASSIGN(daemon->session,
                           client::Session::Open(*daemon->client));
}

constexpr int kN = 4;
constexpr int64_t kC = 48;

class DevicePathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Start(MakeCpuBackend(2), "cpu", &host_);
    auto lazy = std::make_unique<LazyCopyBackend>();
    lazy_ = lazy.get();
    Start(std::move(lazy), "lazy", &device_);
    if (HasFatalFailure()) return;
    // The same random parameters on both daemons.
    for (const char* name : {"a", "b"}) {
      auto request = LayerRequest(name, kN, kC);
      ASSERT_TRUE(CreateRandomLayer(*host_.client, request).ok());
      MHC_ASSERT_OK_AND_ASSIGN(v1::Parameters params,
                               host_.client->GetParameters(name));
      ASSERT_TRUE(device_.client->CreateLayer(request).ok());
      v1::SetParametersRequest set;
      set.set_layer(name);
      *set.mutable_parameters() = params;
      ASSERT_TRUE(device_.client->SetParameters(set).ok());
    }
  }

  // A poisoned shared-memory object registered with the device daemon.
  client::SharedMemoryObject* Region(const std::string& name, size_t bytes) {
    auto object = client::SharedMemoryObject::Create(
        client::UniqueShmKey("mhcd_devpath_", name), bytes);
    EXPECT_TRUE(object.ok()) << object.status();
    if (!object.ok()) return nullptr;
    std::memset((*object)->data(), 0xFF, bytes);
    EXPECT_TRUE(
        device_.client
            ->RegisterSystemSharedMemory(name, (*object)->key(), 0, bytes)
            .ok());
    objects_.push_back(std::move(*object));
    return objects_.back().get();
  }

  InProcess host_, device_;
  LazyCopyBackend* lazy_ = nullptr;
  std::vector<std::unique_ptr<client::SharedMemoryObject>> objects_;
};

std::string Bytes(const client::SharedMemoryObject& object, uint64_t offset,
                  uint64_t bytes) {
  return std::string(object.data() + offset, bytes);
}

TEST_F(DevicePathTest, SingleOpsThroughShmAndInlineMatchTheHostPath) {
  constexpr int64_t kM = 37;
  const uint64_t x_bytes = kM * kN * kC * 2, y_bytes = kM * kC * 2;
  const uint64_t h_post_bytes = kM * kN * 4, h_res_bytes = kM * kN * kN * 4;
  // Odd offsets: a device copy has no alignment needs.
  client::SharedMemoryObject* io = Region("io", 6 + x_bytes + y_bytes + 4096);
  ASSERT_NE(io, nullptr);
  for (int round = 0; round < 3; ++round) {
    // Fresh inputs each round: an op that ran before its upload would see
    // the previous round's bytes (or poison), not these.
    HostTensor x =
        client::RandomTensor(DType::kBF16, {kM, kN, kC}, FreshSeed());
    std::memcpy(io->data() + 6, x.data(), x_bytes);
    std::memset(io->data() + 6 + x_bytes, 0xFF, y_bytes + 4096);
    v1::PreRequest inline_pre;
    inline_pre.set_layer("a");
    *inline_pre.mutable_x() = ToTensorRef(x);
    MHC_ASSERT_OK_AND_ASSIGN(auto want, host_.client->Pre(inline_pre));

    v1::PreRequest shm_pre;
    shm_pre.set_layer("a");
    *shm_pre.mutable_x() =
        client::ShmTensorRef(DType::kBF16, {kM, kN, kC}, "io", 6);
    (*shm_pre.mutable_output_regions())["y"] =
        client::ShmRef("io", 6 + x_bytes, y_bytes);
    (*shm_pre.mutable_output_regions())["h_post"] =
        client::ShmRef("io", 6 + x_bytes + y_bytes + 2, h_post_bytes);
    MHC_ASSERT_OK_AND_ASSIGN(auto got, device_.client->Pre(shm_pre));
    EXPECT_TRUE(got.y().has_shm());
    EXPECT_EQ(Bytes(*io, 6 + x_bytes, y_bytes), want.y().inline_data());
    EXPECT_EQ(Bytes(*io, 6 + x_bytes + y_bytes + 2, h_post_bytes),
              want.h_post().inline_data());
    EXPECT_EQ(got.h_pre().inline_data(), want.h_pre().inline_data());
    EXPECT_EQ(got.h_res().inline_data(), want.h_res().inline_data());
    ASSERT_EQ(want.h_res().inline_data().size(), h_res_bytes);

    MHC_ASSERT_OK_AND_ASSIGN(auto inline_got, device_.client->Pre(inline_pre));
    EXPECT_EQ(inline_got.y().inline_data(), want.y().inline_data());
  }
  // Zero tokens stage nothing and still answer.
  v1::PreRequest empty;
  empty.set_layer("a");
  *empty.mutable_x() = ToTensorRef(client::Zeros(DType::kBF16, {0, kN, kC}));
  MHC_ASSERT_OK_AND_ASSIGN(auto none, device_.client->Pre(empty));
  EXPECT_EQ(none.y().inline_data().size(), 0u);
}

// A batch mixing shm and inline inputs, references to earlier outputs,
// outputs into shm, fetched inline and kept on the device, and gradient
// accumulation, equals the same ops run one by one on the host path.
TEST_F(DevicePathTest, ExecuteBatchMatchesSingleOpsOnTheHostPath) {
  constexpr int64_t kM = 29;
  const uint64_t x_bytes = kM * kN * kC * 2, y_bytes = kM * kC * 2;
  client::SharedMemoryObject* in = Region("in", 2 * x_bytes);
  client::SharedMemoryObject* out = Region("out", 2 * x_bytes + y_bytes);
  ASSERT_NE(in, nullptr);
  ASSERT_NE(out, nullptr);
  for (int round = 0; round < 3; ++round) {
    HostTensor x =
        client::RandomTensor(DType::kBF16, {kM, kN, kC}, FreshSeed());
    HostTensor f = client::RandomTensor(DType::kBF16, {kM, kC}, FreshSeed());
    HostTensor dy = client::RandomTensor(DType::kBF16, {kM, kC}, FreshSeed());
    HostTensor dh_post = RandomF32({kM, kN});
    HostTensor dh_res = RandomF32({kM, kN, kN});
    std::memcpy(in->data(), x.data(), x_bytes);
    std::memcpy(in->data() + x_bytes, f.data(), y_bytes);
    std::memset(out->data(), 0xFF, out->size());

    v1::ExecuteRequest batch;
    v1::Op* op = batch.add_ops();
    op->set_id("pre");
    v1::PreRequest* pre = op->mutable_pre();
    pre->set_layer("a");
    *pre->mutable_x() =
        client::ShmTensorRef(DType::kBF16, {kM, kN, kC}, "in", 0);
    (*pre->mutable_output_regions())["y"] = client::ShmRef("out", 0, y_bytes);
    op = batch.add_ops();
    op->set_id("post");
    v1::PostRequest* post = op->mutable_post();
    post->set_layer("a");
    *post->mutable_f() =
        client::ShmTensorRef(DType::kBF16, {kM, kC}, "in", x_bytes);
    *post->mutable_x() =
        client::ShmTensorRef(DType::kBF16, {kM, kN, kC}, "in", 0);
    post->mutable_h_post()->set_ref("pre.h_post");
    post->mutable_h_res()->set_ref("pre.h_res");
    (*post->mutable_output_regions())["x_next"] =
        client::ShmRef("out", y_bytes, x_bytes);
    op = batch.add_ops();
    op->set_id("pre_b");
    op->mutable_pre()->set_layer("b");
    op->mutable_pre()->mutable_x()->set_ref("post.x_next");
    op = batch.add_ops();
    op->set_id("bwd");
    v1::PreBackwardRequest* bwd = op->mutable_pre_backward();
    bwd->set_layer("a");
    *bwd->mutable_x() =
        client::ShmTensorRef(DType::kBF16, {kM, kN, kC}, "in", 0);
    *bwd->mutable_dy() = ToTensorRef(dy);
    *bwd->mutable_dh_post() = ToTensorRef(dh_post);
    *bwd->mutable_dh_res() = ToTensorRef(dh_res);
    (*bwd->mutable_output_regions())["dx"] =
        client::ShmRef("out", y_bytes + x_bytes, x_bytes);
    batch.add_fetch("pre_b.y");
    batch.add_fetch("pre.h_res");
    MHC_ASSERT_OK_AND_ASSIGN(auto got, device_.client->Execute(batch));

    v1::PreRequest s_pre;
    s_pre.set_layer("a");
    *s_pre.mutable_x() = ToTensorRef(x);
    MHC_ASSERT_OK_AND_ASSIGN(auto w_pre, host_.client->Pre(s_pre));
    v1::PostRequest s_post;
    s_post.set_layer("a");
    *s_post.mutable_f() = ToTensorRef(f);
    *s_post.mutable_x() = ToTensorRef(x);
    *s_post.mutable_h_post() = w_pre.h_post();
    *s_post.mutable_h_res() = w_pre.h_res();
    MHC_ASSERT_OK_AND_ASSIGN(auto w_post, host_.client->Post(s_post));
    v1::PreRequest s_pre_b;
    s_pre_b.set_layer("b");
    *s_pre_b.mutable_x() = w_post.x_next();
    MHC_ASSERT_OK_AND_ASSIGN(auto w_pre_b, host_.client->Pre(s_pre_b));
    v1::PreBackwardRequest s_bwd = *bwd;
    s_bwd.clear_output_regions();
    *s_bwd.mutable_x() = ToTensorRef(x);
    MHC_ASSERT_OK_AND_ASSIGN(auto w_bwd, host_.client->PreBackward(s_bwd));

    const std::string what = absl::StrCat("round ", round);
    EXPECT_EQ(Bytes(*out, 0, y_bytes), w_pre.y().inline_data()) << what;
    EXPECT_EQ(Bytes(*out, y_bytes, x_bytes), w_post.x_next().inline_data())
        << what;
    EXPECT_EQ(Bytes(*out, y_bytes + x_bytes, x_bytes), w_bwd.dx().inline_data())
        << what;
    ASSERT_TRUE(got.outputs().contains("pre_b.y"));
    EXPECT_EQ(got.outputs().at("pre_b.y").inline_data(),
              w_pre_b.y().inline_data())
        << what;
    EXPECT_EQ(got.outputs().at("pre.h_res").inline_data(),
              w_pre.h_res().inline_data())
        << what;
  }
  MHC_ASSERT_OK_AND_ASSIGN(auto want, host_.client->GetGradients("a"));
  MHC_ASSERT_OK_AND_ASSIGN(auto got, device_.client->GetGradients("a"));
  ASSERT_GT(want.gradients().tensors_size(), 0);
  for (const auto& [name, tensor] : want.gradients().tensors()) {
    ASSERT_TRUE(got.gradients().tensors().contains(name)) << name;
    EXPECT_EQ(got.gradients().tensors().at(name).inline_data(),
              tensor.inline_data())
        << name;
  }
  // Three rounds of one size: staging memory was allocated once.
  const int allocations = lazy_->allocations();
  MHC_ASSERT_OK(device_.client
                    ->Pre([&] {
                      v1::PreRequest pre;
                      pre.set_layer("a");
                      *pre.mutable_x() = client::ShmTensorRef(
                          DType::kBF16, {kM, kN, kC}, "in", 0);
                      return pre;
                    }())
                    .status());
  EXPECT_EQ(lazy_->allocations(), allocations);
}

// OptimizerStep on a device without host access (state in device memory,
// the norm copied back through staging) matches the host path bit for bit,
// over steps whose gradients come from the same backward passes.
TEST_F(DevicePathTest, OptimizerStepMatchesTheHostPath) {
  constexpr int64_t kM = 7;
  v1::OptimizerStepRequest step;
  step.add_layers("a");
  step.add_layers("b");
  step.set_learning_rate(1e-2f);
  step.mutable_adamw()->set_weight_decay(0.05f);
  step.set_max_grad_norm(0.1f);
  step.set_zero_gradients(true);
  for (int round = 0; round < 3; ++round) {
    for (const char* layer : {"a", "b"}) {
      v1::PreBackwardRequest bwd;
      bwd.set_layer(layer);
      *bwd.mutable_x() = ToTensorRef(
          client::RandomTensor(DType::kBF16, {kM, kN, kC}, FreshSeed()));
      *bwd.mutable_dy() = ToTensorRef(
          client::RandomTensor(DType::kBF16, {kM, kC}, FreshSeed()));
      *bwd.mutable_dh_post() =
          ToTensorRef(client::RandomTensor(DType::kF32, {kM, kN}, FreshSeed()));
      *bwd.mutable_dh_res() = ToTensorRef(
          client::RandomTensor(DType::kF32, {kM, kN, kN}, FreshSeed()));
      MHC_ASSERT_OK(host_.client->PreBackward(bwd).status());
      MHC_ASSERT_OK(device_.client->PreBackward(bwd).status());
    }
    MHC_ASSERT_OK_AND_ASSIGN(auto want, host_.client->OptimizerStep(step));
    MHC_ASSERT_OK_AND_ASSIGN(auto got, device_.client->OptimizerStep(step));
    EXPECT_GT(want.grad_norm(), 0.1);
    EXPECT_EQ(got.grad_norm(), want.grad_norm()) << "round " << round;
    EXPECT_EQ(got.clip_coefficient(), want.clip_coefficient());
    for (const char* layer : {"a", "b"}) {
      MHC_ASSERT_OK_AND_ASSIGN(auto want_values,
                               host_.client->GetParameters(layer));
      MHC_ASSERT_OK_AND_ASSIGN(auto got_values,
                               device_.client->GetParameters(layer));
      for (const auto& [name, tensor] : want_values.tensors()) {
        EXPECT_EQ(got_values.tensors().at(name).inline_data(),
                  tensor.inline_data())
            << layer << "." << name << " round " << round;
      }
    }
  }
  MHC_ASSERT_OK_AND_ASSIGN(v1::LayerInfo info, device_.client->GetLayer("a"));
  EXPECT_EQ(info.optimizer().step(), 3);
  EXPECT_EQ(info.gradient_tokens(), 0);
}

}  // namespace
}  // namespace mhc::testing
