// The wgmma_n4 variant of the projection backward (wgmma_n4.cu): n = 4
// layers on warpgroup mmas with dx rows stored from the accumulators; dx
// and the per-chunk dphi partials of dynamic, stream-major layers with
// 16-bit activations under TF32, their rows on 16 bytes, without the fused
// pre backward's terms. The mma variant covers every launch this one takes.
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WGMMA_N4_H_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WGMMA_N4_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "launch.h"
#include "projection/plan.h"

namespace mhc::cuda {

absl::Status LaunchRowsWgmmaDxAndPhiPartials(const DxArgs& a,
                                             const ProjectionBackwardPlan& plan,
                                             cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WGMMA_N4_H_
