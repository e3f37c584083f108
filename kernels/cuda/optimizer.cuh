// Device primitives of the optimizer kernels (optimizer.cu): a float64 block
// sum in a fixed order.
#ifndef MHC_KERNELS_CUDA_OPTIMIZER_CUH_
#define MHC_KERNELS_CUDA_OPTIMIZER_CUH_

#include <cuda_runtime.h>

namespace mhc::cuda {

// Threads of every optimizer kernel; the reduction tree depends on it.
inline constexpr int kOptimizerThreads = 256;

// The sum of `v` over the block (kOptimizerThreads threads), valid in
// thread 0: an xor tree inside each warp, then the warps' totals in warp
// order. The same bits for the same inputs on every run.
__device__ __forceinline__ double BlockSumF64(double v) {
  __shared__ double warp_totals[kOptimizerThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) warp_totals[warp] = v;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int w = 0; w < kOptimizerThreads / 32; ++w) total += warp_totals[w];
  }
  return total;
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_OPTIMIZER_CUH_
