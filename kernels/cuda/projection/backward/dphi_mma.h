// The phi gradient of the two-kernel projection backward
// (projection/backward/wide.cu) on mma.sync tiles, for what the wgmma kernel
// (projection/backward/dphi_wgmma.h) does not take: IEEE matmul precision (tf32
// high and low parts, three products) and x rows off 16 bytes.
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_DPHI_MMA_H_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_DPHI_MMA_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"

namespace mhc::cuda {

// dh_t: [Np][Mp] rounded dh^T, tokens in order (Np >= N a multiple of 32, Mp
// >= tokens a multiple of 4, zero past N and past the tokens); dh_t[1] the
// low parts under IEEE. partial: [chunks][N][K], one per chunk_tokens tokens
// (a multiple of kTokenChunk). vector_x: x rows on 16 bytes.
cudaError_t LaunchMmaPhiPartials(const DevSpec& s, int64_t tokens,
                                 int chunk_tokens, DType dtype, bool ieee,
                                 const void* x, bool vector_x,
                                 float* const (&dh_t)[2], int64_t Mp, int Np,
                                 float* partial, cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_DPHI_MMA_H_
