// The last CTA of a grid, or of a group of its CTAs, found without a second
// launch: every CTA writes its partial result, then counts itself in at a
// device counter; the CTA that brings the count to the grid's (the group's)
// size sees every other CTA's partial and finishes the reduction in a fixed
// order. The counter is 0 when the kernel starts and that last CTA sets it
// back to 0 (ResetArrivals), so one counter serves every launch that its
// stream serialises.
#ifndef MHC_KERNELS_CUDA_PRIMITIVES_GRID_ARRIVAL_CUH_
#define MHC_KERNELS_CUDA_PRIMITIVES_GRID_ARRIVAL_CUH_

namespace mhc::cuda {

// atomicAdd with acquire-release ordering at GPU scope.
__device__ __forceinline__ unsigned AddAcqRel(unsigned* counter, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(counter), "r"(v)
               : "memory");
  return old;
}

// True in every thread of the last of `ctas` CTAs to count themselves in at
// `arrivals`. Every thread of each CTA calls it once, after its writes of the
// partial result. The count is an acq_rel atomic: as a release it publishes
// the writes the barrier ordered before it, as an acquire (in the last CTA)
// every other CTA's. __threadfence's sequentially consistent fences, one per
// writer and one in the last CTA, cost more and order nothing more. The last
// CTA reads the partials through L2 (__ldcg): its L1 may hold none of them,
// but nothing else keeps it coherent.
__device__ __forceinline__ bool LastOfCtasToArrive(unsigned* arrivals,
                                                   unsigned ctas) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
    last = AddAcqRel(arrivals, 1u) == ctas - 1;
  }
  __syncthreads();
  return last;
}

// LastOfCtasToArrive over the whole grid.
__device__ __forceinline__ bool LastCtaToArrive(unsigned* arrivals) {
  return LastOfCtasToArrive(arrivals, gridDim.x * gridDim.y * gridDim.z);
}

// By the last CTA, once it has its answer: ready for the next launch.
__device__ __forceinline__ void ResetArrivals(unsigned* arrivals) {
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) *arrivals = 0;
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PRIMITIVES_GRID_ARRIVAL_CUH_
