// A layer's parameters for the fused CUDA tests (cuda_fused_test.cc,
// cuda_fused_ops_test.cc): random weights in both address spaces, or one
// flat host block of them and its device copy as a layer's weights.
#ifndef MHC_TESTS_CUDA_CUDA_FUSED_LAYER_H_
#define MHC_TESTS_CUDA_CUDA_FUSED_LAYER_H_

#include <cmath>
#include <cstdint>
#include <vector>

#include "cuda/cuda_cases.h"
#include "cuda/cuda_harness.h"

namespace mhc::testing {

// One layer's parameters, the same in both address spaces.
struct Layer {
  Pair phi, alpha, beta, gamma;
  LayerWeights w[2];
};

inline Layer MakeLayer(Harness& h, const LayerSpec& spec) {
  const int64_t N = spec.NumLogits(), K = spec.K();
  const float scale = 1.0f / std::sqrt(static_cast<float>(K));
  Layer l;
  l.phi = h.Floats(N * K, FreshSeed(), -scale, scale);
  l.alpha = h.Floats(3, FreshSeed(), 0.5f, 1.5f);
  l.beta = h.Floats(N, FreshSeed());
  l.gamma = h.Floats(K, FreshSeed(), 0.5f, 1.5f);
  for (int b = 0; b < 2; ++b) {
    l.w[b].phi = spec.dynamic ? l.phi.f(b) : nullptr;
    l.w[b].alpha = spec.dynamic ? l.alpha.f(b) : nullptr;
    l.w[b].beta = l.beta.f(b);
    l.w[b].gamma = l.gamma.f(b);
  }
  return l;
}

// phi, alpha, beta, gamma and the post bias of a layer, one after another
// (the order WeightsIn reads them in), fresh random values.
inline std::vector<float> RandomParams(int64_t K, int64_t N, int64_t C) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(K));
  std::vector<float> params = RandomFloats(N * K, FreshSeed(), -scale, scale);
  for (float v : RandomFloats(3, FreshSeed(), 0.5f, 1.5f)) params.push_back(v);
  for (float v : RandomFloats(N, FreshSeed())) params.push_back(v);
  for (float v : RandomFloats(K, FreshSeed(), 0.5f, 1.5f)) params.push_back(v);
  for (float v : RandomFloats(C, FreshSeed())) params.push_back(v);
  return params;
}

// A device buffer laid out as RandomParams' values (phi, alpha, beta, gamma,
// bias) as a layer's weights (LayerWeights) or their gradients (LayerGrads).
template <typename Params>
inline Params ParamsIn(Pair w, int64_t N, int64_t K) {
  Params p;
  p.phi = w.f(1);
  p.alpha = w.f(1) + N * K;
  p.beta = w.f(1) + N * K + 3;
  p.gamma = w.f(1) + N * K + 3 + N;
  p.bias = w.f(1) + N * K + 3 + N + K;
  return p;
}
inline LayerWeights WeightsIn(Pair w, int64_t N, int64_t K) {
  return ParamsIn<LayerWeights>(w, N, K);
}

}  // namespace mhc::testing

#endif  // MHC_TESTS_CUDA_CUDA_FUSED_LAYER_H_
