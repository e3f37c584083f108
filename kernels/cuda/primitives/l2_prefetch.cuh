// Requests that the L2 fetch global memory ahead of the loads that will read
// it. A bulk prefetch takes one instruction per span and no register, shared
// memory or barrier: the later loads then wait for an L2 hit rather than for
// HBM, which helps kernels whose registers cannot hold more loads in flight.
#ifndef MHC_KERNELS_CUDA_PRIMITIVES_L2_PREFETCH_CUH_
#define MHC_KERNELS_CUDA_PRIMITIVES_L2_PREFETCH_CUH_

#include <cstdint>

namespace mhc::cuda {

// Bytes [begin, end) of global memory, narrowed to the 16-byte chunks inside
// them (the bulk form's alignment), so nothing outside the span is touched.
__device__ __forceinline__ void PrefetchSpanL2(const void* begin,
                                               const void* end) {
  const uint64_t b = (reinterpret_cast<uint64_t>(begin) + 15) & ~uint64_t{15};
  const uint64_t e = reinterpret_cast<uint64_t>(end) & ~uint64_t{15};
  if (e <= b) return;
  asm volatile(
      "{\n"
      ".reg .u64 g;\n"
      "cvta.to.global.u64 g, %0;\n"
      "cp.async.bulk.prefetch.L2.global [g], %1;\n"
      "}\n" ::"l"(b),
      "r"(static_cast<uint32_t>(e - b))
      : "memory");
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PRIMITIVES_L2_PREFETCH_CUH_
