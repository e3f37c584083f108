// Bulk copies into shared memory by the tensor memory accelerator, completed
// on mbarriers: one thread asks for a whole tile and the CTA waits on the
// barrier, so the copies take no registers or issue slots of the threads
// that consume them.
#ifndef MHC_KERNELS_CUDA_PRIMITIVES_TMA_CUH_
#define MHC_KERNELS_CUDA_PRIMITIVES_TMA_CUH_

#include <cuda.h>

#include <cstdint>

namespace mhc::cuda {

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A barrier that completes when `arrivals` threads have arrived and the
// bytes they announced have landed.
__device__ __forceinline__ void MbarrierInit(uint64_t* bar, uint32_t arrivals) {
  asm volatile(
      "mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SharedAddress(bar)),
      "r"(arrivals)
      : "memory");
}

// Makes initialised barriers visible to the copy engine; a CTA barrier
// must follow before any thread uses them.
__device__ __forceinline__ void FenceMbarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void MbarrierArriveExpectBytes(uint64_t* bar,
                                                          uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                   SharedAddress(bar)),
               "r"(bytes)
               : "memory");
}

// Waits for the phase of `bar` whose parity is `parity` to complete.
__device__ __forceinline__ void MbarrierWait(uint64_t* bar, uint32_t parity) {
  const uint32_t at = SharedAddress(bar);
  uint32_t done;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(at), "r"(parity)
        : "memory");
  } while (done == 0);
}

// The box of `map` at element coordinates (c0 innermost, c1) into dst,
// elements outside the tensor as zeros; its bytes complete on bar.
__device__ __forceinline__ void TmaLoadTile2d(void* dst, const CUtensorMap* map,
                                              int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_"
      "tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(SharedAddress(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1),
      "r"(SharedAddress(bar))
      : "memory");
}

// 1-d and 3-d boxes, as TmaLoadTile2d.
__device__ __forceinline__ void TmaLoadTile1d(void* dst, const CUtensorMap* map,
                                              int c0, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.1d.shared::cluster.global.tile.mbarrier::complete_"
      "tx::bytes [%0], [%1, {%2}], [%3];" ::"r"(SharedAddress(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(SharedAddress(bar))
      : "memory");
}
__device__ __forceinline__ void TmaLoadTile3d(void* dst, const CUtensorMap* map,
                                              int c0, int c1, int c2,
                                              uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_"
      "tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(SharedAddress(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2),
      "r"(SharedAddress(bar))
      : "memory");
}

// `bytes` (a multiple of 16, both ends 16-byte aligned) from src to dst;
// they complete on bar.
__device__ __forceinline__ void BulkLoad(void* dst, const void* src,
                                         uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
      "[%0], [%1], %2, [%3];" ::"r"(SharedAddress(dst)),
      "l"(src), "r"(bytes), "r"(SharedAddress(bar))
      : "memory");
}

// A ring of kStages stage slots filled by tensor / bulk copies: slot i's
// copies complete on bars[i] (kStages barriers in shared memory), and bit i
// of `parity` is the phase of it the next wait expects. Stage st uses slot
// st % kStages.
template <int kStages>
struct CopyRing {
  static_assert(kStages <= 32, "a parity bit per stage");
  uint64_t* bars;
  uint32_t parity = 0;

  // By one thread; a CTA barrier must follow before any thread uses it.
  __device__ void Init() const {
    for (int i = 0; i < kStages; ++i) MbarrierInit(&bars[i], 1);
    FenceMbarrierInit();
  }
  __device__ uint64_t* Barrier(int st) const { return &bars[st % kStages]; }
  // Waits until stage st's copies have landed.
  __device__ void Wait(int st) {
    const int slot = st % kStages;
    MbarrierWait(&bars[slot], (parity >> slot) & 1u);
    parity ^= 1u << slot;
  }
};

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PRIMITIVES_TMA_CUH_
