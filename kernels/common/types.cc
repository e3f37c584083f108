#include "mhc/types.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace mhc {

size_t DTypeSize(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
  }
  return "unknown";
}

absl::string_view LayoutName(Layout layout) {
  return layout == Layout::kStreamMajor ? "stream_major" : "stream_minor";
}

const std::vector<std::string>& PresetNames() {
  static const auto* names = new std::vector<std::string>{
      "deepseek_v4", "tilekernels", "transformer_engine", "megatron", "liger"};
  return *names;
}

absl::StatusOr<LayerSpec> PresetSpec(absl::string_view name, int n,
                                     int64_t hidden) {
  LayerSpec spec;  // defaults are deepseek_v4
  spec.n = n;
  spec.hidden = hidden;
  if (name == "deepseek_v4" || name.empty()) {
    // defaults
  } else if (name == "tilekernels") {
    spec.sinkhorn_iterations = 10;
    spec.post_mult = 1.0f;
  } else if (name == "transformer_engine") {
    spec.layout = Layout::kStreamMinor;
    spec.sinkhorn_mode = SinkhornMode::kLog;
    spec.eps_sk = 0.0f;
    spec.eps_rms = std::ldexp(1.0f, -23);
    spec.eps_pre = 0.0f;
  } else if (name == "megatron") {
    spec.eps_placement = EpsPlacement::kOutside;
  } else if (name == "liger") {
    spec.eps_pre = 0.0f;
    spec.orientation = Orientation::kDestRows;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("preset: unknown name '", name, "'; expected one of ",
                     absl::StrJoin(PresetNames(), ", ")));
  }
  return spec;
}

namespace {

absl::Status FieldError(absl::string_view field, absl::string_view expected) {
  return absl::InvalidArgumentError(
      absl::StrCat("spec.", field, ": expected ", expected));
}

bool FiniteNonNegative(float value) {
  return std::isfinite(value) && value >= 0.0f;
}

}  // namespace

absl::Status ValidateSpec(const LayerSpec& spec) {
  if (spec.kind != LayerKind::kMhc && spec.kind != LayerKind::kHead) {
    return FieldError("kind", "MHC or HEAD");
  }
  if (spec.n < 1 || spec.n > kMaxStreams) {
    return FieldError("n", absl::StrCat("1..", kMaxStreams, ", got ", spec.n));
  }
  // K = n*C and N*K must fit comfortably in int64 for every index.
  if (spec.hidden < 1 || spec.hidden > (int64_t{1} << 32)) {
    return FieldError("hidden", absl::StrCat("1..2^32, got ", spec.hidden));
  }
  if (spec.layout != Layout::kStreamMajor &&
      spec.layout != Layout::kStreamMinor) {
    return FieldError("layout", "STREAM_MAJOR or STREAM_MINOR");
  }
  if (spec.orientation != Orientation::kSourceRows &&
      spec.orientation != Orientation::kDestRows) {
    return FieldError("orientation", "SOURCE_ROWS or DEST_ROWS");
  }
  if (spec.sinkhorn_mode != SinkhornMode::kLinear &&
      spec.sinkhorn_mode != SinkhornMode::kLog) {
    return FieldError("sinkhorn_mode", "LINEAR or LOG");
  }
  if (spec.sinkhorn_iterations < 1 ||
      spec.sinkhorn_iterations > kMaxSinkhornIterations) {
    return FieldError("sinkhorn_iterations",
                      absl::StrCat("1..", kMaxSinkhornIterations, ", got ",
                                   spec.sinkhorn_iterations));
  }
  if (spec.eps_placement != EpsPlacement::kInside &&
      spec.eps_placement != EpsPlacement::kOutside) {
    return FieldError("eps_placement", "INSIDE or OUTSIDE");
  }
  if (spec.matmul_precision != MatmulPrecision::kIeee &&
      spec.matmul_precision != MatmulPrecision::kTf32) {
    return FieldError("matmul_precision", "IEEE or TF32");
  }
  if (!FiniteNonNegative(spec.eps_sk) || spec.eps_sk > 1.0f) {
    return FieldError("eps_sk", "a finite value in [0, 1]");
  }
  if (!FiniteNonNegative(spec.eps_rms) || spec.eps_rms > 1.0f) {
    return FieldError("eps_rms", "a finite value in [0, 1]");
  }
  if (!FiniteNonNegative(spec.eps_pre) || spec.eps_pre > 1.0f) {
    return FieldError("eps_pre", "a finite value in [0, 1]");
  }
  if (!std::isfinite(spec.post_mult)) {
    return FieldError("post_mult", "a finite value");
  }
  if (!spec.dynamic && spec.has_gamma) {
    return FieldError("has_gamma", "false for a static layer (no phi)");
  }
  if (spec.kind == LayerKind::kHead && !spec.dynamic) {
    return FieldError("dynamic", "true for a HEAD layer");
  }
  if (spec.kind == LayerKind::kHead && spec.has_post_bias) {
    return FieldError("has_post_bias", "false for a HEAD layer (no post)");
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CheckedElementCount(const std::vector<int64_t>& dims,
                                            int64_t limit) {
  int64_t count = 1;
  for (int64_t dim : dims) {
    if (dim < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("negative dimension ", dim));
    }
    if (dim != 0 && count > limit / dim) {
      return absl::InvalidArgumentError(
          "element count overflows the size limit");
    }
    count *= dim;
  }
  return count;
}

}  // namespace mhc
