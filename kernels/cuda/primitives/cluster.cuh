// Thread block clusters (sm_90): a CTA's rank in its cluster, the barrier
// across the cluster, and reads of a peer CTA's shared memory. A launch
// without a cluster dimension is a cluster of one CTA, where the rank is 0
// and the barrier is the CTA's own.
#ifndef MHC_KERNELS_CUDA_PRIMITIVES_CLUSTER_CUH_
#define MHC_KERNELS_CUDA_PRIMITIVES_CLUSTER_CUH_

#include <cstdint>

namespace mhc::cuda {

__device__ __forceinline__ unsigned ClusterCtaRank() {
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// Every thread of every CTA of the cluster arrives, then waits for the
// others: shared-memory writes before it are visible to the cluster's CTAs
// after it. Every thread must reach it (none may have returned).
__device__ __forceinline__ void ClusterSync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n\t"
      "barrier.cluster.wait.acquire.aligned;" ::
          : "memory");
}

// The same barrier without ordering memory: for a CTA that must not exit
// while its peers still read its shared memory, where each peer's loads
// have returned (their values used) before it arrives.
__device__ __forceinline__ void ClusterSyncRelaxed() {
  asm volatile(
      "barrier.cluster.arrive.relaxed.aligned;\n\t"
      "barrier.cluster.wait.aligned;" ::
          : "memory");
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

__device__ __forceinline__ float LoadPeerShared(uint32_t address) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];"
               : "=f"(v)
               : "r"(address)
               : "memory");
  return v;
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PRIMITIVES_CLUSTER_CUH_
