// The wide variants of the projection backward (wide.cu), mma_wide and
// wgmma_wide: two tensor-core GEMM kernels for the dynamic layers the mma
// variant does not take (n not a power of two, n = 16, and the largest
// fp32 tiles).
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WIDE_H_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WIDE_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "launch.h"
#include "projection/plan.h"

namespace mhc::cuda {

// Scratch of the rounded operands and, for the fused pre backward (terms),
// of one channel chunk's terms (wide_terms.cuh); 0 for the other variants.
// The plan's (launch.cu), as NumPhiChunks (plan.h).
size_t WideDxScratchBytes(const LayerSpec& spec, int64_t tokens, DType dtype,
                          bool terms);
// dx on the plan's instruction (its variant), dphi on its dphi variant, in
// a.wide_scratch laid out as the plan's workspace says.
absl::Status LaunchWideDxAndPhiPartials(const DxArgs& a,
                                        const ProjectionBackwardPlan& plan,
                                        cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WIDE_H_
