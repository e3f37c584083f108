// The wgmma_n8 variant of the projection backward (wgmma_n8.cu): n = 8
// layers on warpgroup mmas; dx and the per-chunk dphi partials of dynamic,
// stream-major layers with 16-bit activations under TF32, their rows on 16
// bytes. The mma variant covers every launch this one takes.
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WGMMA_N8_H_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WGMMA_N8_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "launch.h"
#include "projection/plan.h"

namespace mhc::cuda {

struct WgmmaDxDev {
  const float* phi;
  const float* gamma;   // null without gamma
  const float* dh;      // [M, 80]
  const float* dms;     // [M]
  const float* h_pre;   // [M, 8], null without the aggregate term
  const void* dy;       // [M, C] with h_pre
  const float* r;       // [M, 8, 8] source rows, null without the residual
  const void* dx_next;  // [M, K] with r
  void* dx;
  float* dphi_partial;  // [NumChunks(M)][80][K], null: no parameter gradients
};

// With the plan's terms (0, 1 aggregate, 2 and residual).
absl::Status LaunchWgmmaDxAndPhiPartials(const DxArgs& a,
                                         const ProjectionBackwardPlan& plan,
                                         cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WGMMA_N8_H_
