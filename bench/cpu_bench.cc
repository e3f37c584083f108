// mhc_cpu_bench: every op of the fast CPU backend, forward and backward, at a
// few shapes, against the bandwidth of a memcpy on the same threads. One JSON
// line per measurement, then a table. Each op is first checked against the
// fp64 reference on a small sample of tokens so a fast wrong kernel is never
// reported.
//
// Usage: mhc_cpu_bench [--threads=2] [--reps=3] [--quick]   (--help lists
// them)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "bench/bench_flags.h"
#include "mhc/backend.h"
#include "mhc/dtype.h"

namespace mhc {
namespace {

using Clock = std::chrono::steady_clock;

// Fast deterministic fill: uniform in [lo, hi), never all zeros.
void Fill(float* out, int64_t count, uint64_t seed, float lo, float hi) {
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < count; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const float unit = static_cast<float>(state >> 40) * 0x1p-24f;
    out[i] = lo + (hi - lo) * unit;
  }
}

struct Act {
  DType dtype;
  std::vector<uint8_t> bytes;
  Act(DType d, int64_t count, uint64_t seed) : dtype(d) {
    bytes.resize(count * DTypeSize(d));
    std::vector<float> values(std::min<int64_t>(count, 1 << 20));
    Fill(values.data(), values.size(), seed, -1.0f, 1.0f);
    for (int64_t i = 0; i < count; ++i) {
      StoreActivation(bytes.data(), d, i, values[i % values.size()]);
    }
  }
  void* data() { return bytes.data(); }
};

std::vector<float> Floats(int64_t count, uint64_t seed, float lo, float hi) {
  std::vector<float> v(count);
  Fill(v.data(), count, seed, lo, hi);
  return v;
}

// All tensors of one shape, sized for M tokens.
struct Problem {
  LayerSpec spec, head;
  int64_t tokens;
  DType dtype;
  Act x, f, dy, dx_next, out_k, out_c;
  std::vector<float> phi, alpha, beta, gamma, h, ms, h_pre, h_post, h_res,
      logits, dh, dms, dh_pre, dh_post, dh_res, f32_a, f32_b, f32_c, f32_d,
      grad_phi, grad_small;
  Problem(const LayerSpec& s, int64_t m, DType d)
      : spec(s),
        head(s),
        tokens(m),
        dtype(d),
        x(d, m * s.K(), 1),
        f(d, m * s.hidden, 2),
        dy(d, m * s.hidden, 3),
        dx_next(d, m * s.K(), 4),
        out_k(d, m * s.K(), 5),
        out_c(d, m * s.hidden, 6) {
    head.kind = LayerKind::kHead;
    const int64_t n = s.n, big_n = s.NumLogits(), k = s.K();
    const float scale = 3.0f / std::sqrt(static_cast<float>(k));
    phi = Floats(big_n * k, 7, -scale, scale);
    alpha = Floats(3, 8, 0.5f, 1.5f);
    beta = Floats(big_n, 9, -1, 1);
    gamma = Floats(k, 10, 0.5f, 1.5f);
    h = Floats(m * big_n, 11, -1, 1);
    ms = Floats(m, 12, 0.1f, 2);
    h_pre = Floats(m * n, 13, 0.1f, 1);
    h_post = Floats(m * n, 14, 0, 2);
    h_res = Floats(m * n * n, 15, 0, 1);
    logits = Floats(m * n * n, 16, -2, 2);
    dh = Floats(m * big_n, 17, -1, 1);
    dms = Floats(m, 18, -1, 1);
    dh_pre = Floats(m * n, 19, -1, 1);
    dh_post = Floats(m * n, 20, -1, 1);
    dh_res = Floats(m * n * n, 21, -1, 1);
    f32_a.resize(m * big_n);
    f32_b.resize(m * big_n);
    f32_c.resize(m * n * n);
    f32_d.resize(m + 1);
    grad_phi.assign(big_n * k, 0.0f);
    grad_small.assign(std::max<int64_t>(k, 64), 0.0f);
  }
};

// Runs op on the first `m` tokens of p; returns the first output as floats.
absl::Status Run(Backend& b, OpKind op, Problem& p, int64_t m,
                 std::vector<uint8_t>& ws_buf) {
  const LayerSpec* spec =
      (op == OpKind::kHeadForward || op == OpKind::kHeadBackward) ? &p.head
                                                                  : &p.spec;
  const size_t need = b.WorkspaceBytes(op, *spec, m, p.dtype);
  if (ws_buf.size() < need) ws_buf.resize(need);
  Workspace ws{ws_buf.data(), ws_buf.size()};
  LayerWeights w{p.phi.data(), p.alpha.data(), p.beta.data(),
                 spec->has_gamma ? p.gamma.data() : nullptr, nullptr};
  LayerGrads g{p.grad_phi.data(), p.grad_small.data(), p.grad_small.data(),
               spec->has_gamma ? p.grad_small.data() : nullptr, nullptr};
  const DType dt = p.dtype;
  switch (op) {
    case OpKind::kProjectionForward:
      return b.ProjectionForward(
          {spec, m, dt, p.x.data(), w, p.f32_a.data(), p.f32_d.data()}, ws);
    case OpKind::kProjectionBackward:
      return b.ProjectionBackward({spec, m, dt, p.x.data(), w, p.dh.data(),
                                   p.dms.data(), p.out_k.data(), g},
                                  ws);
    case OpKind::kScaleForward:
      return b.ScaleForward({spec, m, p.h.data(), p.ms.data(), w,
                             p.f32_a.data(), p.f32_b.data(), p.f32_c.data()},
                            ws);
    case OpKind::kScaleBackward:
      return b.ScaleBackward(
          {spec, m, p.h.data(), p.ms.data(), w, p.dh_pre.data(),
           p.dh_post.data(), p.logits.data(), p.f32_a.data(), p.f32_d.data(),
           g},
          ws);
    case OpKind::kSinkhornForward:
      return b.SinkhornForward({spec, m, p.logits.data(), p.f32_c.data()}, ws);
    case OpKind::kSinkhornBackward:
      return b.SinkhornBackward(
          {spec, m, p.logits.data(), p.dh_res.data(), p.f32_c.data()}, ws);
    case OpKind::kAggregateForward:
      return b.AggregateForward(
          {spec, m, dt, p.x.data(), p.h_pre.data(), p.out_c.data()}, ws);
    case OpKind::kAggregateBackward:
      return b.AggregateBackward({spec, m, dt, p.x.data(), p.h_pre.data(),
                                  p.dy.data(), p.out_k.data(), p.f32_a.data()},
                                 ws);
    case OpKind::kPostForward:
      return b.PostForward({spec, m, dt, p.f.data(), p.x.data(),
                            p.h_post.data(), p.h_res.data(), w, p.out_k.data()},
                           ws);
    case OpKind::kPostBackward:
      return b.PostBackward(
          {spec, m, dt, p.dx_next.data(), p.f.data(), p.x.data(),
           p.h_post.data(), p.h_res.data(), w, p.out_c.data(), p.out_k.data(),
           p.f32_a.data(), p.f32_c.data(), g},
          ws);
    case OpKind::kExpandForward:
      return b.ExpandForward({spec, m, dt, p.f.data(), p.out_k.data()}, ws);
    case OpKind::kExpandBackward:
      return b.ExpandBackward({spec, m, dt, p.dx_next.data(), p.out_c.data()},
                              ws);
    case OpKind::kPreForward:
      return b.PreForward({spec, m, dt, p.x.data(), w, p.out_c.data(),
                           p.f32_a.data(), p.f32_b.data(), p.f32_c.data()},
                          ws);
    case OpKind::kPreBackward:
      return b.PreBackward(
          {spec, m, dt, p.x.data(), w, p.dy.data(), p.dh_post.data(),
           p.dh_res.data(), p.dx_next.data(), p.out_k.data(), g},
          ws);
    case OpKind::kHeadForward:
      return b.HeadForward(
          {spec, m, dt, p.x.data(), w, p.out_c.data(), p.f32_a.data()}, ws);
    case OpKind::kHeadBackward:
      return b.HeadBackward(
          {spec, m, dt, p.x.data(), w, p.dy.data(), p.out_k.data(), g}, ws);
  }
  return absl::InternalError("unknown op");
}

// Primary output of op, as floats (activation or fp32).
std::vector<float> PrimaryOutput(OpKind op, Problem& p, int64_t m) {
  auto act = [&](Act& a, int64_t count) {
    std::vector<float> v(count);
    for (int64_t i = 0; i < count; ++i) {
      v[i] = LoadActivation(a.data(), a.dtype, i);
    }
    return v;
  };
  const int64_t n = p.spec.n;
  switch (op) {
    case OpKind::kProjectionForward:
      return {p.f32_a.begin(), p.f32_a.begin() + m * p.spec.NumLogits()};
    case OpKind::kScaleForward:
    case OpKind::kScaleBackward:
      return {p.f32_a.begin(), p.f32_a.begin() + m * n};
    case OpKind::kSinkhornForward:
    case OpKind::kSinkhornBackward:
      return {p.f32_c.begin(), p.f32_c.begin() + m * n * n};
    case OpKind::kAggregateForward:
    case OpKind::kExpandBackward:
    case OpKind::kPreForward:
    case OpKind::kHeadForward:
      return act(p.out_c, m * p.spec.hidden);
    default:
      return act(p.out_k, m * p.spec.K());
  }
}

// Bytes that must move per call (the roofline count), parameters once.
double OpBytes(OpKind op, const LayerSpec& s, int64_t m, DType dt) {
  const double a = DTypeSize(dt), k = s.K(), c = s.hidden, n = s.n;
  const double big_n = s.NumLogits(), nn = n * n;
  double per = 0;
  switch (op) {
    case OpKind::kProjectionForward:
      per = a * k + 4 * big_n + 4;
      break;
    case OpKind::kProjectionBackward:
      per = 2 * a * k + 4 * big_n + 4;
      break;
    case OpKind::kScaleForward:
      per = 8 * big_n + 4;
      break;
    case OpKind::kScaleBackward:
      per = 12 * big_n + 8;
      break;
    case OpKind::kSinkhornForward:
      per = 8 * nn;
      break;
    case OpKind::kSinkhornBackward:
      per = 12 * nn;
      break;
    case OpKind::kAggregateForward:
      per = a * k + a * c + 4 * n;
      break;
    case OpKind::kAggregateBackward:
      per = 2 * a * k + a * c + 8 * n;
      break;
    case OpKind::kPostForward:
      per = 2 * a * k + a * c + 4 * (n + nn);
      break;
    case OpKind::kPostBackward:
      per = 3 * a * k + 2 * a * c + 8 * (n + nn);
      break;
    case OpKind::kExpandForward:
      per = a * k + a * c;
      break;
    case OpKind::kExpandBackward:
      per = a * k + a * c;
      break;
    case OpKind::kPreForward:
      per = a * k + a * c + 4 * (2 * n + nn);
      break;
    case OpKind::kPreBackward:
      per = 3 * a * k + a * c + 4 * (n + nn);
      break;
    case OpKind::kHeadForward:
      per = a * k + a * c + 4 * n;
      break;
    case OpKind::kHeadBackward:
      per = 2 * a * k + a * c;
      break;
  }
  const bool params = op == OpKind::kProjectionForward ||
                      op == OpKind::kProjectionBackward ||
                      op >= OpKind::kPreForward;
  return per * m + (params ? 4.0 * big_n * k : 0.0);
}

double MedianUs(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// memcpy split over a fixed set of threads (created once, like the
// backend's pool), so that the baseline runs on the same number of cores.
class Copier {
 public:
  explicit Copier(int threads) : threads_(std::max(1, threads)) {
    for (int t = 1; t < threads_; ++t) {
      workers_.emplace_back([this, t] { Loop(t); });
    }
  }
  ~Copier() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }
  // Copies `bytes` from src to dst.
  void Copy(uint8_t* dst, const uint8_t* src, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      dst_ = dst;
      src_ = src;
      bytes_ = bytes;
      busy_ = threads_ - 1;
      ++generation_;
    }
    cv_.notify_all();
    Part(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return busy_ == 0; });
  }

 private:
  void Part(int t) {
    const size_t part = bytes_ / threads_;
    const size_t end = t == threads_ - 1 ? bytes_ : (t + 1) * part;
    std::memcpy(dst_ + t * part, src_ + t * part, end - t * part);
  }
  void Loop(int t) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      Part(t);
      std::lock_guard<std::mutex> lock(mu_);
      if (--busy_ == 0) done_.notify_one();
    }
  }
  int threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_, done_;
  uint64_t generation_ = 0;
  int busy_ = 0;
  bool stop_ = false;
  uint8_t* dst_ = nullptr;
  const uint8_t* src_ = nullptr;
  size_t bytes_ = 0;
};

// Median microseconds of copying `bytes` (read `bytes`, write `bytes`).
double MemcpyUs(Copier& copier, std::vector<uint8_t>& src,
                std::vector<uint8_t>& dst, size_t bytes, int reps) {
  if (src.size() < bytes) {
    src.assign(bytes, 1);
    dst.assign(bytes, 2);
  }
  std::vector<double> times;
  for (int r = 0; r < reps + 1; ++r) {
    auto start = Clock::now();
    copier.Copy(dst.data(), src.data(), bytes);
    const double us =
        std::chrono::duration<double, std::micro>(Clock::now() - start).count();
    if (r > 0 || reps == 0) times.push_back(us);  // first one warms up
  }
  return MedianUs(times);
}

struct Row {
  std::string op, dir, dtype;
  int64_t m, c;
  double us, gbps, pct;
  bool ok;
};

}  // namespace
}  // namespace mhc

ABSL_FLAG(int32_t, threads, 2, "cpu backend and memcpy threads");
ABSL_FLAG(int32_t, reps, 3, "timed repetitions per measurement (median)");
ABSL_FLAG(bool, quick, false, "one small shape only");

int main(int argc, char** argv) {
  using namespace mhc;
  if (!bench::ParseBenchFlags(argc, argv, "cpu_bench.cc",
                              "every op of the fast CPU backend against a "
                              "memcpy of the same bytes")) {
    return 2;
  }
  const int threads = absl::GetFlag(FLAGS_threads);
  const int reps = absl::GetFlag(FLAGS_reps);
  const bool quick = absl::GetFlag(FLAGS_quick);
  if (threads < 1 || reps < 1) {
    std::fprintf(stderr, "mhc_cpu_bench: --threads and --reps: at least 1\n");
    return 2;
  }
  auto cpu = MakeCpuBackend(threads);
  auto ref = MakeReferenceBackend();
  Copier copier(threads);
  std::vector<uint8_t> copy_src, copy_dst;
  const size_t big = size_t{256} << 20;
  const double memcpy_gbps =
      2.0 * big / MemcpyUs(copier, copy_src, copy_dst, big, reps) / 1e3;
  std::printf(
      "{\"op\":\"memcpy\",\"threads\":%d,\"bytes\":%zu,\"gbps\":%.2f,"
      "\"device\":\"%s\"}\n",
      threads, big, memcpy_gbps, cpu->DeviceDescription().c_str());
  struct Shape {
    int64_t m, c;
    DType dtype;
  };
  std::vector<Shape> shapes = {{4096, 4096, DType::kBF16},
                               {4096, 4096, DType::kF32},
                               {2048, 5129, DType::kBF16}};
  if (quick) shapes = {{512, 1024, DType::kBF16}};
  std::vector<Row> rows;
  std::vector<uint8_t> ws_cpu, ws_ref;
  bool all_ok = true;
  for (const Shape& shape : shapes) {
    LayerSpec spec = *PresetSpec("deepseek_v4", 4, shape.c);
    Problem p(spec, shape.m, shape.dtype);
    for (int o = 0; o < kNumOpKinds; ++o) {
      const OpKind op = static_cast<OpKind>(o);
      // Correctness on a sample of 4 tokens against the fp64 reference.
      const int64_t sample = 4;
      absl::Status st = Run(*ref, op, p, sample, ws_ref);
      const std::vector<float> want = PrimaryOutput(op, p, sample);
      if (st.ok()) st = Run(*cpu, op, p, sample, ws_cpu);
      const std::vector<float> got = PrimaryOutput(op, p, sample);
      double max_ref = 0, max_err = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        max_ref = std::max(max_ref, std::fabs(double{want[i]}));
        max_err = std::max(max_err, std::fabs(double{got[i]} - want[i]));
      }
      const double tol = shape.dtype == DType::kF32 ? 1e-5 : 1e-2;
      const bool ok = st.ok() && max_err <= tol * std::max(max_ref, 1e-30);
      all_ok = all_ok && ok;
      // The op and a memcpy moving the same bytes (half read, half written)
      // alternate, so both see the same load on a shared machine.
      const double bytes = OpBytes(op, spec, shape.m, shape.dtype);
      std::vector<double> times, copies;
      for (int r = 0; r < reps + 1 && st.ok(); ++r) {
        auto start = Clock::now();
        st = Run(*cpu, op, p, shape.m, ws_cpu);
        const double us =
            std::chrono::duration<double, std::micro>(Clock::now() - start)
                .count();
        if (r > 0) times.push_back(us);
        copies.push_back(MemcpyUs(copier, copy_src, copy_dst,
                                  static_cast<size_t>(bytes / 2), 0));
      }
      if (!st.ok()) {
        std::fprintf(stderr, "%s\n", std::string(st.message()).c_str());
        return 1;
      }
      const double us = MedianUs(times);
      const double copy_us = MedianUs(copies);
      const double gbps = bytes / us / 1e3;
      Row row{std::string(OpFamilyName(op)),
              std::string(OpDirectionName(op)),
              std::string(DTypeName(shape.dtype)),
              shape.m,
              shape.c,
              us,
              gbps,
              100.0 * copy_us / us,
              ok};
      rows.push_back(row);
      std::printf(
          "{\"op\":\"%s\",\"direction\":\"%s\",\"M\":%lld,\"n\":4,\"C\":%lld,"
          "\"dtype\":\"%s\",\"us\":%.1f,\"bytes\":%.0f,\"gbps\":%.2f,"
          "\"pct_memcpy\":%.1f,\"check\":\"%s\",\"rel_err\":%.2e}\n",
          row.op.c_str(), row.dir.c_str(), static_cast<long long>(row.m),
          static_cast<long long>(row.c), row.dtype.c_str(), us, bytes, gbps,
          row.pct, ok ? "ok" : "FAIL", max_err / std::max(max_ref, 1e-30));
      std::fflush(stdout);
    }
  }
  std::printf("\nmemcpy (%d threads): %.2f GB/s (read + write)\n", threads,
              memcpy_gbps);
  std::printf("%-11s %-9s %-5s %6s %6s %11s %8s %8s %5s\n", "op", "dir",
              "dtype", "M", "C", "us", "GB/s", "%memcpy", "check");
  for (const Row& r : rows) {
    std::printf("%-11s %-9s %-5s %6lld %6lld %11.1f %8.2f %8.1f %5s\n",
                r.op.c_str(), r.dir.c_str(), r.dtype.c_str(),
                static_cast<long long>(r.m), static_cast<long long>(r.c), r.us,
                r.gbps, r.pct, r.ok ? "ok" : "FAIL");
  }
  return all_ok ? 0 : 2;
}
