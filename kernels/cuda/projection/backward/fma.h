// The fma variant of the projection backward (fma.cu): dx on CUDA cores, a
// thread per k, and the dphi partials beside it; the static layers' fused
// terms and layers too large for the tensor-core variants.
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_FMA_H_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_FMA_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "launch.h"
#include "projection/plan.h"

namespace mhc::cuda {

absl::Status LaunchFmaDxAndPhiPartials(const DxArgs& a,
                                       const ProjectionBackwardPlan& plan,
                                       cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_FMA_H_
