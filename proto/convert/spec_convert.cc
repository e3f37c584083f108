#include "convert/spec_convert.h"

#include "absl/strings/str_cat.h"
#include "mhc/status.h"

namespace mhc {

namespace {

absl::Status BadEnum(absl::string_view field, int value,
                     absl::string_view expected) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": unknown value ", value, "; expected ", expected));
}

}  // namespace

absl::StatusOr<DType> DTypeFromProto(int value, absl::string_view field) {
  switch (value) {
    case v1::DTYPE_F32:
      return DType::kF32;
    case v1::DTYPE_F16:
      return DType::kF16;
    case v1::DTYPE_BF16:
      return DType::kBF16;
    case v1::DTYPE_UNSPECIFIED:
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": required (DTYPE_F32, DTYPE_F16 or DTYPE_BF16)"));
    default:
      return BadEnum(field, value, "DTYPE_F32, DTYPE_F16 or DTYPE_BF16");
  }
}

v1::DType DTypeToProto(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return v1::DTYPE_F32;
    case DType::kF16:
      return v1::DTYPE_F16;
    case DType::kBF16:
      return v1::DTYPE_BF16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<Layout> LayoutFromProto(int value, absl::string_view field) {
  switch (value) {
    case v1::LAYOUT_STREAM_MAJOR:
      return Layout::kStreamMajor;
    case v1::LAYOUT_STREAM_MINOR:
      return Layout::kStreamMinor;
    case v1::LAYOUT_UNSPECIFIED:
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": required (LAYOUT_STREAM_MAJOR or LAYOUT_STREAM_MINOR)"));
    default:
      return BadEnum(field, value,
                     "LAYOUT_STREAM_MAJOR or LAYOUT_STREAM_MINOR");
  }
}

v1::Layout LayoutToProto(Layout layout) {
  return layout == Layout::kStreamMajor ? v1::LAYOUT_STREAM_MAJOR
                                        : v1::LAYOUT_STREAM_MINOR;
}

std::string LayoutLabel(Layout layout) {
  return layout == Layout::kStreamMajor ? "STREAM_MAJOR" : "STREAM_MINOR";
}

std::string DTypeLabel(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
  }
  return "UNKNOWN";
}

absl::StatusOr<LayerSpec> ResolveSpec(absl::string_view preset,
                                      const v1::LayerSpec& o) {
  if (o.n() < 0 || o.n() > kMaxStreams) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.n: expected 1..", kMaxStreams, " (0 means 4), got ", o.n()));
  }
  if (o.hidden() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.hidden: required, expected >= 1, got ", o.hidden()));
  }
  MHC_ASSIGN_OR_RETURN(LayerSpec spec,
                       PresetSpec(preset, o.n() == 0 ? 4 : o.n(), o.hidden()));
  switch (o.kind()) {
    case v1::LAYER_KIND_UNSPECIFIED:
    case v1::LAYER_KIND_MHC:
      spec.kind = LayerKind::kMhc;
      break;
    case v1::LAYER_KIND_HEAD:
      spec.kind = LayerKind::kHead;
      break;
    default:
      return BadEnum("spec.kind", o.kind(),
                     "LAYER_KIND_MHC or LAYER_KIND_HEAD");
  }
  if (o.layout() != v1::LAYOUT_UNSPECIFIED) {
    MHC_ASSIGN_OR_RETURN(spec.layout,
                         LayoutFromProto(o.layout(), "spec.layout"));
  }
  switch (o.orientation()) {
    case v1::ORIENTATION_UNSPECIFIED:
      break;
    case v1::ORIENTATION_SOURCE_ROWS:
      spec.orientation = Orientation::kSourceRows;
      break;
    case v1::ORIENTATION_DEST_ROWS:
      spec.orientation = Orientation::kDestRows;
      break;
    default:
      return BadEnum("spec.orientation", o.orientation(),
                     "ORIENTATION_SOURCE_ROWS or ORIENTATION_DEST_ROWS");
  }
  switch (o.sinkhorn_mode()) {
    case v1::SINKHORN_MODE_UNSPECIFIED:
      break;
    case v1::SINKHORN_MODE_LINEAR:
      spec.sinkhorn_mode = SinkhornMode::kLinear;
      break;
    case v1::SINKHORN_MODE_LOG:
      spec.sinkhorn_mode = SinkhornMode::kLog;
      break;
    default:
      return BadEnum("spec.sinkhorn_mode", o.sinkhorn_mode(),
                     "SINKHORN_MODE_LINEAR or SINKHORN_MODE_LOG");
  }
  switch (o.eps_placement()) {
    case v1::EPS_PLACEMENT_UNSPECIFIED:
      break;
    case v1::EPS_PLACEMENT_INSIDE:
      spec.eps_placement = EpsPlacement::kInside;
      break;
    case v1::EPS_PLACEMENT_OUTSIDE:
      spec.eps_placement = EpsPlacement::kOutside;
      break;
    default:
      return BadEnum("spec.eps_placement", o.eps_placement(),
                     "EPS_PLACEMENT_INSIDE or EPS_PLACEMENT_OUTSIDE");
  }
  switch (o.matmul_precision()) {
    case v1::MATMUL_PRECISION_UNSPECIFIED:
      break;
    case v1::MATMUL_PRECISION_IEEE:
      spec.matmul_precision = MatmulPrecision::kIeee;
      break;
    case v1::MATMUL_PRECISION_TF32:
      spec.matmul_precision = MatmulPrecision::kTf32;
      break;
    default:
      return BadEnum("spec.matmul_precision", o.matmul_precision(),
                     "MATMUL_PRECISION_IEEE or MATMUL_PRECISION_TF32");
  }
  if (o.has_sinkhorn_iterations()) {
    spec.sinkhorn_iterations = o.sinkhorn_iterations();
  }
  if (o.has_eps_sk()) spec.eps_sk = o.eps_sk();
  if (o.has_eps_rms()) spec.eps_rms = o.eps_rms();
  if (o.has_eps_pre()) spec.eps_pre = o.eps_pre();
  if (o.has_post_mult()) spec.post_mult = o.post_mult();
  if (o.has_dynamic()) spec.dynamic = o.dynamic();
  if (o.has_gamma()) spec.has_gamma = true;
  if (o.has_post_bias()) spec.has_post_bias = true;
  MHC_RETURN_IF_ERROR(ValidateSpec(spec));
  return spec;
}

void SpecToProto(const LayerSpec& spec, v1::LayerSpec* out) {
  out->set_kind(spec.kind == LayerKind::kHead ? v1::LAYER_KIND_HEAD
                                              : v1::LAYER_KIND_MHC);
  out->set_n(spec.n);
  out->set_hidden(spec.hidden);
  out->set_layout(LayoutToProto(spec.layout));
  out->set_orientation(spec.orientation == Orientation::kSourceRows
                           ? v1::ORIENTATION_SOURCE_ROWS
                           : v1::ORIENTATION_DEST_ROWS);
  out->set_sinkhorn_mode(spec.sinkhorn_mode == SinkhornMode::kLinear
                             ? v1::SINKHORN_MODE_LINEAR
                             : v1::SINKHORN_MODE_LOG);
  out->set_sinkhorn_iterations(spec.sinkhorn_iterations);
  out->set_eps_sk(spec.eps_sk);
  out->set_eps_rms(spec.eps_rms);
  out->set_eps_placement(spec.eps_placement == EpsPlacement::kInside
                             ? v1::EPS_PLACEMENT_INSIDE
                             : v1::EPS_PLACEMENT_OUTSIDE);
  out->set_eps_pre(spec.eps_pre);
  out->set_post_mult(spec.post_mult);
  out->set_dynamic(spec.dynamic);
  out->set_has_gamma(spec.has_gamma);
  out->set_has_post_bias(spec.has_post_bias);
  out->set_matmul_precision(spec.matmul_precision == MatmulPrecision::kIeee
                                ? v1::MATMUL_PRECISION_IEEE
                                : v1::MATMUL_PRECISION_TF32);
}

v1::LayerSpec SpecToProto(const LayerSpec& spec) {
  v1::LayerSpec out;
  SpecToProto(spec, &out);
  return out;
}

}  // namespace mhc
