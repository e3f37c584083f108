#include "bench/gpu_options.h"

#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
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
ABSL_FLAG(std::string, dtype, "bf16", "activation dtype: bf16, f16 or f32");
ABSL_FLAG(std::string, layout, "stream_major",
          "activation layout: stream_major or stream_minor");
ABSL_FLAG(std::string, precision, "tf32",
          "the projection's matmul precision: tf32 or ieee");
ABSL_FLAG(bool, shapes, false,
          "run the named shape cases instead (n4, n16, c5120, c5129, fp16, "
          "fp32, stream_minor: the layer forward and forward+backward at "
          "their own configs, each held against its target ratio to its "
          "baseline's % of copy bandwidth); sets configs, ops, n, C, dtype "
          "and layout itself");
ABSL_FLAG(bool, recompute_projection, false,
          "layer cases: the pre backward recomputes the projection from x "
          "instead of taking the one the pre forward kept");
ABSL_FLAG(std::string, flush, "write",
          "L2 flush before each timed run: write or read a 256 MiB buffer");
ABSL_FLAG(bool, timeline, false,
          "after each op's timed runs, one more with CUPTI's records of its "
          "kernels, printed with their starts, durations and gaps");
ABSL_FLAG(double, head_start_us, 0.0,
          "a GPU spin of this many microseconds before each timed run, so "
          "that the host has enqueued the run before its kernels start (0: "
          "none; the flush alone is the host's head start)");

namespace mhc::bench {
namespace {

std::optional<DType> ParseDType(absl::string_view name) {
  for (DType d : {DType::kBF16, DType::kF16, DType::kF32}) {
    if (name == DTypeName(d)) return d;
  }
  return std::nullopt;
}

}  // namespace

const char* FlushName(Flush f) { return f == Flush::kWrite ? "write" : "read"; }

const char* PrecisionName(MatmulPrecision p) {
  return p == MatmulPrecision::kIeee ? "ieee" : "tf32";
}

absl::Status ParseOptions(Options& flags) {
  flags.reps = absl::GetFlag(FLAGS_reps);
  if (flags.reps < 1) return absl::InvalidArgumentError("--reps: at least 1");
  flags.shape.streams = absl::GetFlag(FLAGS_n);
  if (flags.shape.streams < 1 || flags.shape.streams > kMaxStreams) {
    return absl::InvalidArgumentError(
        absl::StrCat("--n: 1 to ", kMaxStreams, " streams"));
  }
  flags.shape.hidden = absl::GetFlag(FLAGS_hidden);
  if (flags.shape.hidden < 0) {
    return absl::InvalidArgumentError("--hidden: >= 0");
  }
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  std::optional<DType> act = ParseDType(dtype);
  if (!act.has_value()) {
    return absl::InvalidArgumentError("--dtype: bf16, f16 or f32");
  }
  flags.shape.act = *act;
  const std::string layout = absl::GetFlag(FLAGS_layout);
  if (layout == LayoutName(Layout::kStreamMajor)) {
    flags.shape.layout = Layout::kStreamMajor;
  } else if (layout == LayoutName(Layout::kStreamMinor)) {
    flags.shape.layout = Layout::kStreamMinor;
  } else {
    return absl::InvalidArgumentError("--layout: stream_major or stream_minor");
  }
  const std::string precision = absl::GetFlag(FLAGS_precision);
  if (precision == PrecisionName(MatmulPrecision::kTf32)) {
    flags.shape.precision = MatmulPrecision::kTf32;
  } else if (precision == PrecisionName(MatmulPrecision::kIeee)) {
    flags.shape.precision = MatmulPrecision::kIeee;
  } else {
    return absl::InvalidArgumentError("--precision: tf32 or ieee");
  }
  flags.shapes = absl::GetFlag(FLAGS_shapes);
  const std::string configs = absl::GetFlag(FLAGS_configs);
  const std::string ops = absl::GetFlag(FLAGS_ops);
  if (flags.shapes) {
    // Each named case fixes these; silently overriding them would mislabel
    // the table.
    if (configs != "all" || ops != "all" || flags.shape.streams != 4 ||
        flags.shape.hidden != 0 || flags.shape.act != DType::kBF16 ||
        flags.shape.layout != Layout::kStreamMajor ||
        flags.shape.precision != MatmulPrecision::kTf32) {
      return absl::InvalidArgumentError(
          "--shapes: the named cases set the configs, ops, n, C, dtype, "
          "layout and precision; drop --configs, --ops, --n, --hidden, "
          "--dtype, --layout and --precision");
    }
    flags.cases.assign(kNumCases, false);
    flags.cases[kLayerFwd] = flags.cases[kLayerFwdBwd] = true;
  }
  flags.keep_projection = !absl::GetFlag(FLAGS_recompute_projection);
  const std::string flush = absl::GetFlag(FLAGS_flush);
  if (flush == "write") {
    flags.flush = Flush::kWrite;
  } else if (flush == "read") {
    flags.flush = Flush::kRead;
  } else {
    return absl::InvalidArgumentError("--flush: write or read");
  }
  flags.timeline = absl::GetFlag(FLAGS_timeline);
  flags.head_start_us = absl::GetFlag(FLAGS_head_start_us);
  if (!(flags.head_start_us >= 0.0 && flags.head_start_us <= 1e6)) {
    return absl::InvalidArgumentError("--head_start_us: 0 to 1e6");
  }
  if (flags.shapes) return absl::OkStatus();
  if (configs == "all" || configs == "first") {
    for (int c = 0; c < (configs == "all" ? kNumLayerConfigs : 1); ++c) {
      flags.configs.push_back(kConfigs[c]);
    }
  } else if (configs == "small") {
    for (int c = kNumLayerConfigs; c < kNumConfigs; ++c) {
      flags.configs.push_back(kConfigs[c]);
    }
  } else {
    for (absl::string_view part : absl::StrSplit(configs, ',')) {
      int index = 0;
      if (!absl::SimpleAtoi(part, &index) || index < 0 ||
          index >= kNumConfigs) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--configs: all, small, first or indices 0 to ", kNumConfigs - 1));
      }
      flags.configs.push_back(kConfigs[index]);
    }
  }
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

}  // namespace mhc::bench
