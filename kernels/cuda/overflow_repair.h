// Host side of the overflow repair (overflow_repair.cuh): what the mixing
// kernels read it from and leave for the backward's repair pass (the dphi
// reduction's tail, or its own kernel in overflow_repair.cu).
#ifndef MHC_KERNELS_CUDA_OVERFLOW_REPAIR_H_
#define MHC_KERNELS_CUDA_OVERFLOW_REPAIR_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "mhc/dtype.h"
#include "mhc/types.h"

namespace mhc::cuda {

// Where a repaired token's projection is recomputed from; x == null turns
// the repair off (the single-op kernels, which see h and ms alone).
struct RepairSource {
  const void* x = nullptr;  // [M, K] act dtype
  DType dtype = DType::kF32;
  const float* phi = nullptr;    // [N, K]
  const float* gamma = nullptr;  // [K] or null
};

// What the fused backward's mixing kernel (SplitMix layers: the scale
// backward) leaves for the repair pass: the scaled dh and dms of each
// repaired token (whose dh and dms rows for the dx kernel are zeroed), every
// token's flag, and the number of repaired tokens.
struct RepairRows {
  // [M, N + 1]: dh_s, dms_s (SplitMix: first the scale forward's h_s, ms_s)
  float* scaled = nullptr;
  int* flag = nullptr;   // [M]
  int* count = nullptr;  // [1], zeroed by dh_pre_kernel (fused_pre.cu)
};

// The overflow repair of the scale op kernels on the SplitMix path (scale.cu,
// n != 4; LaunchScaleForward / LaunchScaleBackward take it as an option).
// The forward rewrites a repaired token's kept projection; the scale forward
// of the backward leaves its scaled projection (h_s, ms_s) and every token's
// flag in `rows`, and the scale backward replaces them with the scaled dh and
// dms for the repair pass, zeroing the dh / dms rows of the dx kernel.
struct ScaleRepair {
  RepairSource src;
  float* kept_h = nullptr;   // [M, N] or null: forward, the kept projection
  float* kept_ms = nullptr;  // [M] with kept_h
  RepairRows rows;           // backward only
};

// What the backward's repair pass (RepairColumn in overflow_repair.cuh)
// reads and writes; pointers as the fused backward has them (r, dx_next null
// without the residual path, grads null when skipped).
struct RepairBackwardArgs {
  DType dtype = DType::kF32;  // of x, dy, dx_next and dx
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
  // The mixing kernel's rows (RepairRows).
  const float* scaled = nullptr;
  const int* flag = nullptr;
  const int* count = nullptr;
};

// The repair pass as a kernel of its own, for a backward with no dphi
// reduction (no phi / gamma gradient asked for); otherwise the pass rides on
// the reduction (LaunchPhiGradReduce). Stream ordered after the dx kernel;
// no host sync.
absl::Status LaunchRepairBackward(const LayerSpec& spec, int64_t tokens,
                                  const RepairBackwardArgs& a,
                                  cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_OVERFLOW_REPAIR_H_
