// The phi gradient of the two-kernel projection backward
// (projection/backward/wide.cu) on warpgroup mmas: per fixed chunk of
// PhiChunkTokens tokens, dphi^T [K x N] = x^T [K x tokens] . dh [tokens x N],
// for TF32 matmul precision and x rows on 16 bytes (other requests keep the
// mma.sync kernel there).
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_DPHI_WGMMA_H_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_DPHI_WGMMA_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"

namespace mhc::cuda {

// Where token m of a chunk row of the rounded dh^T sits: within each group of
// 8 tokens, 2 u at u and 2 u + 1 at u + 4, the k slots in which the A
// fragments of x^T (ldmatrix.trans) hold those tokens.
__host__ __device__ inline int64_t WgmmaTokenPosition(int64_t m) {
  const int e = static_cast<int>(m & 7);
  return (m & ~int64_t{7}) | ((e & 1) ? 4 + (e >> 1) : e >> 1);
}

// dh_t: [Np][Mp] rounded tf32 dh^T (Np >= N a multiple of 32, Mp >= tokens a
// multiple of 8, zero past N and past the tokens), tokens placed by
// WgmmaTokenPosition. partial: [chunks][N][K], one per chunk_tokens tokens
// (a multiple of kTokenChunk). x rows on 16 bytes.
cudaError_t LaunchWgmmaPhiPartials(const DevSpec& s, int64_t tokens,
                                   int chunk_tokens, DType dtype, const void* x,
                                   const float* dh_t, int64_t Mp, int Np,
                                   float* partial, cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_DPHI_WGMMA_H_
