// The GPU benchmark: every op forward and backward and the whole layer (pre +
// post) forward and forward+backward, at the layer configs of
// bench/configs.json (n = 4, bf16 activations, deepseek_v4, deterministic),
// through the Backend interface of the CUDA backend. Medians of event-timed
// repetitions with L2 flushed before each; every op's outputs on the first
// tokens are checked against the float64 reference backend on the same
// inputs in the same run. One JSON line per measurement, then a table (us
// and % of copy bandwidth). First, the timing floor under the same flush:
// two events with nothing between them, and with one empty kernel between
// them; an op's time minus the latter is what its kernels add.
//
//   mhc_gpu_bench [--configs=all|small|first|I,J,...] [--reps=20]
//                 [--ops=all|a,b]
//                 [--n=4] [--hidden=C]   (other stream counts, one width for
//                                         every config: e.g. odd C = 5129)
//                 [--flush=write|read]
//                 [--recompute_projection]  (layer cases: the pre backward
//                                            recomputes h from x)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "bench/bench_configs.h"
#include "bench/bench_flags.h"
#include "bench/gpu_cases.h"
#include "bench/gpu_timing.h"
#include "mhc/backend.h"
#include "mhc/cuda.h"
#include "mhc/cuda_tools.h"
#include "mhc/dtype.h"

ABSL_FLAG(std::string, configs, "all",
          "configs: all (the layer configs of bench/configs.json), small (its "
          "small ones), first, or indices I,J,... into the layer configs "
          "followed by the small ones");
ABSL_FLAG(int32_t, reps, 20, "timed repetitions per measurement (median)");
ABSL_FLAG(std::string, ops, "all",
          "op families: all, or a,b of projection, scale, sinkhorn, "
          "aggregate, post, expand, pre, head, layer");
ABSL_FLAG(int32_t, n, 4, "residual streams (1..16)");
ABSL_FLAG(int64_t, hidden, 0,
          "one hidden width C for every config (0: each config's own), "
          "e.g. odd 5129");
ABSL_FLAG(bool, recompute_projection, false,
          "layer cases: the pre backward recomputes the projection from x "
          "instead of taking the one the pre forward kept");
ABSL_FLAG(std::string, flush, "write",
          "L2 flush before each timed run: write or read a 256 MiB buffer");

namespace mhc::bench {
namespace {

constexpr int kWarmup = 3;
constexpr int64_t kCheckTokens = 8;

// Distance in bf16 steps between two values that are exact in bf16.
int64_t BfUlps(double a, double b) {
  auto ordered = [](double v) -> int64_t {
    const int64_t bits =
        static_cast<int16_t>(FloatToBf16(static_cast<float>(v)));
    return bits < 0 ? INT16_MIN - bits : bits;
  };
  return std::llabs(ordered(a) - ordered(b));
}

// Error of `got` against `want` (both elements of tensor t): the norm-wise
// relative error, or for tol == 0 the number of elements more than one bf16
// ulp off (ignoring differences below 2^-18 of the largest magnitude, where
// fp32 accumulation cannot resolve a cancellation).
double Mismatch(int t, const std::vector<uint8_t>& got, const uint8_t* want,
                int64_t count, bool ulp) {
  auto at = [&](const uint8_t* d, int64_t i) -> double {
    return IsAct(t) ? LoadActivation(d, kAct, i)
                    : reinterpret_cast<const float*>(d)[i];
  };
  double max_diff = 0.0, scale = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    const double b = at(want, i);
    if (std::isfinite(b)) scale = std::max(scale, std::fabs(b));
  }
  int64_t bad = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double a = at(got.data(), i), b = at(want, i);
    if (!std::isfinite(a) || !std::isfinite(b)) {
      if (!(std::isnan(a) && std::isnan(b))) ++bad, max_diff = INFINITY;
      continue;
    }
    const double d = std::fabs(a - b);
    max_diff = std::max(max_diff, d);
    if (ulp && d > std::ldexp(scale, -18) && BfUlps(a, b) > 1) ++bad;
  }
  return ulp ? static_cast<double>(bad) : max_diff / std::max(scale, 1e-30);
}

// What the flags ask for, checked.
struct Options {
  std::vector<int> configs;
  int reps = 0;
  std::vector<bool> cases = std::vector<bool>(kNumCases, true);
  Flush flush = Flush::kWrite;
  int streams = 0;
  int64_t hidden = 0;
  bool keep_projection = true;
};

const char* FlushName(Flush f) { return f == Flush::kWrite ? "write" : "read"; }

// The flags as Options, or an error naming the flag.
absl::Status ParseOptions(Options& flags) {
  flags.reps = absl::GetFlag(FLAGS_reps);
  if (flags.reps < 1) return absl::InvalidArgumentError("--reps: at least 1");
  flags.streams = absl::GetFlag(FLAGS_n);
  if (flags.streams < 1 || flags.streams > kMaxStreams) {
    return absl::InvalidArgumentError(
        absl::StrCat("--n: 1 to ", kMaxStreams, " streams"));
  }
  flags.hidden = absl::GetFlag(FLAGS_hidden);
  if (flags.hidden < 0) return absl::InvalidArgumentError("--hidden: >= 0");
  flags.keep_projection = !absl::GetFlag(FLAGS_recompute_projection);
  const std::string flush = absl::GetFlag(FLAGS_flush);
  if (flush == "write") {
    flags.flush = Flush::kWrite;
  } else if (flush == "read") {
    flags.flush = Flush::kRead;
  } else {
    return absl::InvalidArgumentError("--flush: write or read");
  }
  const std::string configs = absl::GetFlag(FLAGS_configs);
  if (configs == "all" || configs == "first") {
    for (int c = 0; c < (configs == "all" ? kNumLayerConfigs : 1); ++c) {
      flags.configs.push_back(c);
    }
  } else if (configs == "small") {
    for (int c = kNumLayerConfigs; c < kNumConfigs; ++c) {
      flags.configs.push_back(c);
    }
  } else {
    for (absl::string_view part : absl::StrSplit(configs, ',')) {
      int index = 0;
      if (!absl::SimpleAtoi(part, &index) || index < 0 ||
          index >= kNumConfigs) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--configs: all, small, first or indices 0 to ", kNumConfigs - 1));
      }
      flags.configs.push_back(index);
    }
  }
  const std::string ops = absl::GetFlag(FLAGS_ops);
  if (ops != "all") {
    flags.cases.assign(kNumCases, false);
    for (absl::string_view op : absl::StrSplit(ops, ',')) {
      bool known = false;
      for (int c = 0; c < kNumCases; ++c) {
        if (op == Info(c).op) flags.cases[c] = known = true;
      }
      if (!known) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--ops: unknown op '", op,
            "' (projection, scale, sinkhorn, aggregate, post, expand, pre, "
            "head, layer)"));
      }
    }
  }
  return absl::OkStatus();
}

struct Result {
  double us = 0, pct = 0;
};

class Bench {
 public:
  Bench(Backend& gpu, FlushedTimer& timer, double copy_gbps, int reps,
        int streams, int64_t hidden, bool keep_projection)
      : gpu_(gpu),
        timer_(timer),
        copy_gbps_(copy_gbps),
        reps_(reps),
        streams_(streams),
        hidden_(hidden),
        keep_projection_(keep_projection) {}
  ~Bench() {
    for (void* p : dev_.p) {
      if (p != nullptr) gpu_.Free(p);
    }
    if (dev_.ws.data != nullptr) gpu_.Free(dev_.ws.data);
  }

  // Allocates every tensor for the largest of `configs` once and fills the
  // inputs with random data; smaller configs use a prefix of each buffer.
  absl::Status Allocate(const std::vector<int>& configs) {
    std::mt19937_64 rng(20261121);
    for (int t = 0; t < kNumTensors; ++t) {
      int64_t count = 0;
      for (int c : configs) {
        const LayerSpec s = Spec(c);
        const int64_t m = kConfigs[c].B * kConfigs[c].T;
        count = std::max(count, Elements(t, s) * (PerToken(t) ? m : 1));
      }
      absl::StatusOr<void*> p = gpu_.Allocate(count * ElemSize(t));
      if (!p.ok()) return p.status();
      dev_.p[t] = *p;
      absl::Status st = Fill(t, count, rng);
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }

  int64_t Hidden(int config) const {
    return hidden_ > 0 ? hidden_ : kConfigs[config].C;
  }
  LayerSpec Spec(int config) const {
    return PresetSpec("deepseek_v4", streams_, Hidden(config)).value();
  }

  // Times and checks every selected case at one config; false on a failed
  // correctness check (timings are still printed).
  absl::StatusOr<bool> RunConfig(int config, const std::vector<bool>& cases,
                                 std::map<int, Result>& row) {
    const LayerSpec spec = Spec(config);
    LayerSpec head = spec;
    head.kind = LayerKind::kHead;
    const Config& cfg = kConfigs[config];
    const int64_t M = cfg.B * cfg.T;
    absl::Status st = UploadParameters(spec, head);
    if (!st.ok()) return st;
    const size_t ws = WorkspaceFor(gpu_, spec, head, M);
    if (ws > dev_.ws.bytes) {
      if (dev_.ws.data != nullptr) gpu_.Free(dev_.ws.data);
      absl::StatusOr<void*> p = gpu_.Allocate(ws);
      if (!p.ok()) return p.status();
      dev_.ws = Workspace{*p, ws};
    }
    bool ok = true;
    for (int c = 0; c < kNumCases; ++c) {
      if (!cases[c]) continue;
      for (const Check& check : Info(c).checks) {  // poison what is checked
        st = gpu_.Memset(dev_.p[check.tensor], 0xff,
                         kCheckTokens * Elements(check.tensor, spec) *
                             ElemSize(check.tensor));
        if (!st.ok()) return st;
      }
      absl::StatusOr<double> us = timer_.MedianUs(kWarmup, reps_, [&] {
        return RunCase(c, gpu_, spec, head, dev_, M, keep_projection_);
      });
      if (!us.ok()) return us.status();
      const double bytes =
          BytesPerToken(c, spec, keep_projection_) * static_cast<double>(M);
      const double gbps = bytes / (*us * 1e3);
      const double pct = 100.0 * gbps / copy_gbps_;
      row[c] = Result{*us, pct};
      std::printf(
          "{\"impl\": \"mhcd\", \"op\": \"%s\", \"direction\": \"%s\", "
          "\"config\": \"%lld,%lld,%lld\", \"M\": %lld, \"n\": %d, \"C\": "
          "%lld, \"dtype\": \"bf16\", \"mode\": \"deterministic\", "
          "\"variant\": \"%s\", \"us\": %.2f, \"bytes\": %.0f, \"gbps\": "
          "%.1f, \"pct_copy\": %.1f}\n",
          Info(c).op, Info(c).direction, static_cast<long long>(cfg.B),
          static_cast<long long>(cfg.T), static_cast<long long>(cfg.C),
          static_cast<long long>(M), streams_,
          static_cast<long long>(Hidden(config)),
          std::string(CaseVariant(c, gpu_, spec, head, dev_, M)).c_str(), *us,
          bytes, gbps, pct);
      absl::StatusOr<bool> good = CheckCase(c, spec, head, cfg);
      if (!good.ok()) return good.status();
      ok = ok && *good;
      std::fflush(stdout);
    }
    return ok;
  }

 private:
  // Inputs get random non-zero values; outputs NaN (all bits set) so an
  // element never written fails the check; gradients zero.
  absl::Status Fill(int t, int64_t count, std::mt19937_64& rng) {
    const size_t bytes = count * ElemSize(t);
    if (IsGrad(t)) return gpu_.Memset(dev_.p[t], 0, bytes);
    if (t >= kY && t <= kDe) return gpu_.Memset(dev_.p[t], 0xff, bytes);
    // Large activations repeat a random block of odd length, so rows of
    // different tokens still differ, without generating gigabytes on the
    // host.
    const int64_t block = std::min<int64_t>(count, (int64_t{1} << 22) + 9);
    std::vector<uint8_t> host(block * ElemSize(t));
    auto [lo, hi] = Range(t);
    std::uniform_real_distribution<float> dist(lo, hi);
    for (int64_t i = 0; i < block; ++i) {
      const float v = dist(rng);
      if (IsAct(t)) {
        StoreActivation(host.data(), kAct, i, v);
      } else {
        reinterpret_cast<float*>(host.data())[i] = v;
      }
    }
    const size_t block_bytes = host.size();
    for (size_t off = 0; off < bytes; off += block_bytes) {
      absl::Status st =
          gpu_.CopyToDevice(static_cast<uint8_t*>(dev_.p[t]) + off, host.data(),
                            std::min(block_bytes, bytes - off));
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }

  // phi scaled by 1/sqrt(K) keeps the logits of order one at every C.
  absl::Status UploadParameters(const LayerSpec& spec, const LayerSpec& head) {
    std::mt19937_64 rng(spec.hidden);
    const float scale = 1.0f / std::sqrt(static_cast<float>(spec.K()));
    auto upload = [&](int t, const LayerSpec& s, float lo, float hi) {
      std::uniform_real_distribution<float> dist(lo, hi);
      std::vector<float> v(Elements(t, s));
      for (float& x : v) x = dist(rng);
      return gpu_.CopyToDevice(dev_.p[t], v.data(), v.size() * 4);
    };
    absl::Status st = upload(kPhi, spec, -scale, scale);
    if (st.ok()) st = upload(kAlpha, spec, 0.5f, 1.5f);
    if (st.ok()) st = upload(kBeta, spec, -1.0f, 1.0f);
    if (st.ok()) st = upload(kHeadPhi, head, -scale, scale);
    if (st.ok()) st = upload(kHeadAlpha, head, 0.5f, 1.5f);
    if (st.ok()) st = upload(kHeadBeta, head, -1.0f, 1.0f);
    return st;
  }

  // Copies the first kCheckTokens tokens of every tensor (and the
  // parameters) to the host, reruns the case there on the reference backend
  // and compares the checked outputs.
  absl::StatusOr<bool> CheckCase(int c, const LayerSpec& spec,
                                 const LayerSpec& head, const Config& cfg) {
    absl::Status st = gpu_.Synchronize();
    if (!st.ok()) return st;
    std::vector<std::vector<uint8_t>> host(kNumTensors);
    Tensors ref;
    for (int t = 0; t < kNumTensors; ++t) {
      const int64_t count =
          Elements(t, spec) * (PerToken(t) ? kCheckTokens : 1);
      host[t].assign(count * ElemSize(t), 0);
      ref.p[t] = host[t].data();
      if (!IsGrad(t)) {
        st = gpu_.CopyToHost(host[t].data(), dev_.p[t], host[t].size());
        if (!st.ok()) return st;
      }
    }
    std::vector<std::vector<uint8_t>> got(kNumTensors);
    for (const Check& check : Info(c).checks)
      got[check.tensor] = host[check.tensor];
    std::vector<uint8_t> ws(WorkspaceFor(*ref_, spec, head, kCheckTokens));
    ref.ws = Workspace{ws.data(), ws.size()};
    st = RunCase(c, *ref_, spec, head, ref, kCheckTokens, keep_projection_);
    if (!st.ok()) return st;
    bool ok = true;
    for (const Check& check : Info(c).checks) {
      const int t = check.tensor;
      const double err =
          Mismatch(t, got[t], host[t].data(), kCheckTokens * Elements(t, spec),
                   check.tol == 0);
      if (check.tol == 0 ? err > 0 : !(err <= check.tol)) {
        std::printf(
            "FAIL %s %s config %lld,%lld,%lld: %s %s %g (limit %s)\n",
            Info(c).op, Info(c).direction, static_cast<long long>(cfg.B),
            static_cast<long long>(cfg.T), static_cast<long long>(cfg.C),
            kTensorNames[t],
            check.tol == 0 ? "elements over 1 ulp:" : "relative error", err,
            check.tol == 0 ? "0" : std::to_string(check.tol).c_str());
        ok = false;
      }
    }
    return ok;
  }

  Backend& gpu_;
  FlushedTimer& timer_;
  std::unique_ptr<Backend> ref_ = MakeReferenceBackend();
  const double copy_gbps_;
  const int reps_;
  const int streams_;
  const int64_t hidden_;  // 0: each config's own width
  const bool keep_projection_;
  Tensors dev_;
};

void PrintTable(const std::vector<int>& configs,
                const std::vector<std::map<int, Result>>& rows) {
  std::printf("\n%-27s", "op / direction  (us, %copy)");
  for (int c : configs) {
    char name[32];
    std::snprintf(name, sizeof(name), "%lld,%lld,%lld",
                  static_cast<long long>(kConfigs[c].B),
                  static_cast<long long>(kConfigs[c].T),
                  static_cast<long long>(kConfigs[c].C));
    std::printf(" %14s", name);
  }
  std::printf("\n");
  for (int k = 0; k < kNumCases; ++k) {
    if (rows.empty() || rows[0].count(k) == 0) continue;
    std::string label = std::string(Info(k).op) + " " + Info(k).direction;
    std::printf("%-27s", label.c_str());
    for (const auto& row : rows) {
      const Result& r = row.at(k);
      char cell[32];
      std::snprintf(cell, sizeof(cell), "%.1f/%.0f%%", r.us, r.pct);
      std::printf(" %14s", cell);
    }
    std::printf("\n");
  }
}

int Run() {
  Options flags;
  if (absl::Status parsed = ParseOptions(flags); !parsed.ok()) {
    std::fprintf(stderr, "mhc_gpu_bench: %s\n",
                 std::string(parsed.message()).c_str());
    return 2;
  }
  if (CudaDeviceCount() == 0) {
    std::printf("{\"skipped\": \"no CUDA device\"}\n");
    return 0;
  }
  absl::StatusOr<double> copy = MeasureCudaCopyBandwidth(0);
  absl::StatusOr<std::unique_ptr<Backend>> gpu = MakeCudaBackend(0);
  if (!copy.ok() || !gpu.ok()) {
    std::fprintf(stderr, "setup: %s %s\n", copy.status().ToString().c_str(),
                 gpu.status().ToString().c_str());
    return 1;
  }
  const std::string device = (*gpu)->DeviceDescription();
  const double copy_gbps = *copy * 1e-9;
  const double peak = device.find("H100") != std::string::npos   ? 3350.0
                      : device.find("H200") != std::string::npos ? 4800.0
                                                                 : 0.0;
  std::printf(
      "{\"impl\": \"mhcd\", \"op\": \"copy_d2d\", \"device\": \"%s\", "
      "\"gbps\": %.1f, \"nominal_peak_gbps\": %.0f}\n",
      device.c_str(), copy_gbps, peak);
  absl::StatusOr<std::unique_ptr<FlushedTimer>> timer =
      FlushedTimer::Create(**gpu, flags.flush);
  if (!timer.ok()) {
    std::fprintf(stderr, "timer: %s\n", timer.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<double> floor_events =
      (*timer)->MedianUs(kWarmup, flags.reps, [] { return absl::OkStatus(); });
  absl::StatusOr<double> floor_kernel = (*timer)->MedianUs(
      kWarmup, flags.reps, [&] { return EnqueueCudaEmptyKernel(**gpu); });
  if (!floor_events.ok() || !floor_kernel.ok()) {
    std::fprintf(stderr, "timing floor: %s %s\n",
                 floor_events.status().ToString().c_str(),
                 floor_kernel.status().ToString().c_str());
    return 1;
  }
  std::printf(
      "{\"impl\": \"mhcd\", \"op\": \"timing_floor\", \"flush\": \"%s\", "
      "\"events_us\": %.2f, \"empty_kernel_us\": %.2f}\n",
      FlushName(flags.flush), *floor_events, *floor_kernel);
  bool ok = true;
  std::vector<std::map<int, Result>> rows;
  {
    Bench bench(**gpu, **timer, copy_gbps, flags.reps, flags.streams,
                flags.hidden, flags.keep_projection);
    absl::Status st = bench.Allocate(flags.configs);
    for (size_t i = 0; st.ok() && i < flags.configs.size(); ++i) {
      rows.emplace_back();
      absl::StatusOr<bool> good =
          bench.RunConfig(flags.configs[i], flags.cases, rows.back());
      if (!good.ok()) {
        st = good.status();
      } else {
        ok = ok && *good;
      }
    }
    if (!st.ok()) {
      std::fprintf(stderr, "error: %s\n", st.ToString().c_str());
      return 1;
    }
  }
  std::printf(
      "\ndevice %s, copy bandwidth %.0f GB/s (nominal %.0f), n = %d, "
      "bf16, deepseek_v4, deterministic, median of %d, L2 flushed by a "
      "%s; timing floor %.2f us (events alone %.2f us)\n",
      device.c_str(), copy_gbps, peak, flags.streams, flags.reps,
      flags.flush == Flush::kWrite ? "write" : "read", *floor_kernel,
      *floor_events);
  std::printf("layer cases: the pre backward %s\n",
              flags.keep_projection
                  ? "takes the projection the pre forward kept"
                  : "recomputes the projection from x");
  if (flags.hidden > 0) {
    std::printf("every config run at C = %lld (labels keep B, T, C)\n",
                static_cast<long long>(flags.hidden));
  }
  PrintTable(flags.configs, rows);
  std::printf("%s\n", ok ? "all checks vs the float64 reference passed"
                         : "FAIL: some outputs differ from the reference");
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace mhc::bench

int main(int argc, char** argv) {
  if (!mhc::bench::ParseBenchFlags(
          argc, argv, "gpu_bench.cc",
          "the GPU benchmark of every op and the layer on the CUDA backend")) {
    return 2;
  }
  return mhc::bench::Run();
}
