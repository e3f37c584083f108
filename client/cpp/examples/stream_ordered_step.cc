// Training steps of one mHC layer through a local mhcd, zero copy and stream
// ordered: the activations live in one device allocation registered once,
// the layer's parameters and gradient accumulators are mapped in place, and
// every call waits for an event recorded on this program's stream. Through
// the call ring the calls are deferred: each returns once its request is
// written and the stream waits on the ring's done word for the daemon's
// work (without the ring, the stream waits on the daemon's event after each
// answer). The loop never waits for the GPU on the host; the last step is
// read back once at the end.
//
//   stream_ordered_step --address=unix:/run/mhcd.sock [--tokens=4096]
//       [--hidden=4096] [--n=4] [--steps=20] [--warmup=3]
//
// The daemon runs with --backend=cuda --allow_shm on that unix socket, on
// the GPU this program uses (device 0).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "mhc/client/call_ring.h"
#include "mhc/client/client.h"
#include "mhc/client/shm.h"
#include "mhc/status.h"

ABSL_FLAG(std::string, address, "unix:/run/mhcd.sock", "daemon address");
ABSL_FLAG(int64_t, tokens, 4096, "tokens per step (M)");
ABSL_FLAG(int64_t, hidden, 4096, "C, the width of one stream");
ABSL_FLAG(int, n, 4, "streams");
ABSL_FLAG(int, steps, 20, "timed training steps");
ABSL_FLAG(int, warmup, 3, "steps before the timed ones");
ABSL_FLAG(bool, call_ring, true,
          "send the compute calls through the session's call ring "
          "(mhc/client/call_ring.h) instead of gRPC messages");
ABSL_FLAG(bool, deferred, true,
          "with the call ring, make the calls deferred: each returns once "
          "written, and the stream waits on the ring's done word");

namespace {

using mhc::v1::SharedMemoryRef;
using mhc::v1::TensorRef;

absl::Status Cuda(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

// The stream waits until a word of host memory reaches a value (the call
// ring's done word), through the driver's cuStreamWaitValue32.
class WordWaiter {
 public:
  // Page-locks the ring's first page, which holds the word, for the device.
  static absl::StatusOr<WordWaiter> Make(mhc::client::CallRing& ring) {
    WordWaiter waiter;
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found;
    MHC_RETURN_IF_ERROR(
        Cuda(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &function,
                                              12000, cudaEnableDefault, &found),
             "cuStreamWaitValue32 entry point"));
    if (found != cudaDriverEntryPointSuccess) {
      return absl::UnavailableError("the driver has no cuStreamWaitValue32");
    }
    waiter.wait_ = reinterpret_cast<PFN_cuStreamWaitValue32_v11070>(function);
    waiter.page_ = ring.ring_page();
    MHC_RETURN_IF_ERROR(Cuda(
        cudaHostRegister(waiter.page_, mhc::client::CallRing::kRingPageBytes,
                         cudaHostRegisterPortable | cudaHostRegisterMapped),
        "page-lock the ring's page"));
    MHC_RETURN_IF_ERROR(Cuda(
        cudaHostGetDevicePointer(&waiter.word_, ring.done_word(), 0), "word"));
    return waiter;
  }
  absl::Status Wait(cudaStream_t stream, uint32_t value) const {
    if (wait_(stream, reinterpret_cast<CUdeviceptr>(word_), value,
              CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS) {
      return absl::InternalError("cuStreamWaitValue32 failed");
    }
    return absl::OkStatus();
  }
  // Once no stream waits on the word any more.
  void Release() const { cudaHostUnregister(page_); }

 private:
  PFN_cuStreamWaitValue32_v11070 wait_ = nullptr;
  void* page_ = nullptr;
  void* word_ = nullptr;
};

// Consecutive pieces of one cudaMalloc allocation, registered as one region.
struct Arena {
  char* base = nullptr;
  uint64_t used = 0;
  uint64_t Take(uint64_t bytes) {
    const uint64_t offset = used;
    used += (bytes + 255) / 256 * 256;
    return offset;
  }
};

struct Tensor {
  mhc::v1::DType dtype;
  std::vector<int64_t> shape;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  TensorRef Ref() const {
    TensorRef ref;
    ref.set_dtype(dtype);
    for (int64_t d : shape) ref.add_shape(d);
    *ref.mutable_shm() = Out();
    return ref;
  }
  SharedMemoryRef Out() const {
    return mhc::client::ShmRef("activations", offset, bytes);
  }
};

absl::Status Run() {
  const int64_t m = absl::GetFlag(FLAGS_tokens);
  const int64_t c = absl::GetFlag(FLAGS_hidden);
  const int n = absl::GetFlag(FLAGS_n);
  MHC_ASSIGN_OR_RETURN(
      auto client, mhc::client::Client::Connect(absl::GetFlag(FLAGS_address)));
  MHC_ASSIGN_OR_RETURN(auto session, mhc::client::Session::Open(*client));
  MHC_RETURN_IF_ERROR(Cuda(cudaSetDevice(0), "cudaSetDevice"));
  cudaStream_t stream;
  MHC_RETURN_IF_ERROR(Cuda(
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream"));

  mhc::v1::CreateLayerRequest create;
  create.set_name(absl::StrCat("stream-ordered-step-", getpid()));
  create.set_preset("deepseek_v4");
  create.mutable_spec()->set_n(n);
  create.mutable_spec()->set_hidden(c);
  create.set_seed(1);
  MHC_ASSIGN_OR_RETURN(mhc::v1::LayerInfo layer, client->CreateLayer(create));
  const std::string name = layer.name();

  // Parameters in place: one mapping of the layer's allocation.
  MHC_ASSIGN_OR_RETURN(mhc::v1::LayerMemory memory,
                       client->MapLayerMemory(name));
  cudaIpcMemHandle_t layer_handle;
  std::memcpy(&layer_handle, memory.raw_handle().data(), sizeof(layer_handle));
  void* layer_base = nullptr;
  MHC_RETURN_IF_ERROR(Cuda(cudaIpcOpenMemHandle(&layer_base, layer_handle,
                                                cudaIpcMemLazyEnablePeerAccess),
                           "map the layer"));
  float* beta = reinterpret_cast<float*>(
      static_cast<char*>(layer_base) + memory.parameters().at("beta").offset());
  float* beta_grad = reinterpret_cast<float*>(
      static_cast<char*>(layer_base) + memory.gradients().at("beta").offset());
  const int64_t beta_count = memory.parameters().at("beta").shape(0);

  // One event each way is enough for calls made one after another: a wait
  // event may be recorded again once its call returned, and the daemon's
  // event once this stream waited for it.
  cudaEvent_t ready, done;
  MHC_RETURN_IF_ERROR(
      Cuda(cudaEventCreateWithFlags(
               &ready, cudaEventInterprocess | cudaEventDisableTiming),
           "event"));
  cudaIpcEventHandle_t ready_handle;
  MHC_RETURN_IF_ERROR(
      Cuda(cudaIpcGetEventHandle(&ready_handle, ready), "event handle"));
  MHC_ASSIGN_OR_RETURN(
      std::vector<std::string> daemon_events,
      client->RegisterCudaEvents(
          0, {std::string(reinterpret_cast<char*>(&ready_handle),
                          sizeof(ready_handle))}));
  cudaIpcEventHandle_t done_handle;
  std::memcpy(&done_handle, daemon_events.at(0).data(), sizeof(done_handle));
  MHC_RETURN_IF_ERROR(
      Cuda(cudaIpcOpenEventHandle(&done, done_handle), "open daemon event"));

  // Activations and every output in one allocation, registered once.
  const int logits = 2 * n + n * n;
  Arena arena;
  auto make = [&](mhc::v1::DType dtype, std::vector<int64_t> shape) {
    Tensor t{dtype, shape};
    uint64_t elements = 1;
    for (int64_t d : shape) elements *= static_cast<uint64_t>(d);
    t.bytes = elements * (dtype == mhc::v1::DTYPE_F32 ? 4 : 2);
    t.offset = arena.Take(t.bytes);
    return t;
  };
  const auto bf16 = mhc::v1::DTYPE_BF16, f32 = mhc::v1::DTYPE_F32;
  Tensor x = make(bf16, {m, n, c}), y = make(bf16, {m, c}),
         h_pre = make(f32, {m, n}), h_post = make(f32, {m, n}),
         h_res = make(f32, {m, n, n}), h = make(f32, {m, logits}),
         mean_square = make(f32, {m}), x_next = make(bf16, {m, n, c}),
         dx_next = make(bf16, {m, n, c}), df = make(bf16, {m, c}),
         dh_post = make(f32, {m, n}), dh_res = make(f32, {m, n, n}),
         dx = make(bf16, {m, n, c});
  MHC_RETURN_IF_ERROR(Cuda(
      cudaMalloc(reinterpret_cast<void**>(&arena.base), arena.used), "malloc"));
  {
    // Random bf16 x and upstream gradient (upper halves of random floats).
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    std::vector<uint16_t> host(x.bytes / 2);
    for (Tensor* t : {&x, &dx_next}) {
      for (uint16_t& v : host) {
        float f = normal(rng);
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        v = static_cast<uint16_t>(bits >> 16);
      }
      MHC_RETURN_IF_ERROR(Cuda(cudaMemcpy(arena.base + t->offset, host.data(),
                                          t->bytes, cudaMemcpyHostToDevice),
                               "upload"));
    }
  }
  cudaIpcMemHandle_t arena_handle;
  MHC_RETURN_IF_ERROR(
      Cuda(cudaIpcGetMemHandle(&arena_handle, arena.base), "arena handle"));
  MHC_RETURN_IF_ERROR(client->RegisterCudaSharedMemory(
      "activations",
      std::string(reinterpret_cast<char*>(&arena_handle), sizeof(arena_handle)),
      0, 0));

  // Each call: record `ready` after this stream's work, name it and the
  // daemon's event, then make this stream wait for the daemon's work.
  client->set_stream_order({/*wait_event=*/0, /*signal_event=*/0});
  std::shared_ptr<mhc::client::CallRing> ring;
  std::optional<WordWaiter> waiter;
  if (absl::GetFlag(FLAGS_call_ring)) {
    MHC_ASSIGN_OR_RETURN(ring, mhc::client::CallRing::Open(*client));
    client->set_call_ring(ring);
    if (absl::GetFlag(FLAGS_deferred)) {
      MHC_ASSIGN_OR_RETURN(waiter, WordWaiter::Make(*ring));
    }
  }
  auto record_ready = [&] {
    return Cuda(cudaEventRecord(ready, stream), "record");
  };
  // `method` with `request`, as `by_client` would send it.
  auto ordered = [&](const char* method,
                     const google::protobuf::Message& request,
                     auto&& by_client) -> absl::Status {
    if (waiter.has_value()) {
      uint32_t seq = 0;
      bool sent = false;
      MHC_RETURN_IF_ERROR(ring->Post(method, request, {0, -1}, record_ready,
                                     client->timeout(), &seq, &sent));
      return waiter->Wait(stream, seq);
    }
    MHC_RETURN_IF_ERROR(record_ready());
    MHC_RETURN_IF_ERROR(by_client());
    return Cuda(cudaStreamWaitEvent(stream, done, 0), "wait");
  };

  mhc::v1::PreRequest pre;
  pre.set_layer(name);
  *pre.mutable_x() = x.Ref();
  pre.set_keep_projection(true);
  for (auto [key, t] :
       {std::pair{"y", &y}, std::pair{"h_pre", &h_pre},
        std::pair{"h_post", &h_post}, std::pair{"h_res", &h_res},
        std::pair{"h", &h}, std::pair{"mean_square", &mean_square}}) {
    (*pre.mutable_output_regions())[key] = t->Out();
  }
  // The sub-layer is the identity here: f is y.
  mhc::v1::PostRequest post;
  post.set_layer(name);
  *post.mutable_f() = y.Ref();
  *post.mutable_x() = x.Ref();
  *post.mutable_h_post() = h_post.Ref();
  *post.mutable_h_res() = h_res.Ref();
  (*post.mutable_output_regions())["x_next"] = x_next.Out();
  mhc::v1::PostBackwardRequest post_backward;
  post_backward.set_layer(name);
  *post_backward.mutable_dx_next() = dx_next.Ref();
  *post_backward.mutable_f() = y.Ref();
  *post_backward.mutable_x() = x.Ref();
  *post_backward.mutable_h_post() = h_post.Ref();
  *post_backward.mutable_h_res() = h_res.Ref();
  post_backward.set_skip_dx(true);  // PreBackward adds it to the layer's dx
  (*post_backward.mutable_output_regions())["df"] = df.Out();
  (*post_backward.mutable_output_regions())["dh_post"] = dh_post.Out();
  (*post_backward.mutable_output_regions())["dh_res"] = dh_res.Out();
  mhc::v1::PreBackwardRequest pre_backward;
  pre_backward.set_layer(name);
  *pre_backward.mutable_x() = x.Ref();
  *pre_backward.mutable_dy() = df.Ref();
  *pre_backward.mutable_dh_post() = dh_post.Ref();
  *pre_backward.mutable_dh_res() = dh_res.Ref();
  *pre_backward.mutable_dx_next() = dx_next.Ref();
  *pre_backward.mutable_h() = h.Ref();
  *pre_backward.mutable_mean_square() = mean_square.Ref();
  (*pre_backward.mutable_output_regions())["dx"] = dx.Out();

  auto step = [&]() -> absl::Status {
    // The accumulators are this program's to zero, in stream order.
    MHC_RETURN_IF_ERROR(
        Cuda(cudaMemsetAsync(beta_grad, 0, beta_count * sizeof(float), stream),
             "zero grad"));
    MHC_RETURN_IF_ERROR(
        ordered("Pre", pre, [&] { return client->Pre(pre).status(); }));
    MHC_RETURN_IF_ERROR(
        ordered("Post", post, [&] { return client->Post(post).status(); }));
    MHC_RETURN_IF_ERROR(ordered("PostBackward", post_backward, [&] {
      return client->PostBackward(post_backward).status();
    }));
    return ordered("PreBackward", pre_backward,
                   [&] { return client->PreBackward(pre_backward).status(); });
  };
  const int steps = absl::GetFlag(FLAGS_steps);
  for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) {
    MHC_RETURN_IF_ERROR(step());
  }
  MHC_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(stream), "synchronize"));
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) MHC_RETURN_IF_ERROR(step());
  MHC_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(stream), "synchronize"));
  // The last deferred call's answer: its failure, if it failed.
  if (waiter.has_value()) MHC_RETURN_IF_ERROR(ring->Flush(client->timeout()));
  const double ms = std::chrono::duration<double, std::milli>(
                        std::chrono::steady_clock::now() - start)
                        .count();
  std::vector<float> host_beta(beta_count), host_grad(beta_count);
  // The last step's gradient of beta, read where the daemon accumulated it.
  MHC_RETURN_IF_ERROR(
      Cuda(cudaMemcpy(host_grad.data(), beta_grad, beta_count * sizeof(float),
                      cudaMemcpyDeviceToHost),
           "read grad"));
  MHC_RETURN_IF_ERROR(
      Cuda(cudaMemcpy(host_beta.data(), beta, beta_count * sizeof(float),
                      cudaMemcpyDeviceToHost),
           "read beta"));
  double norm = 0;
  for (float g : host_grad) norm += static_cast<double>(g) * g;
  std::printf(
      "%d steps of (M=%lld, n=%d, C=%lld): %.3f ms/step; |dbeta| = %g, "
      "beta[0] = %g\n",
      steps, static_cast<long long>(m), n, static_cast<long long>(c),
      ms / steps, std::sqrt(norm), host_beta[0]);
  if (waiter.has_value()) waiter->Release();
  cudaIpcCloseMemHandle(layer_base);
  cudaFree(arena.base);
  MHC_RETURN_IF_ERROR(client->DeleteLayer(name).status());
  if (!std::isfinite(norm) || norm == 0) {
    return absl::InternalError("the gradient of beta is zero or not finite");
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::Status status = Run();
  if (!status.ok()) {
    std::fprintf(stderr, "stream_ordered_step: %s\n",
                 std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
