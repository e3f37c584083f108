// A small event-timed benchmark of the CUDA backend's memory-bound ops: every
// op at one production shape (M = 16384, C = 4096, n = 4, bf16) and the
// projection, Sinkhorn and fused pre ops at M = 32768, C = 7168 and M = 2048,
// C = 12288. Median of repetitions with L2 flushed in between, one JSON line
// per op (with the fraction of the measured copy bandwidth), then a table.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench/gpu_timing.h"
#include "common/test_util.h"
#include "cuda/cuda_backend.h"
#include "mhc/backend.h"
#include "mhc/cuda.h"

namespace mhc {
namespace {

constexpr int kStreams = 4;
constexpr int kReps = 30;

struct Row {
  std::string op;
  int64_t M, C;
  double us, gbps, pct;
};

// Times every op (all) or the projection / Sinkhorn / fused pre ops at one
// shape; copy_gbps <= 0 measures the copy bandwidth first.
void RunShape(cuda::CudaBackend& be, int64_t M, int64_t C, bool all,
              double& copy_gbps, std::vector<Row>& table) {
  cudaStream_t stream = be.stream();
  LayerSpec spec = PresetSpec("deepseek_v4", kStreams, C).value();
  const int64_t K = spec.K(), n = kStreams;
  std::vector<void*> owned;
  const int64_t N = spec.NumLogits();
  const DType dt = DType::kBF16;
  auto alloc = [&](size_t bytes) {
    void* p = be.Allocate(bytes).value();
    owned.push_back(p);
    return p;
  };
  auto alloc_f = [&](int64_t count) {
    return static_cast<float*>(alloc(count * 4));
  };
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
  auto timer = bench::FlushedTimer::Create(be);
  if (!timer.ok()) {
    std::fprintf(stderr, "timer: %s\n", timer.status().ToString().c_str());
    return;
  }
  auto time = [&](const char* op, double bytes,
                  const std::function<absl::Status()>& body) {
    absl::StatusOr<double> timed = (*timer)->MedianUs(3, kReps, body);
    if (!timed.ok()) {
      std::fprintf(stderr, "%s: %s\n", op, timed.status().ToString().c_str());
      return;
    }
    const double med = *timed;
    const double gbps = bytes / (med * 1e3);
    const double pct = copy_gbps > 0 ? 100.0 * gbps / copy_gbps : 100.0;
    std::printf(
        "{\"op\": \"%s\", \"M\": %lld, \"C\": %lld, \"n\": %d, \"dtype\": "
        "\"bf16\", \"mode\": \"deterministic\", \"us\": %.2f, \"bytes\": "
        "%.0f, \"GBps\": %.1f, \"pct_copy\": %.1f}\n",
        op, static_cast<long long>(M), static_cast<long long>(C), kStreams, med,
        bytes, gbps, pct);
    std::fflush(stdout);
    table.push_back(Row{op, M, C, med, gbps, pct});
    if (std::string(op) == "copy_d2d") copy_gbps = gbps;
  };

  if (copy_gbps <= 0) {
    // Copy bandwidth: bytes read + written by a large device-to-device copy.
    const size_t copy_bytes = size_t{1} << 30;
    void* a = alloc(copy_bytes);
    void* b = alloc(copy_bytes);
    time("copy_d2d", 2.0 * copy_bytes, [&] {
      cudaMemcpyAsync(b, a, copy_bytes, cudaMemcpyDeviceToDevice, stream);
      return absl::OkStatus();
    });
  }

  AggregateForwardParams ag;
  ag.spec = &spec;
  ag.tokens = M;
  ag.act_dtype = dt;
  ag.x = x;
  ag.h_pre = h_pre;
  ag.y = y;
  if (all) {
    time("aggregate_forward", M * (2.0 * K + 2.0 * C + 4.0 * n),
         [&] { return be.AggregateForward(ag, Workspace{}); });
  }

  PostForwardParams po;
  po.spec = &spec;
  po.tokens = M;
  po.act_dtype = dt;
  po.f = f;
  po.x = x;
  po.h_post = h_post;
  po.h_res = h_res;
  po.x_next = x_next;
  if (all) {
    time("post_forward", M * (2.0 * C + 4.0 * K + 4.0 * (n + n * n)),
         [&] { return be.PostForward(po, Workspace{}); });
  }

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
  {
    // Scale backward with its dalpha / dbeta token reduction.
    float* dh_pre = upload(testing::RandomFloats(M * n, 15));
    float* dh_post = upload(testing::RandomFloats(M * n, 16));
    float* dh = alloc_f(M * N);
    float* dms = alloc_f(M);
    float* galpha = upload(std::vector<float>(3, 0.0f));
    float* gbeta = upload(std::vector<float>(N, 0.0f));
    const size_t sbytes =
        be.WorkspaceBytes(OpKind::kScaleBackward, spec, M, DType::kF32);
    ScaleBackwardParams q;
    q.spec = &spec;
    q.tokens = M;
    q.h = h;
    q.mean_square = ms;
    q.weights = pf.weights;
    q.dh_pre = dh_pre;
    q.dh_post = dh_post;
    q.dlogits = dlogits;
    q.dh = dh;
    q.dmean_square = dms;
    q.grads.alpha = galpha;
    q.grads.beta = gbeta;
    Workspace sws{alloc(sbytes), sbytes};
    time("scale_backward", M * 4.0 * (2.0 * N + 1 + 3 * n + n * n + 1),
         [&] { return be.ScaleBackward(q, sws); });
  }

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
  if (all) {
    time("aggregate_backward", M * (2.0 * C + 4.0 * K + 8.0 * n),
         [&] { return be.AggregateBackward(ab, Workspace{}); });
  }
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
  if (all) {
    time("post_backward", M * (6.0 * K + 4.0 * C + 8.0 * (n + n * n)),
         [&] { return be.PostBackward(pb, Workspace{}); });
  }
  {
    float* dh = upload(testing::RandomFloats(M * N, 13));
    float* dms = upload(testing::RandomFloats(M, 14));
    const size_t pbytes =
        be.WorkspaceBytes(OpKind::kProjectionBackward, spec, M, dt);
    Workspace pws{alloc(pbytes), pbytes};
    float* gp = upload(std::vector<float>(N * K, 0.0f));
    ProjectionBackwardParams jb;
    jb.spec = &spec;
    jb.tokens = M;
    jb.act_dtype = dt;
    jb.x = x;
    jb.weights = pf.weights;
    jb.dh = dh;
    jb.dmean_square = dms;
    jb.dx = dx;
    jb.grads.phi = gp;
    time("projection_backward", M * (4.0 * K + 4.0 * (N + 1)),
         [&] { return be.ProjectionBackward(jb, pws); });
  }
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
  for (void* p : owned) be.Free(p);
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
  double copy_gbps = 0.0;
  std::vector<Row> table;
  RunShape(**made, 16384, 4096, true, copy_gbps, table);
  RunShape(**made, 32768, 7168, false, copy_gbps, table);
  RunShape(**made, 2048, 12288, false, copy_gbps, table);
  std::printf("\n%-22s %7s %6s %10s %9s %7s\n", "op", "M", "C", "us", "GB/s",
              "%copy");
  for (const Row& r : table) {
    std::printf("%-22s %7lld %6lld %10.2f %9.1f %7.1f\n", r.op.c_str(),
                static_cast<long long>(r.M), static_cast<long long>(r.C), r.us,
                r.gbps, r.pct);
  }
  return 0;
}

}  // namespace
}  // namespace mhc

int main() { return mhc::Run(); }
