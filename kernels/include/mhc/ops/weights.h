// Pointers to one layer's parameters and gradient accumulators, in the memory
// of the backend that runs the op (host memory for CPU backends).
#ifndef MHC_OPS_WEIGHTS_H_
#define MHC_OPS_WEIGHTS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "mhc/types.h"

namespace mhc {

// N = spec.NumLogits(), K = spec.K(), C = spec.hidden. Unused slots are null.
struct LayerWeights {
  const float* phi = nullptr;    // [N, K] fp32, columns in the layer's layout
  const float* alpha = nullptr;  // [3] fp32 (kHead: [1], the scalar s)
  const float* beta = nullptr;   // [N] fp32 (kHead: b_head)
  const float* gamma = nullptr;  // [K] fp32, only when spec.has_gamma
  const float* bias = nullptr;   // [C] fp32, only when spec.has_post_bias
};

// Gradient accumulators: backward ops ADD this request's gradient (summed
// over its tokens in a fixed order) into them. Null slots are not computed.
struct LayerGrads {
  float* phi = nullptr;    // [N, K]
  float* alpha = nullptr;  // [3] (kHead: [1])
  float* beta = nullptr;   // [N]
  float* gamma = nullptr;  // [K]
  float* bias = nullptr;   // [C]
};

// One parameter inside a block of fp32 values that holds all of a layer's
// parameters (or all its gradients) back to back.
struct ParameterSlot {
  std::string name;            // "phi", "alpha", "beta", "gamma", "bias"
  std::vector<int64_t> shape;  // as in LayerWeights
  int64_t elements = 0;
  int64_t offset = 0;  // in floats from the start of the block
};

// The parameters a spec has, in block order: phi and alpha (dynamic layers),
// beta, gamma (has_gamma), bias (has_post_bias). The one definition of which
// parameters exist and their shapes, for the daemon and the clients alike.
std::vector<ParameterSlot> ParameterLayout(const LayerSpec& spec);
// Total floats of a block laid out by ParameterLayout.
int64_t ParameterCount(const LayerSpec& spec);
// Pointers into such a block (null for absent parameters).
LayerWeights WeightsInBlock(const LayerSpec& spec, const float* block);
LayerGrads GradsInBlock(const LayerSpec& spec, float* block);

// Scratch memory handed to an op; size from Backend::WorkspaceBytes.
struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;
};

}  // namespace mhc

#endif  // MHC_OPS_WEIGHTS_H_
