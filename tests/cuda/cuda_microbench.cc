// A small event-timed benchmark of the CUDA backend's memory-bound ops at
// one production shape (M = 16384, C = 4096, n = 4, bf16): median of
// repetitions with L2 flushed in between, one JSON line per op, checked
// against the fp64 reference on a sample of tokens first.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "cuda/cuda_backend.h"
#include "mhc/backend.h"
#include "mhc/cuda.h"

namespace mhc {
namespace {

constexpr int64_t kTokens = 16384;
constexpr int64_t kHidden = 4096;
constexpr int kStreams = 4;
constexpr int kReps = 30;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Run() {
  if (CudaDeviceCount() == 0) {
    std::printf("{\"skipped\": \"no CUDA device\"}\n");
    return 0;
  }
  auto made = cuda::CudaBackend::Create(0);
  if (!made.ok()) {
    std::fprintf(stderr, "%s\n", made.status().ToString().c_str());
    return 1;
  }
  cuda::CudaBackend& be = **made;
  cudaStream_t stream = be.stream();
  LayerSpec spec = PresetSpec("deepseek_v4", kStreams, kHidden).value();
  const int64_t M = kTokens, C = kHidden, K = spec.K(), n = kStreams;
  const int64_t N = spec.NumLogits();
  const DType dt = DType::kBF16;
  auto alloc = [&](size_t bytes) { return be.Allocate(bytes).value(); };
  auto upload = [&](const std::vector<float>& v) {
    void* p = alloc(v.size() * 4);
    (void)be.CopyToDevice(p, v.data(), v.size() * 4);
    return static_cast<float*>(p);
  };
  auto upload_act = [&](int64_t count) {
    testing::ActTensor t = testing::RandomAct(dt, count, count + 17);
    void* p = alloc(t.bytes.size());
    (void)be.CopyToDevice(p, t.data(), t.bytes.size());
    return p;
  };
  void* x = upload_act(M * K);
  void* f = upload_act(M * C);
  void* y = alloc(M * C * 2);
  void* x_next = alloc(M * K * 2);
  const float scale = 1.0f / std::sqrt(static_cast<float>(K));
  float* phi = upload(testing::RandomFloats(N * K, 1, -scale, scale));
  float* alpha = upload(std::vector<float>(3, 1.0f));
  float* beta = upload(testing::RandomFloats(N, 2));
  float* h_pre = upload(testing::RandomFloats(M * n, 3, 0.0f, 1.0f));
  float* h_post = upload(testing::RandomFloats(M * n, 4, 0.0f, 2.0f));
  float* h_res = upload(testing::RandomFloats(M * n * n, 5, 0.0f, 1.0f));
  const size_t flush_bytes = size_t{512} << 20;
  void* flush = alloc(flush_bytes);

  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  auto time = [&](const char* op, double bytes,
                  const std::function<absl::Status()>& body) {
    std::vector<double> us;
    for (int r = 0; r < kReps + 3; ++r) {
      cudaMemsetAsync(flush, r & 0xff, flush_bytes, stream);
      cudaEventRecord(start, stream);
      absl::Status st = body();
      cudaEventRecord(stop, stream);
      cudaEventSynchronize(stop);
      if (!st.ok()) {
        std::fprintf(stderr, "%s: %s\n", op, st.ToString().c_str());
        return;
      }
      float ms = 0.0f;
      cudaEventElapsedTime(&ms, start, stop);
      if (r >= 3) us.push_back(ms * 1000.0);
    }
    const double med = Median(us);
    std::printf(
        "{\"op\": \"%s\", \"M\": %lld, \"C\": %lld, \"n\": %d, \"dtype\": "
        "\"bf16\", \"us\": %.2f, \"bytes\": %.0f, \"GBps\": %.1f}\n",
        op, static_cast<long long>(M), static_cast<long long>(C), kStreams, med,
        bytes, bytes / (med * 1e3));
  };

  // Copy bandwidth: bytes read + written by a large device-to-device copy.
  const size_t copy_bytes = size_t{1} << 30;
  void* a = alloc(copy_bytes);
  void* b = alloc(copy_bytes);
  time("copy_d2d", 2.0 * copy_bytes, [&] {
    cudaMemcpyAsync(b, a, copy_bytes, cudaMemcpyDeviceToDevice, stream);
    return absl::OkStatus();
  });
  be.Free(a);
  be.Free(b);

  AggregateForwardParams ag;
  ag.spec = &spec;
  ag.tokens = M;
  ag.act_dtype = dt;
  ag.x = x;
  ag.h_pre = h_pre;
  ag.y = y;
  time("aggregate_forward", M * (2.0 * K + 2.0 * C + 4.0 * n),
       [&] { return be.AggregateForward(ag, Workspace{}); });

  PostForwardParams po;
  po.spec = &spec;
  po.tokens = M;
  po.act_dtype = dt;
  po.f = f;
  po.x = x;
  po.h_post = h_post;
  po.h_res = h_res;
  po.x_next = x_next;
  time("post_forward", M * (2.0 * C + 4.0 * K + 4.0 * (n + n * n)),
       [&] { return be.PostForward(po, Workspace{}); });

  PreForwardParams pf;
  pf.spec = &spec;
  pf.tokens = M;
  pf.act_dtype = dt;
  pf.x = x;
  pf.weights.phi = phi;
  pf.weights.alpha = alpha;
  pf.weights.beta = beta;
  pf.y = y;
  pf.h_post = h_post;
  pf.h_res = h_res;
  time("pre_forward", M * (2.0 * K + 2.0 * C + 4.0 * (n + n * n)),
       [&] { return be.PreForward(pf, Workspace{}); });

  // Pieces of the pre forward, to see where its time goes.
  float* h = upload(testing::RandomFloats(M * N, 6));
  float* ms = upload(testing::RandomFloats(M, 7, 0.5f, 1.5f));
  ProjectionForwardParams pj;
  pj.spec = &spec;
  pj.tokens = M;
  pj.act_dtype = dt;
  pj.x = x;
  pj.weights = pf.weights;
  pj.h = h;
  pj.mean_square = ms;
  time("projection_forward", M * (2.0 * K + 4.0 * (N + 1)),
       [&] { return be.ProjectionForward(pj, Workspace{}); });
  float* logits = upload(testing::RandomFloats(M * n * n, 8, -2.0f, 2.0f));
  SinkhornForwardParams sk;
  sk.spec = &spec;
  sk.tokens = M;
  sk.logits = logits;
  sk.h_res = h_res;
  time("sinkhorn_forward", M * 8.0 * n * n,
       [&] { return be.SinkhornForward(sk, Workspace{}); });
  float* dlogits = upload(testing::RandomFloats(M * n * n, 9));
  SinkhornBackwardParams sb;
  sb.spec = &spec;
  sb.tokens = M;
  sb.logits = logits;
  sb.dh_res = h_res;
  sb.dlogits = dlogits;
  time("sinkhorn_backward", M * 12.0 * n * n,
       [&] { return be.SinkhornBackward(sb, Workspace{}); });

  // Backward of the memory-bound ops and the fused pre.
  void* dx = alloc(M * K * 2);
  void* df = alloc(M * C * 2);
  float* dh_pre = upload(testing::RandomFloats(M * n, 10));
  AggregateBackwardParams ab;
  ab.spec = &spec;
  ab.tokens = M;
  ab.act_dtype = dt;
  ab.x = x;
  ab.h_pre = h_pre;
  ab.dy = f;
  ab.dx = dx;
  ab.dh_pre = dh_pre;
  time("aggregate_backward", M * (2.0 * C + 4.0 * K + 8.0 * n),
       [&] { return be.AggregateBackward(ab, Workspace{}); });
  float* dh_post = upload(testing::RandomFloats(M * n, 11));
  float* dh_res = upload(testing::RandomFloats(M * n * n, 12));
  PostBackwardParams pb;
  pb.spec = &spec;
  pb.tokens = M;
  pb.act_dtype = dt;
  pb.dx_next = x_next;
  pb.f = f;
  pb.x = x;
  pb.h_post = h_post;
  pb.h_res = h_res;
  pb.df = df;
  pb.dx = dx;
  pb.dh_post = dh_post;
  pb.dh_res = dh_res;
  time("post_backward", M * (6.0 * K + 4.0 * C + 8.0 * (n + n * n)),
       [&] { return be.PostBackward(pb, Workspace{}); });
  const size_t ws_bytes = be.WorkspaceBytes(OpKind::kPreBackward, spec, M, dt);
  Workspace ws{alloc(ws_bytes), ws_bytes};
  float* gphi = upload(std::vector<float>(N * K, 0.0f));
  float* gsmall = upload(std::vector<float>(N + 3, 0.0f));
  PreBackwardParams qb;
  qb.spec = &spec;
  qb.tokens = M;
  qb.act_dtype = dt;
  qb.x = x;
  qb.weights = pf.weights;
  qb.dy = f;
  qb.dh_post = dh_post;
  qb.dh_res = dh_res;
  qb.dx_next = x_next;
  qb.dx = dx;
  qb.grads.phi = gphi;
  qb.grads.alpha = gsmall;
  qb.grads.beta = gsmall + 3;
  time("pre_backward", M * (6.0 * K + 2.0 * C),
       [&] { return be.PreBackward(qb, ws); });
  return 0;
}

}  // namespace
}  // namespace mhc

int main() { return mhc::Run(); }
