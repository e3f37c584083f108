// Post (expand & combine): x_next[j][c] = H_post[j] (f[c] + bias[c]) +
// sum_i R[i][j] x[i][c], R = H_res (SOURCE_ROWS) or H_res^T (DEST_ROWS), and
// its backward (docs/SPEC.md sections 2 and 4). Per token: deterministic and
// batch invariant; dbias is summed over tokens in token order.
#ifndef MHC_OPS_POST_H_
#define MHC_OPS_POST_H_

#include <cstdint>

#include "mhc/ops/weights.h"
#include "mhc/types.h"

namespace mhc {

struct PostForwardParams {
  const LayerSpec* spec = nullptr;  // n, C, layout, orientation
  int64_t tokens = 0;
  DType act_dtype = DType::kBF16;
  const void* f = nullptr;        // [M, C] act_dtype (output of F)
  const void* x = nullptr;        // [M, K] act_dtype
  const float* h_post = nullptr;  // [M, n] fp32
  const float* h_res = nullptr;   // [M, n, n] fp32
  LayerWeights weights;           // bias [C] when spec->has_post_bias
  void* x_next = nullptr;         // [M, K] act_dtype out
};

struct PostBackwardParams {
  const LayerSpec* spec = nullptr;
  int64_t tokens = 0;
  DType act_dtype = DType::kBF16;
  const void* dx_next = nullptr;  // [M, K] act_dtype
  const void* f = nullptr;        // [M, C] act_dtype
  const void* x = nullptr;        // [M, K] act_dtype
  const float* h_post = nullptr;  // [M, n] fp32
  const float* h_res = nullptr;   // [M, n, n] fp32
  LayerWeights weights;           // bias
  void* df = nullptr;             // [M, C] act_dtype out
  void* dx = nullptr;  // [M, K] act_dtype out; null skips it (the fused pre
                       // backward folds the residual path in instead)
  float* dh_post = nullptr;  // [M, n] fp32 out
  float* dh_res = nullptr;   // [M, n, n] fp32 out
  LayerGrads grads;          // bias accumulated (+=)
};

}  // namespace mhc

#endif  // MHC_OPS_POST_H_
