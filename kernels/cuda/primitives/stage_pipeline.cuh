// The cp.async stage loop the projection backward kernels of wide layers
// (projection/backward/wide.cu's dx, projection/backward/dphi_mma.cu) and of n
// = 4 layers (projection/backward/wgmma_n4.cu) run their shared-memory stages
// through.
#ifndef MHC_KERNELS_CUDA_PRIMITIVES_STAGE_PIPELINE_CUH_
#define MHC_KERNELS_CUDA_PRIMITIVES_STAGE_PIPELINE_CUH_

#include "primitives/wgmma.cuh"
#include "projection/forward/mma.cuh"

namespace mhc::cuda {

// Runs compute(i) for stages i < count, load(i) issued kStages - 1 stages
// ahead as cp.async groups; a barrier before each compute, after which the
// oldest buffer is free for the next load. kAsyncProxy: compute reads the
// stage through wgmmas, which see the copies after a proxy fence.
template <int kStages, bool kAsyncProxy = false, typename Load,
          typename Compute>
__device__ __forceinline__ void Pipeline(int count, Load&& load,
                                         Compute&& compute) {
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    load(i);
    CpAsyncCommit();
  }
  for (int i = 0; i < count; ++i) {
    CpAsyncWait<kStages - 2>();
    if constexpr (kAsyncProxy) FenceProxyAsyncShared();
    __syncthreads();
    load(i + kStages - 1);
    CpAsyncCommit();
    compute(i);
  }
  CpAsyncWait<0>();
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PRIMITIVES_STAGE_PIPELINE_CUH_
