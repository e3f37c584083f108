// The wgmma_n4_terms variant of the projection backward (wgmma_n4_terms.cu):
// the fused pre backward's dx and dphi partials of n = 4 mHC layers on
// warpgroup mmas, with the aggregate term and optionally the residual one;
// stream-major, 16-bit activations under TF32, every tensor on 16 bytes. The
// mma variant covers every launch this one takes, with the same dx bits.
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WGMMA_N4_TERMS_H_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WGMMA_N4_TERMS_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "launch.h"
#include "projection/plan.h"

namespace mhc::cuda {

absl::Status LaunchTermsWgmmaDxAndPhiPartials(
    const DxArgs& a, const ProjectionBackwardPlan& plan, cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WGMMA_N4_TERMS_H_
