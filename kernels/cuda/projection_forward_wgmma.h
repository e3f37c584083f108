// The projection forward of wide layers on warpgroup mmas
// (projection_forward_wgmma.cu), for TF32 precision with 16-byte aligned rows
// (x and phi rows of K, gamma): LaunchWideProjectionPartials hands such
// launches to it. Same units' chunks and partial layout as proj_mma.cuh.
#ifndef MHC_KERNELS_CUDA_PROJECTION_FORWARD_WGMMA_H_
#define MHC_KERNELS_CUDA_PROJECTION_FORWARD_WGMMA_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "mhc/types.h"

namespace mhc::cuda {

// partial: PartialOffset's layout; next_unit: the launch's unit counter.
absl::Status LaunchWgmmaProjectionPartials(const LayerSpec& spec,
                                           int64_t tokens, DType dtype,
                                           const void* x, const float* phi,
                                           const float* gamma, float* partial,
                                           unsigned long long* next_unit,
                                           cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_FORWARD_WGMMA_H_
