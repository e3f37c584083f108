// The GPU benchmark: every op forward and backward and the whole layer (pre +
// post) forward and forward+backward, at the layer configs of
// bench/configs.json (n = 4, bf16 activations, STREAM_MAJOR, deepseek_v4,
// deterministic), through the Backend interface of the CUDA backend.
// Medians of event-timed repetitions with L2 flushed before each; every op's
// outputs on the first tokens are checked against the float64 reference
// backend on the same inputs in the same run. Each measured op is also
// captured once into a CUDA graph, not run, to count its kernel launches
// (bench/gpu_launches.h). One JSON line per measurement, then a table (us,
// % of copy bandwidth, launches). First, the timing floor under the same
// flush: two events with nothing between them, and with one empty kernel
// between them; an op's time minus the latter is what its kernels add.
//
// --shapes runs the named shape cases instead: the layer forward and
// forward+backward of n4 (the baseline), n16, c5120, c5129, fp16, fp32 and
// stream_minor, two configs each, holding each case's % of copy bandwidth
// against its baseline's at the config of the same (B, T): the baseline's
// fraction over the case's at most 1.3 for n16 (against n4), 1.15 for
// c5129 (against c5120), 1.1 for fp16, fp32 and stream_minor (against n4).
// A missed target is reported, not an error; failed checks are.
//
//   mhc_gpu_bench [--configs=all|small|first|I,J,...] [--reps=20]
//                 [--ops=all|a,b]
//                 [--n=4] [--hidden=C]   (other stream counts, one width for
//                                         every config: e.g. odd C = 5129)
//                 [--dtype=bf16|f16|f32] [--layout=stream_major|stream_minor]
//                 [--precision=tf32|ieee]
//                 [--flush=write|read]
//                 [--head_start_us=T]   (a GPU spin before each timed run:
//                                        the host enqueues ahead of it)
//                 [--timeline]   (one more run per op, its kernels printed
//                                 from CUPTI's records)
//                 [--recompute_projection]  (layer cases: the pre backward
//                                            recomputes h from x)
//   mhc_gpu_bench --shapes [--reps=20] [--flush=write|read]
//                 [--recompute_projection]
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "bench/bench_configs.h"
#include "bench/bench_flags.h"
#include "bench/gpu_cases.h"
#include "bench/gpu_launches.h"
#include "bench/gpu_options.h"
#include "bench/gpu_timing.h"
#include "bench/kernel_timeline.h"
#include "mhc/backend.h"
#include "mhc/cuda.h"
#include "mhc/cuda_tools.h"
#include "mhc/dtype.h"

namespace mhc::bench {
namespace {

constexpr int kWarmup = 3;
constexpr int64_t kCheckTokens = 8;

// Distance in steps of the 16-bit dtype `act` (bf16 or f16) between two
// values that are exact in it.
int64_t Ulps16(DType act, double a, double b) {
  auto ordered = [act](double v) -> int64_t {
    const float f = static_cast<float>(v);
    const int64_t bits = static_cast<int16_t>(
        act == DType::kF16 ? FloatToHalf(f) : FloatToBf16(f));
    return bits < 0 ? INT16_MIN - bits : bits;
  };
  return std::llabs(ordered(a) - ordered(b));
}

// Error of `got` against `want` (both elements of tensor t): the norm-wise
// relative error, or with `ulp` (16-bit activations only) the number of
// elements more than one ulp off (ignoring differences below 2^-18 of the
// largest magnitude, where fp32 accumulation cannot resolve a
// cancellation).
double Mismatch(int t, const std::vector<uint8_t>& got, const uint8_t* want,
                int64_t count, DType act, bool ulp) {
  auto at = [&](const uint8_t* d, int64_t i) -> double {
    return IsAct(t) ? LoadActivation(d, act, i)
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
    if (ulp && d > std::ldexp(scale, -18) && Ulps16(act, a, b) > 1) ++bad;
  }
  return ulp ? static_cast<double>(bad) : max_diff / std::max(scale, 1e-30);
}

// A named case of --shapes: its layer, the configs it runs at, and the case
// whose % of copy bandwidth it is held against at the config of the same
// index (the same B and T).
struct NamedCase {
  const char* name;
  const char* baseline;  // itself for a baseline
  double target;         // most baseline fraction / case fraction; 0: none
  Shape shape;
  std::vector<Config> configs;
};

// Two token counts per case; n16 runs at n4's configs (it moves four times
// the bytes, so the largest, (4, 4096, 4096), is the one the set's time and
// memory are sized by), c5129 beside c5120 at the same B and T.
const std::vector<NamedCase>& NamedCases() {
  static const std::vector<NamedCase>* cases = [] {
    const std::vector<Config> c4096 = {{1, 8192, 4096}, {4, 4096, 4096}};
    auto with = [](int streams, DType act, Layout layout) {
      Shape s;
      s.streams = streams, s.act = act, s.layout = layout;
      return s;
    };
    const Shape base;
    return new std::vector<NamedCase>{
        {"n4", "n4", 0, base, c4096},
        {"n16", "n4", 1.3, with(16, DType::kBF16, Layout::kStreamMajor), c4096},
        {"c5120", "c5120", 0, base, {{2, 4096, 5120}, {4, 4096, 5120}}},
        {"c5129", "c5120", 1.15, base, {{2, 4096, 5129}, {4, 4096, 5129}}},
        {"fp16", "n4", 1.1, with(4, DType::kF16, Layout::kStreamMajor), c4096},
        {"fp32", "n4", 1.1, with(4, DType::kF32, Layout::kStreamMajor), c4096},
        {"stream_minor", "n4", 1.1, with(4, DType::kBF16, Layout::kStreamMinor),
         c4096},
    };
  }();
  return *cases;
}

struct Result {
  double us = 0, pct = 0;
  std::optional<LaunchCount> launches;  // none where the capture failed
};

// "12+1": kernel launches, plus memset and memcpy nodes where there are
// any; "?" where they could not be counted.
std::string LaunchesCell(const std::optional<LaunchCount>& l) {
  if (!l.has_value()) return "?";
  const int copies = l->memsets + l->memcpys;
  return copies == 0 ? absl::StrCat(l->kernels)
                     : absl::StrCat(l->kernels, "+", copies);
}

// `text` as the inside of a JSON string.
std::string JsonEscape(absl::string_view text) {
  std::string out;
  for (char ch : text) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      out += ' ';
    } else {
      out += ch;
    }
  }
  return out;
}

std::string ConfigLabel(const Config& c) {
  return absl::StrCat(c.B, ",", c.T, ",", c.C);
}

class Bench {
 public:
  // `case_name`: the named case of --shapes, or null.
  Bench(Backend& gpu, FlushedTimer& timer, double copy_gbps, int reps,
        const Shape& shape, bool keep_projection, const char* case_name)
      : gpu_(gpu),
        timer_(timer),
        copy_gbps_(copy_gbps),
        reps_(reps),
        shape_(shape),
        keep_projection_(keep_projection),
        case_name_(case_name) {
    dev_.act = shape.act;
  }
  // After each case's timed runs and checks, one more run with its kernels
  // recorded and printed (kernel_timeline.h).
  void PrintTimelines(bool on) { timelines_ = on; }

  ~Bench() {
    for (void* p : dev_.p) {
      if (p != nullptr) gpu_.Free(p);
    }
    if (dev_.ws.data != nullptr) gpu_.Free(dev_.ws.data);
  }

  // Allocates every tensor for the largest of `configs` once and fills the
  // inputs with random data; smaller configs use a prefix of each buffer.
  absl::Status Allocate(const std::vector<Config>& configs) {
    std::mt19937_64 rng(20261121);
    for (int t = 0; t < kNumTensors; ++t) {
      int64_t count = 0;
      for (const Config& c : configs) {
        const LayerSpec s = Spec(c);
        count = std::max(count, Elements(t, s) * (PerToken(t) ? c.B * c.T : 1));
      }
      absl::StatusOr<void*> p = gpu_.Allocate(count * ElemSize(t, dev_.act));
      if (!p.ok()) return p.status();
      dev_.p[t] = *p;
      absl::Status st = Fill(t, count, rng);
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }

  int64_t Hidden(const Config& cfg) const {
    return shape_.hidden > 0 ? shape_.hidden : cfg.C;
  }
  LayerSpec Spec(const Config& cfg) const {
    LayerSpec spec =
        PresetSpec("deepseek_v4", shape_.streams, Hidden(cfg)).value();
    spec.layout = shape_.layout;
    spec.matmul_precision = shape_.precision;
    return spec;
  }

  // Times, counts the launches of and checks every selected case at one
  // config; false on a failed correctness check (timings are still
  // printed).
  absl::StatusOr<bool> RunConfig(const Config& cfg,
                                 const std::vector<bool>& cases,
                                 std::map<int, Result>& row) {
    const LayerSpec spec = Spec(cfg);
    LayerSpec head = spec;
    head.kind = LayerKind::kHead;
    const int64_t M = cfg.B * cfg.T;
    absl::Status st = UploadParameters(spec, head);
    if (!st.ok()) return st;
    const size_t ws = WorkspaceFor(gpu_, spec, head, M, dev_.act);
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
                             ElemSize(check.tensor, dev_.act));
        if (!st.ok()) return st;
      }
      auto run = [&] {
        return RunCase(c, gpu_, spec, head, dev_, M, keep_projection_);
      };
      absl::StatusOr<double> us = timer_.MedianUs(kWarmup, reps_, run);
      if (!us.ok()) return us.status();
      // After the timed runs, so that anything an op sets up on its first
      // run is done; the capture runs nothing, so the outputs checked
      // below are still those of the timed runs.
      absl::StatusOr<LaunchCount> launches = CountLaunches(gpu_, run);
      const double bytes = BytesPerToken(c, spec, dev_.act, keep_projection_) *
                           static_cast<double>(M);
      const double gbps = bytes / (*us * 1e3);
      const double pct = 100.0 * gbps / copy_gbps_;
      Result& result = row[c];
      result = Result{*us, pct, std::nullopt};
      std::string counted;
      if (launches.ok()) {
        result.launches = *launches;
        counted = absl::StrCat("\"launches\": ", launches->kernels,
                               ", \"memsets\": ", launches->memsets,
                               ", \"memcpys\": ", launches->memcpys,
                               ", \"other_nodes\": ", launches->other);
      } else {
        counted = absl::StrCat(
            "\"launches\": null, \"memsets\": null, \"memcpys\": null, "
            "\"other_nodes\": null, \"launches_error\": \"",
            JsonEscape(launches.status().ToString()), "\"");
      }
      const std::string named =
          case_name_ == nullptr ? "null" : absl::StrCat("\"", case_name_, "\"");
      std::printf(
          "{\"impl\": \"mhcd\", \"case\": %s, \"op\": \"%s\", "
          "\"direction\": \"%s\", \"config\": \"%s\", \"M\": %lld, \"n\": "
          "%d, \"C\": %lld, \"dtype\": \"%s\", \"layout\": \"%s\", "
          "\"precision\": \"%s\", "
          "\"mode\": \"deterministic\", \"variant\": \"%s\", \"us\": %.2f, "
          "\"bytes\": %.0f, \"gbps\": %.1f, \"pct_copy\": %.1f, %s}\n",
          named.c_str(), Info(c).op, Info(c).direction,
          ConfigLabel(cfg).c_str(), static_cast<long long>(M), shape_.streams,
          static_cast<long long>(Hidden(cfg)),
          std::string(DTypeName(dev_.act)).c_str(),
          std::string(LayoutName(shape_.layout)).c_str(),
          PrecisionName(shape_.precision),
          std::string(CaseVariant(c, gpu_, spec, head, dev_, M)).c_str(), *us,
          bytes, gbps, pct, counted.c_str());
      absl::StatusOr<bool> good = CheckCase(c, spec, head, cfg);
      if (!good.ok()) return good.status();
      ok = ok && *good;
      if (timelines_) {
        if (st = PrintTimeline(c, cfg, run); !st.ok()) return st;
      }
      std::fflush(stdout);
    }
    return ok;
  }

  // One more run of case c, flushed as the timed ones, with its kernels
  // recorded and printed. Tracing slows the host's launches, so the run
  // waits behind a spin long enough for the host to have queued all of it:
  // the spans show the GPU's own gaps and overlaps.
  absl::Status PrintTimeline(int c, const Config& cfg,
                             const std::function<absl::Status()>& run) {
    constexpr double kTracedHeadStartUs = 2000.0;
    KernelTimeline timeline;
    if (absl::Status st = timeline.Begin(); !st.ok()) return st;
    absl::StatusOr<double> us = timer_.MedianUs(0, 1, [&] {
      absl::Status st = EnqueueCudaSpin(gpu_, kTracedHeadStartUs);
      return st.ok() ? run() : st;
    });
    absl::StatusOr<std::vector<GpuSpan>> spans = timeline.End();
    if (!us.ok()) return us.status();
    if (!spans.ok()) return spans.status();
    // The flush and the spin ran first.
    const auto spin =
        std::find_if(spans->begin(), spans->end(), [](const GpuSpan& s) {
          return s.name.find("spin_kernel") != std::string::npos;
        });
    if (spin != spans->end()) spans->erase(spans->begin(), spin + 1);
    std::printf("timeline: %s %s at %s\n%s", Info(c).op, Info(c).direction,
                ConfigLabel(cfg).c_str(), FormatTimeline(*spans).c_str());
    return absl::OkStatus();
  }

 private:
  // Inputs get random non-zero values; outputs NaN (all bits set) so an
  // element never written fails the check; gradients zero.
  absl::Status Fill(int t, int64_t count, std::mt19937_64& rng) {
    const size_t bytes = count * ElemSize(t, dev_.act);
    if (IsGrad(t)) return gpu_.Memset(dev_.p[t], 0, bytes);
    if (t >= kY && t <= kDe) return gpu_.Memset(dev_.p[t], 0xff, bytes);
    // Large activations repeat a random block of odd length, so rows of
    // different tokens still differ, without generating gigabytes on the
    // host.
    const int64_t block = std::min<int64_t>(count, (int64_t{1} << 22) + 9);
    std::vector<uint8_t> host(block * ElemSize(t, dev_.act));
    auto [lo, hi] = Range(t);
    std::uniform_real_distribution<float> dist(lo, hi);
    for (int64_t i = 0; i < block; ++i) {
      const float v = dist(rng);
      if (IsAct(t)) {
        StoreActivation(host.data(), dev_.act, i, v);
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
    ref.act = dev_.act;
    for (int t = 0; t < kNumTensors; ++t) {
      const int64_t count =
          Elements(t, spec) * (PerToken(t) ? kCheckTokens : 1);
      host[t].assign(count * ElemSize(t, dev_.act), 0);
      ref.p[t] = host[t].data();
      if (!IsGrad(t)) {
        st = gpu_.CopyToHost(host[t].data(), dev_.p[t], host[t].size());
        if (!st.ok()) return st;
      }
    }
    std::vector<std::vector<uint8_t>> got(kNumTensors);
    for (const Check& check : Info(c).checks)
      got[check.tensor] = host[check.tensor];
    std::vector<uint8_t> ws(
        WorkspaceFor(*ref_, spec, head, kCheckTokens, dev_.act));
    ref.ws = Workspace{ws.data(), ws.size()};
    st = RunCase(c, *ref_, spec, head, ref, kCheckTokens, keep_projection_);
    if (!st.ok()) return st;
    bool ok = true;
    for (const Check& check : Info(c).checks) {
      const int t = check.tensor;
      // f32 activations have no one-ulp rounding to hold element-wise
      // results to; they get the fp32 norm-wise bound instead.
      const bool ulp = check.tol == 0 && dev_.act != DType::kF32;
      const double tol =
          check.tol == 0 && !ulp ? kF32ElementwiseTol : check.tol;
      const double err =
          Mismatch(t, got[t], host[t].data(), kCheckTokens * Elements(t, spec),
                   dev_.act, ulp);
      if (ulp ? err > 0 : !(err <= tol)) {
        std::printf(
            "FAIL %s%s%s %s config %s (%s, %s): %s %s %g (limit %s)\n",
            case_name_ == nullptr ? "" : case_name_,
            case_name_ == nullptr ? "" : " ", Info(c).op, Info(c).direction,
            ConfigLabel(cfg).c_str(), std::string(DTypeName(dev_.act)).c_str(),
            std::string(LayoutName(shape_.layout)).c_str(), kTensorNames[t],
            ulp ? "elements over 1 ulp:" : "relative error", err,
            ulp ? "0" : std::to_string(tol).c_str());
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
  const Shape shape_;
  const bool keep_projection_;
  const char* const case_name_;  // null outside --shapes
  bool timelines_ = false;
  Tensors dev_;
};

void PrintTable(const std::vector<Config>& configs,
                const std::vector<std::map<int, Result>>& rows) {
  std::printf("\n%-36s", "op / direction  (us/%copy/launches)");
  for (const Config& c : configs) {
    std::printf(" %18s", ConfigLabel(c).c_str());
  }
  std::printf("\n");
  for (int k = 0; k < kNumCases; ++k) {
    if (rows.empty() || rows[0].count(k) == 0) continue;
    std::string label = std::string(Info(k).op) + " " + Info(k).direction;
    std::printf("%-36s", label.c_str());
    for (const auto& row : rows) {
      const Result& r = row.at(k);
      const std::string cell =
          absl::StrCat(absl::StrFormat("%.1f/%.0f%%/", r.us, r.pct),
                       LaunchesCell(r.launches));
      std::printf(" %18s", cell.c_str());
    }
    std::printf("\n");
  }
}

// Runs every named case of --shapes (rows[i][j]: case i at its config j);
// false on a failed correctness check.
absl::StatusOr<bool> RunShapes(
    const Options& flags, Backend& gpu, FlushedTimer& timer, double copy_gbps,
    std::vector<std::vector<std::map<int, Result>>>& rows) {
  bool ok = true;
  for (const NamedCase& named : NamedCases()) {
    // One case's buffers at a time: n16 and fp32 need the most.
    Bench bench(gpu, timer, copy_gbps, flags.reps, named.shape,
                flags.keep_projection, named.name);
    absl::Status st = bench.Allocate(named.configs);
    if (!st.ok()) return st;
    rows.emplace_back();
    for (const Config& cfg : named.configs) {
      rows.back().emplace_back();
      absl::StatusOr<bool> good =
          bench.RunConfig(cfg, flags.cases, rows.back().back());
      if (!good.ok()) return good.status();
      ok = ok && *good;
    }
  }
  return ok;
}

// The named cases' table: each measurement, and for a case held against a
// baseline, the baseline's % of copy bandwidth over the case's at the same
// config index and whether that is within the target. One JSON line per
// comparison too.
void PrintShapesTable(
    const std::vector<std::vector<std::map<int, Result>>>& rows) {
  const std::vector<NamedCase>& cases = NamedCases();
  auto index_of = [&](const char* name) {
    for (size_t i = 0; i < cases.size(); ++i) {
      if (std::strcmp(cases[i].name, name) == 0) return i;
    }
    return cases.size();
  };
  std::vector<std::string> lines;
  int held = 0, met = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const NamedCase& named = cases[i];
    const size_t b = index_of(named.baseline);
    for (size_t j = 0; j < named.configs.size(); ++j) {
      for (int k : {kLayerFwd, kLayerFwdBwd}) {
        const Result& r = rows[i][j].at(k);
        std::string ratio = "-", target = "baseline", verdict = "-";
        if (b != i && b < cases.size()) {
          const Result& base = rows[b][j].at(k);
          const double q = base.pct / r.pct;
          const bool good = q <= named.target;
          ratio = absl::StrFormat("%.2fx", q);
          target = absl::StrFormat("%.2fx", named.target);
          verdict = good ? "met" : "missed";
          ++held;
          met += good ? 1 : 0;
          std::printf(
              "{\"impl\": \"mhcd\", \"op\": \"shape_target\", \"case\": "
              "\"%s\", \"baseline\": \"%s\", \"direction\": \"%s\", "
              "\"config\": \"%s\", \"baseline_config\": \"%s\", "
              "\"pct_copy\": %.1f, \"baseline_pct_copy\": %.1f, \"ratio\": "
              "%.3f, \"target\": %.2f, \"met\": %s}\n",
              named.name, named.baseline, Info(k).direction,
              ConfigLabel(named.configs[j]).c_str(),
              ConfigLabel(cases[b].configs[j]).c_str(), r.pct, base.pct, q,
              named.target, good ? "true" : "false");
        }
        lines.push_back(absl::StrFormat(
            "%-13s %-15s %-17s %9.1f %6.1f%% %8s %7s %8s %s", named.name,
            ConfigLabel(named.configs[j]), Info(k).direction, r.us, r.pct,
            LaunchesCell(r.launches), ratio, target, verdict));
      }
    }
  }
  std::printf("\n%-13s %-15s %-17s %9s %7s %8s %7s %8s %s\n", "case", "config",
              "direction", "us", "%copy", "launches", "ratio", "target",
              "result");
  for (const std::string& line : lines) std::printf("%s\n", line.c_str());
  std::printf(
      "ratio: the baseline's %% of copy over the case's at the same B, T "
      "(n16, fp16, fp32, stream_minor against n4; c5129 against c5120); "
      "shape targets met: %d of %d\n",
      met, held);
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
      FlushedTimer::Create(**gpu, flags.flush, flags.head_start_us);
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
  std::vector<std::vector<std::map<int, Result>>> shape_rows;
  absl::Status st;
  if (flags.shapes) {
    absl::StatusOr<bool> good =
        RunShapes(flags, **gpu, **timer, copy_gbps, shape_rows);
    st = good.status();
    ok = good.ok() && *good;
  } else {
    Bench bench(**gpu, **timer, copy_gbps, flags.reps, flags.shape,
                flags.keep_projection, nullptr);
    bench.PrintTimelines(flags.timeline);
    st = bench.Allocate(flags.configs);
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
  }
  if (!st.ok()) {
    std::fprintf(stderr, "error: %s\n", st.ToString().c_str());
    return 1;
  }
  const std::string layer =
      flags.shapes ? std::string("the named shape cases")
                   : absl::StrFormat("n = %d, %s, %s, %s", flags.shape.streams,
                                     DTypeName(flags.shape.act),
                                     LayoutName(flags.shape.layout),
                                     PrecisionName(flags.shape.precision));
  std::printf(
      "\ndevice %s, copy bandwidth %.0f GB/s (nominal %.0f), %s, "
      "deepseek_v4, deterministic, median of %d, L2 flushed by a %s; "
      "timing floor %.2f us (events alone %.2f us)\n",
      device.c_str(), copy_gbps, peak, layer.c_str(), flags.reps,
      FlushName(flags.flush), *floor_kernel, *floor_events);
  if (flags.head_start_us > 0.0) {
    std::printf("each run after a %.0f us GPU spin: the host enqueues ahead\n",
                flags.head_start_us);
  }
  std::printf("layer cases: the pre backward %s\n",
              flags.keep_projection
                  ? "takes the projection the pre forward kept"
                  : "recomputes the projection from x");
  std::printf(
      "launches: kernel launches of one run of the op, + memset and memcpy "
      "nodes where there are any, from a CUDA graph capture of it; ? where "
      "the capture failed (its JSON line says why)\n");
  if (flags.shapes) {
    PrintShapesTable(shape_rows);
  } else {
    if (flags.shape.hidden > 0) {
      std::printf("every config run at C = %lld (labels keep B, T, C)\n",
                  static_cast<long long>(flags.shape.hidden));
    }
    PrintTable(flags.configs, rows);
  }
  std::printf("%s\n", ok ? "all checks vs the float64 reference passed"
                         : "FAIL: some outputs differ from the reference");
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace mhc::bench

int main(int argc, char** argv) {
  if (!mhc::bench::ParseBenchFlags(
          argc, argv, "gpu_options.cc",
          "the GPU benchmark of every op and the layer on the CUDA backend")) {
    return 2;
  }
  return mhc::bench::Run();
}
