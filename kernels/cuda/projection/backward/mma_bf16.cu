// The tensor-core dx / dphi kernel built for bf16 activations.
#include "projection/backward/mma_launch.cuh"

namespace mhc::cuda::dx_mma {

template cudaError_t LaunchDxMmaFor<__nv_bfloat16>(const DevSpec&, int64_t,
                                                   const void*, const MmaDxDev&,
                                                   bool, cudaStream_t);

}  // namespace mhc::cuda::dx_mma
