#include <utility>

#include "mhc/ops/weights.h"

namespace mhc {

std::vector<ParameterSlot> ParameterLayout(const LayerSpec& spec) {
  std::vector<ParameterSlot> slots;
  int64_t offset = 0;
  auto add = [&](const char* name, std::vector<int64_t> shape) {
    ParameterSlot slot;
    slot.name = name;
    slot.elements = 1;
    for (int64_t dim : shape) slot.elements *= dim;
    slot.shape = std::move(shape);
    slot.offset = offset;
    offset += slot.elements;
    slots.push_back(std::move(slot));
  };
  if (spec.dynamic) {
    add("phi", {spec.NumLogits(), spec.K()});
    add("alpha", {spec.NumAlpha()});
  }
  add("beta", {spec.NumLogits()});
  if (spec.has_gamma) add("gamma", {spec.K()});
  if (spec.has_post_bias) add("bias", {spec.hidden});
  return slots;
}

int64_t ParameterCount(const LayerSpec& spec) {
  int64_t count = 0;
  for (const ParameterSlot& slot : ParameterLayout(spec)) {
    count += slot.elements;
  }
  return count;
}

namespace {

// Sets each present parameter's pointer in `out` (LayerWeights or
// LayerGrads, which share field names) to its place in `block`.
template <typename Pointers, typename Float>
Pointers PointersInBlock(const LayerSpec& spec, Float* block) {
  Pointers out;
  for (const ParameterSlot& slot : ParameterLayout(spec)) {
    Float* at = block + slot.offset;
    if (slot.name == "phi") out.phi = at;
    if (slot.name == "alpha") out.alpha = at;
    if (slot.name == "beta") out.beta = at;
    if (slot.name == "gamma") out.gamma = at;
    if (slot.name == "bias") out.bias = at;
  }
  return out;
}

}  // namespace

LayerWeights WeightsInBlock(const LayerSpec& spec, const float* block) {
  return PointersInBlock<LayerWeights>(spec, block);
}

LayerGrads GradsInBlock(const LayerSpec& spec, float* block) {
  return PointersInBlock<LayerGrads>(spec, block);
}

}  // namespace mhc
