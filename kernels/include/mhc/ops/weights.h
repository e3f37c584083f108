// Pointers to one layer's parameters and gradient accumulators, in the memory
// of the backend that runs the op (host memory for CPU backends).
#ifndef MHC_OPS_WEIGHTS_H_
#define MHC_OPS_WEIGHTS_H_

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

// Scratch memory handed to an op; size from Backend::WorkspaceBytes.
struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;
};

}  // namespace mhc

#endif  // MHC_OPS_WEIGHTS_H_
