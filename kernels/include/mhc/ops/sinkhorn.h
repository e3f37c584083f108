// Sinkhorn-Knopp projection of the n x n logits onto doubly stochastic
// matrices, LINEAR or LOG mode (docs/SPEC.md section 3), fp32, and its exact
// reverse mode through the T unrolled iterations (docs/SPEC.md section 4). Per
// token: deterministic and batch invariant.
#ifndef MHC_OPS_SINKHORN_H_
#define MHC_OPS_SINKHORN_H_

#include <cstdint>

#include "mhc/types.h"

namespace mhc {

struct SinkhornForwardParams {
  const LayerSpec* spec = nullptr;  // mode, iterations, eps_sk, n
  int64_t tokens = 0;
  const float* logits = nullptr;  // [M, n, n] fp32, A[i][j] at i*n + j
  float* h_res = nullptr;         // [M, n, n] fp32 out
};

struct SinkhornBackwardParams {
  const LayerSpec* spec = nullptr;
  int64_t tokens = 0;
  const float* logits = nullptr;  // [M, n, n] fp32 (forward input)
  const float* dh_res = nullptr;  // [M, n, n] fp32
  float* dlogits = nullptr;       // [M, n, n] fp32 out
};

}  // namespace mhc

#endif  // MHC_OPS_SINKHORN_H_
