#include "mhc/client/spec.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "convert/spec_convert.h"

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
  // Every field is set, so the overrides replace the whole preset.
  return ResolveSpec("", p);
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
  for (const ParameterSlot& slot : ParameterLayout(spec)) {
    shapes[slot.name] = slot.shape;
  }
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
