// Projection + sum of squares (docs/SPEC.md section 2 steps 1-2, section 4 last
// lines). Deterministic and batch invariant on every backend: a token's h and
// mean_square use a reduction order over k that does not depend on M.
#ifndef MHC_OPS_PROJECTION_H_
#define MHC_OPS_PROJECTION_H_

#include <cstdint>

#include "mhc/ops/weights.h"
#include "mhc/types.h"

namespace mhc {

struct ProjectionForwardParams {
  const LayerSpec* spec = nullptr;  // dynamic layer (kMhc or kHead)
  int64_t tokens = 0;               // M >= 0
  DType act_dtype = DType::kBF16;
  const void* x = nullptr;       // [M, K] act_dtype, spec->layout order
  LayerWeights weights;          // phi [N, K], gamma [K] optional
  float* h = nullptr;            // [M, N] fp32 out: phi' v
  float* mean_square = nullptr;  // [M] fp32 out: (1/K) sum_k v_k^2
};

struct ProjectionBackwardParams {
  const LayerSpec* spec = nullptr;
  int64_t tokens = 0;
  DType act_dtype = DType::kBF16;
  const void* x = nullptr;              // [M, K] act_dtype
  LayerWeights weights;                 // phi, gamma
  const float* dh = nullptr;            // [M, N] fp32
  const float* dmean_square = nullptr;  // [M] fp32
  void* dx = nullptr;                   // [M, K] act_dtype out (overwritten)
  LayerGrads grads;                     // phi, gamma accumulated (+=)
};

}  // namespace mhc

#endif  // MHC_OPS_PROJECTION_H_
