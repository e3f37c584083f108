// Thread block clusters (sm_90): a CTA's rank in its cluster, the barrier
// across the cluster in halves, and bulk copies into a peer CTA's shared
// memory. A launch without a cluster dimension is a cluster of one CTA,
// where the rank is 0 and the barrier is the CTA's own.
#ifndef MHC_KERNELS_CUDA_PRIMITIVES_CLUSTER_CUH_
#define MHC_KERNELS_CUDA_PRIMITIVES_CLUSTER_CUH_

#include <cstdint>

namespace mhc::cuda {

__device__ __forceinline__ unsigned ClusterCtaRank() {
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// The barrier across the cluster in two halves, neither ordering memory:
// for CTAs that only need their peers started (their mbarriers initialised,
// whose fence orders them) before copying into them, or still present
// before leaving. Every thread of every CTA arrives once, then waits once;
// none may have returned.
__device__ __forceinline__ void ClusterArriveRelaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void ClusterWait() {
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}

// Where `p`, an address in this CTA's shared memory, lies in the shared
// memory of the cluster's CTA `rank`.
__device__ __forceinline__ uint32_t PeerSharedAddress(const void* p,
                                                      unsigned rank) {
  const auto local = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote)
               : "r"(local), "r"(rank));
  return remote;
}

// Copies `bytes` (a multiple of 16, both ends 16-byte aligned) from this
// CTA's shared memory at src to `address` in a peer's (PeerSharedAddress),
// counted on the peer's mbarrier at `barrier` (also mapped): the peer sees
// them once that barrier's phase completes. One thread issues it; nothing
// tells the sender when src has been read, so src stays untouched, and its
// CTA alive, until the peer has its bytes.
__device__ __forceinline__ void CopyToPeerShared(uint32_t address,
                                                 const void* src,
                                                 uint32_t bytes,
                                                 uint32_t barrier) {
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes "
      "[%0], [%1], %2, [%3];" ::"r"(address),
      "r"(static_cast<uint32_t>(__cvta_generic_to_shared(src))), "r"(bytes),
      "r"(barrier)
      : "memory");
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PRIMITIVES_CLUSTER_CUH_
