// Launch setup of the kernels that use most of an SM's shared memory: the
// dynamic shared memory limit (the device's opt-in maximum) and the
// max-shared carveout, set once per (kernel, device), and how many CTAs of a
// launch shape fit on the device at once, asked once per (kernel, device,
// shape). These answers never change for a device, and the driver calls
// cost microseconds that small requests would pay on every launch.
#ifndef MHC_KERNELS_CUDA_PRIMITIVES_KERNEL_FIT_H_
#define MHC_KERNELS_CUDA_PRIMITIVES_KERNEL_FIT_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "common.cuh"

namespace mhc::cuda {

// Prepares `kernel` on the current device for launches of `threads` threads
// and `smem` bytes of dynamic shared memory; with `resident` also returns
// the CTAs of that shape the whole device holds at once (at least the SM
// count).
cudaError_t FitLargeSmemKernel(const void* kernel, int threads, size_t smem,
                               int64_t* resident);

// Launches `kernel` on `grid` CTAs of `threads` threads and `smem` bytes of
// dynamic shared memory, prepared by FitLargeSmemKernel first, as a
// programmatic launch (LaunchAfterPrevious): every kernel launched here
// calls WaitForPrerequisiteGrid before it touches memory. With `cluster`
// CTAs per cluster (more than one), a cluster launch.
template <typename... Exp, typename... Act>
cudaError_t LaunchLargeSmemClusters(void (*kernel)(Exp...), dim3 grid,
                                    dim3 cluster, int threads, size_t smem,
                                    cudaStream_t stream, Act&&... args) {
  const cudaError_t e = FitLargeSmemKernel(
      reinterpret_cast<const void*>(kernel), threads, smem, nullptr);
  if (e != cudaSuccess) return e;
  return LaunchClusterKernelEx(kernel, grid, dim3(threads), cluster, smem,
                               stream, /*after_previous=*/true,
                               std::forward<Act>(args)...);
}
template <typename... Exp, typename... Act>
cudaError_t LaunchLargeSmem(void (*kernel)(Exp...), dim3 grid, int threads,
                            size_t smem, cudaStream_t stream, Act&&... args) {
  return LaunchLargeSmemClusters(kernel, grid, dim3(1, 1, 1), threads, smem,
                                 stream, std::forward<Act>(args)...);
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PRIMITIVES_KERNEL_FIT_H_
