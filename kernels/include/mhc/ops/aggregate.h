// Aggregate: y[c] = sum_i H_pre[i] x[i][c] (sum in order i = 0..n-1, fp32,
// one rounding) and its backward. Per token: deterministic, batch invariant.
#ifndef MHC_OPS_AGGREGATE_H_
#define MHC_OPS_AGGREGATE_H_

#include <cstdint>

#include "mhc/types.h"

namespace mhc {

struct AggregateForwardParams {
  const LayerSpec* spec = nullptr;  // n, C, layout
  int64_t tokens = 0;
  DType act_dtype = DType::kBF16;
  const void* x = nullptr;       // [M, K] act_dtype
  const float* h_pre = nullptr;  // [M, n] fp32
  void* y = nullptr;             // [M, C] act_dtype out
};

struct AggregateBackwardParams {
  const LayerSpec* spec = nullptr;
  int64_t tokens = 0;
  DType act_dtype = DType::kBF16;
  const void* x = nullptr;       // [M, K] act_dtype
  const float* h_pre = nullptr;  // [M, n] fp32
  const void* dy = nullptr;      // [M, C] act_dtype
  void* dx = nullptr;            // [M, K] act_dtype out: H_pre[i] * dy[c]
  float* dh_pre = nullptr;       // [M, n] fp32 out: sum_c dy[c] x[i][c]
};

}  // namespace mhc

#endif  // MHC_OPS_AGGREGATE_H_
