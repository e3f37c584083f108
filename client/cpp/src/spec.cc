#include "mhc/client/spec.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace mhc::client {
namespace {

absl::Status Unresolved(absl::string_view field) {
  return absl::InvalidArgumentError(
      absl::StrCat("spec.", field, ": not set in a resolved spec"));
}

// Maps "stream_major" to LAYOUT_STREAM_MAJOR etc. through the generated
// descriptor, so new enum values need no code here.
template <typename Enum>
absl::StatusOr<Enum> ParseEnum(absl::string_view name,
                               const google::protobuf::EnumDescriptor* desc,
                               absl::string_view prefix) {
  std::string full = absl::StrCat(prefix, absl::AsciiStrToUpper(name));
  const google::protobuf::EnumValueDescriptor* value =
      desc->FindValueByName(full);
  if (value == nullptr || value->number() == 0) {
    std::vector<std::string> options;
    for (int i = 1; i < desc->value_count(); ++i) {
      options.push_back(
          absl::AsciiStrToLower(desc->value(i)->name().substr(prefix.size())));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(desc->name(), ": expected one of ",
                     absl::StrJoin(options, ", "), ", got '", name, "'"));
  }
  return static_cast<Enum>(value->number());
}

}  // namespace

absl::StatusOr<LayerSpec> SpecFromProto(const v1::LayerSpec& p) {
  LayerSpec spec;
  if (p.kind() == v1::LAYER_KIND_UNSPECIFIED) return Unresolved("kind");
  if (p.layout() == v1::LAYOUT_UNSPECIFIED) return Unresolved("layout");
  if (p.orientation() == v1::ORIENTATION_UNSPECIFIED) {
    return Unresolved("orientation");
  }
  if (p.sinkhorn_mode() == v1::SINKHORN_MODE_UNSPECIFIED) {
    return Unresolved("sinkhorn_mode");
  }
  if (p.eps_placement() == v1::EPS_PLACEMENT_UNSPECIFIED) {
    return Unresolved("eps_placement");
  }
  if (p.matmul_precision() == v1::MATMUL_PRECISION_UNSPECIFIED) {
    return Unresolved("matmul_precision");
  }
  if (!p.has_sinkhorn_iterations()) return Unresolved("sinkhorn_iterations");
  if (!p.has_eps_rms()) return Unresolved("eps_rms");
  if (!p.has_eps_pre()) return Unresolved("eps_pre");
  if (!p.has_post_mult()) return Unresolved("post_mult");
  if (!p.has_dynamic()) return Unresolved("dynamic");
  spec.kind = static_cast<LayerKind>(p.kind());
  spec.n = p.n();
  spec.hidden = p.hidden();
  spec.layout = static_cast<Layout>(p.layout());
  spec.orientation = static_cast<Orientation>(p.orientation());
  spec.sinkhorn_mode = static_cast<SinkhornMode>(p.sinkhorn_mode());
  spec.sinkhorn_iterations = p.sinkhorn_iterations();
  spec.eps_sk = p.has_eps_sk() ? p.eps_sk() : 0.0f;
  spec.eps_rms = p.eps_rms();
  spec.eps_placement = static_cast<EpsPlacement>(p.eps_placement());
  spec.eps_pre = p.eps_pre();
  spec.post_mult = p.post_mult();
  spec.dynamic = p.dynamic();
  spec.has_gamma = p.has_gamma();
  spec.has_post_bias = p.has_post_bias();
  spec.matmul_precision = static_cast<MatmulPrecision>(p.matmul_precision());
  absl::Status valid = ValidateSpec(spec);
  if (!valid.ok()) return valid;
  return spec;
}

v1::LayerSpec SpecToProto(const LayerSpec& spec) {
  v1::LayerSpec p;
  p.set_kind(static_cast<v1::LayerKind>(spec.kind));
  p.set_n(spec.n);
  p.set_hidden(spec.hidden);
  p.set_layout(static_cast<v1::Layout>(spec.layout));
  p.set_orientation(static_cast<v1::Orientation>(spec.orientation));
  p.set_sinkhorn_mode(static_cast<v1::SinkhornMode>(spec.sinkhorn_mode));
  p.set_sinkhorn_iterations(spec.sinkhorn_iterations);
  p.set_eps_sk(spec.eps_sk);
  p.set_eps_rms(spec.eps_rms);
  p.set_eps_placement(static_cast<v1::EpsPlacement>(spec.eps_placement));
  p.set_eps_pre(spec.eps_pre);
  p.set_post_mult(spec.post_mult);
  p.set_dynamic(spec.dynamic);
  p.set_has_gamma(spec.has_gamma);
  p.set_has_post_bias(spec.has_post_bias);
  p.set_matmul_precision(
      static_cast<v1::MatmulPrecision>(spec.matmul_precision));
  return p;
}

absl::StatusOr<v1::Layout> ParseLayout(absl::string_view name) {
  return ParseEnum<v1::Layout>(name, v1::Layout_descriptor(), "LAYOUT_");
}
absl::StatusOr<v1::Orientation> ParseOrientation(absl::string_view name) {
  return ParseEnum<v1::Orientation>(name, v1::Orientation_descriptor(),
                                    "ORIENTATION_");
}
absl::StatusOr<v1::SinkhornMode> ParseSinkhornMode(absl::string_view name) {
  return ParseEnum<v1::SinkhornMode>(name, v1::SinkhornMode_descriptor(),
                                     "SINKHORN_MODE_");
}
absl::StatusOr<v1::EpsPlacement> ParseEpsPlacement(absl::string_view name) {
  return ParseEnum<v1::EpsPlacement>(name, v1::EpsPlacement_descriptor(),
                                     "EPS_PLACEMENT_");
}
absl::StatusOr<v1::MatmulPrecision> ParseMatmulPrecision(
    absl::string_view name) {
  return ParseEnum<v1::MatmulPrecision>(name, v1::MatmulPrecision_descriptor(),
                                        "MATMUL_PRECISION_");
}
absl::StatusOr<v1::LayerKind> ParseLayerKind(absl::string_view name) {
  return ParseEnum<v1::LayerKind>(name, v1::LayerKind_descriptor(),
                                  "LAYER_KIND_");
}

std::vector<int64_t> StreamDims(const LayerSpec& spec) {
  if (spec.layout == Layout::kStreamMajor) return {spec.n, spec.hidden};
  return {spec.hidden, spec.n};
}

std::map<std::string, std::vector<int64_t>> ParameterShapes(
    const LayerSpec& spec) {
  std::map<std::string, std::vector<int64_t>> shapes;
  if (spec.dynamic) {
    shapes["phi"] = {spec.NumLogits(), spec.K()};
    shapes["alpha"] = {spec.NumAlpha()};
  }
  shapes["beta"] = {spec.NumLogits()};
  if (spec.has_gamma) shapes["gamma"] = {spec.K()};
  if (spec.has_post_bias) shapes["bias"] = {spec.hidden};
  return shapes;
}

LayerWeights HostLayer::Weights() const {
  auto get = [this](const char* name) -> const float* {
    auto it = parameters.find(name);
    return it == parameters.end() ? nullptr : it->second.data();
  };
  LayerWeights w;
  w.phi = get("phi");
  w.alpha = get("alpha");
  w.beta = get("beta");
  w.gamma = get("gamma");
  w.bias = get("bias");
  return w;
}

LayerGrads HostLayer::Grads() {
  auto get = [this](const char* name) -> float* {
    auto it = gradients.find(name);
    return it == gradients.end() ? nullptr : it->second.data();
  };
  LayerGrads g;
  g.phi = get("phi");
  g.alpha = get("alpha");
  g.beta = get("beta");
  g.gamma = get("gamma");
  g.bias = get("bias");
  return g;
}

absl::StatusOr<HostLayer> MakeHostLayer(const v1::LayerSpec& spec_proto,
                                        const v1::Parameters& parameters) {
  absl::StatusOr<LayerSpec> spec = SpecFromProto(spec_proto);
  if (!spec.ok()) return spec.status();
  HostLayer layer;
  layer.spec = *spec;
  for (const auto& [name, shape] : ParameterShapes(*spec)) {
    auto it = parameters.tensors().find(name);
    if (it == parameters.tensors().end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameters: '", name, "' missing"));
    }
    absl::StatusOr<HostTensor> tensor = FromTensorRef(it->second);
    if (!tensor.ok()) return tensor.status();
    if (tensor->dtype != DType::kF32 || tensor->shape != shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameters: '", name, "' has shape [",
          absl::StrJoin(tensor->shape, ", "), "] ", DTypeName(tensor->dtype),
          ", expected [", absl::StrJoin(shape, ", "), "] f32"));
    }
    layer.parameters[name] = tensor->ToFloats();
    layer.gradients[name].assign(layer.parameters[name].size(), 0.0f);
  }
  return layer;
}

}  // namespace mhc::client
