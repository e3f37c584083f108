// The mma variant of the projection forward (mma.cu): units of up to
// kLogitGroup logits on mma.sync (mma.cuh), for the layers the plan gives
// no other kernel; and the finish kernel every forward variant's partials
// go through.
#ifndef MHC_KERNELS_CUDA_PROJECTION_FORWARD_MMA_H_
#define MHC_KERNELS_CUDA_PROJECTION_FORWARD_MMA_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "mhc/types.h"
#include "projection/plan.h"

namespace mhc::cuda {

struct RepairSource;  // overflow_repair.h

// The chunk partials into the plan's workspace (and phi' split there first
// where the plan says so).
absl::Status LaunchMmaForwardPartials(const LayerSpec& spec, int64_t tokens,
                                      DType dtype, const void* x,
                                      const float* phi, const float* gamma,
                                      const ProjectionForwardPlan& plan,
                                      void* workspace, cudaStream_t stream);

// h and the mean square from the chunk partials at the workspace's start,
// each token's chunks added in order; its CTAs start as the partials'
// kernel finishes. With `repair` (the projection op) the same launch
// repairs the tokens whose fp32 values overflowed, from x; no host sync.
absl::Status LaunchProjectionFinish(const LayerSpec& spec, int64_t tokens,
                                    DType dtype, const float* partial, float* h,
                                    float* mean_square,
                                    const RepairSource* repair,
                                    cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_FORWARD_MMA_H_
