// Host side of the fused backward's overflow repair (overflow_repair.cu).
#ifndef MHC_KERNELS_CUDA_OVERFLOW_REPAIR_H_
#define MHC_KERNELS_CUDA_OVERFLOW_REPAIR_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "mhc/types.h"

namespace mhc::cuda {

// What the repair kernel reads and writes; pointers as the fused backward
// has them (r, dx_next null without the residual path, grads null when
// skipped).
struct RepairBackwardArgs {
  const void* x = nullptr;
  const void* dy = nullptr;
  const void* dx_next = nullptr;
  void* dx = nullptr;
  const float* phi = nullptr;
  const float* gamma = nullptr;  // null without gamma
  const float* h_pre = nullptr;  // [M, n]
  const float* r = nullptr;      // [M, n, n] oriented, or null
  float* grad_phi = nullptr;
  float* grad_gamma = nullptr;
  // The mixing kernel's rows (overflow_repair.cuh).
  const float* scaled = nullptr;
  const int* flag = nullptr;
  const int* count = nullptr;
};

// Stream ordered after the dx kernel and the dphi reduction; no host sync.
absl::Status LaunchRepairBackward(const LayerSpec& spec, int64_t tokens,
                                  DType dtype, const RepairBackwardArgs& a,
                                  cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_OVERFLOW_REPAIR_H_
