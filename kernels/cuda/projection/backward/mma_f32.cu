// The tensor-core dx / dphi kernel built for f32 activations.
#include "projection/backward/mma_launch.cuh"

namespace mhc::cuda::dx_mma {

template cudaError_t LaunchDxMmaFor<float>(const DevSpec&, int64_t, const void*,
                                           const MmaDxDev&, bool, cudaStream_t);

}  // namespace mhc::cuda::dx_mma
