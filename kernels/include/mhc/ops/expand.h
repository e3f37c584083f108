// Expand: x[i][c] = e[c] for every stream (entry into n streams); backward
// de[c] = sum_i dx[i][c] in order i = 0..n-1. Deterministic, batch invariant.
#ifndef MHC_OPS_EXPAND_H_
#define MHC_OPS_EXPAND_H_

#include <cstdint>

#include "mhc/types.h"

namespace mhc {

struct ExpandForwardParams {
  const LayerSpec* spec = nullptr;  // n, C, layout
  int64_t tokens = 0;
  DType act_dtype = DType::kBF16;
  const void* e = nullptr;  // [M, C] act_dtype
  void* x = nullptr;        // [M, K] act_dtype out
};

struct ExpandBackwardParams {
  const LayerSpec* spec = nullptr;
  int64_t tokens = 0;
  DType act_dtype = DType::kBF16;
  const void* dx = nullptr;  // [M, K] act_dtype
  void* de = nullptr;        // [M, C] act_dtype out
};

}  // namespace mhc

#endif  // MHC_OPS_EXPAND_H_
