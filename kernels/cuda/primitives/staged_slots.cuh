// cp.async staging of activation rows whose elements sit at any element
// alignment (odd C, offset tensors) into 16-byte aligned shared memory.
//
// A thread copies 16-byte slots: kSlotElems elements that are contiguous in
// global memory. A full slot goes through cp.async with the widest copy its
// address allows (16, 8 or 4 bytes), so a stage stays asynchronous. A 16-bit
// slot p[0..7] that starts in the middle of a 4-byte word copies the 16
// bytes holding p[-1..6] instead (again as wide as their start allows), and
// the thread that copied it realigns it once its stage has landed
// (RealignSlot). p[7] is the second half of the first word of the next slot
// of the same contiguous run, read from the lane that copied it (the next
// slot of a row always sits on the next lane), or, for the last full slot
// of a run, of one extra word that thread copied into the staged row's pad.
// Partial slots (the tile's last channels) are element copies with zero
// fill; slots past the last token are zero filled. No copy reads outside the
// tensor's allocation: p[-1] shares its aligned word with p[0], and where
// p[7] ends the tensor the extra word's element is copied alone.
//
// fp32 elements always start a word, so only 16-bit slots ever realign.
#ifndef MHC_KERNELS_CUDA_PRIMITIVES_STAGED_SLOTS_CUH_
#define MHC_KERNELS_CUDA_PRIMITIVES_STAGED_SLOTS_CUH_

#include <cstdint>

#include "common.cuh"
#include "projection/forward/mma.cuh"

namespace mhc::cuda {

template <typename T>
inline constexpr int kSlotElems = 16 / static_cast<int>(sizeof(T));

// Where one thread's slot of a staged row comes from; the same at every
// stage, since a thread keeps its columns.
struct SlotColumns {
  int k;      // offset of the slot's first element in a global row
  int valid;  // elements of the slot inside the row (0 .. kSlotElems)
  int extra;  // staged-row offset of the run's extra word; -1: not a run end
};

// `run_left`: elements of the slot's contiguous run from its first element
// (the run's remaining length, capped by the row); `pad`: staged-row offset
// of the run's extra word (4-byte aligned).
template <typename T>
__device__ __forceinline__ SlotColumns MakeSlotColumns(int64_t k,
                                                       int64_t run_left,
                                                       int pad) {
  constexpr int kW = kSlotElems<T>;
  SlotColumns c;
  c.k = static_cast<int>(k);
  c.valid = static_cast<int>(run_left < 0 ? 0 : run_left < kW ? run_left : kW);
  // The last full slot: the next one of the run is partial or absent.
  c.extra = c.valid == kW && run_left < 2 * kW ? pad : -1;
  return c;
}

// How a thread copies one slot of one of its rows: 4 bits, the same at every
// stage, because stages start a multiple of 16 bytes apart in every row
// tensor (kSlotPlanRows rows of a thread pack into one word). Bits 0-1: the
// copy width (16, 8 or 4 bytes); bit 2: shifted (a 16-bit slot off a word,
// copied from the word holding its first element).
inline constexpr int kSlotPlanBits = 4;
inline constexpr int kSlotPlanRows = 8;
template <typename T>
__device__ __forceinline__ uint32_t SlotPlanOf(const T* first,
                                               const SlotColumns& c) {
  if (c.valid < kSlotElems<T>) return 0;  // element or zero copies
  const auto addr = reinterpret_cast<uintptr_t>(first);
  const bool shifted = sizeof(T) == 2 && (addr & 3) != 0;
  const uintptr_t from = addr - (shifted ? 2 : 0);
  const uint32_t width = from % 16 == 0 ? 0 : from % 8 == 0 ? 1 : 2;
  return width | (shifted ? 4u : 0u);
}
__device__ __forceinline__ uint32_t RowPlan(uint32_t plans, int i) {
  return (plans >> (kSlotPlanBits * i)) & ((1u << kSlotPlanBits) - 1);
}

// Issues the copy of one slot of a stage. `src_row`: the global row (any
// valid pointer when !row_ok); `dst_row`: the staged row, 16-byte aligned;
// `plan`: SlotPlanOf the slot's first element; `end`: the tensor's end.
template <typename T>
__device__ __forceinline__ void IssueSlot(T* dst_row, int j, const T* src_row,
                                          const SlotColumns& c, bool row_ok,
                                          uint32_t plan, const T* end) {
  constexpr int kW = kSlotElems<T>;
  T* slot = dst_row + j;
  if (!row_ok || c.valid == 0) {
    CpAsync<16>(slot, src_row, false);
    return;
  }
  const T* p = src_row + c.k;
  if (c.valid < kW) {
    for (int e = 0; e < kW; ++e) {
      slot[e] = e < c.valid ? p[e] : FromFloat<T>(0.0f);
    }
    return;
  }
  const bool shifted = plan & 4;
  const T* from = shifted ? p - 1 : p;
  switch (plan & 3) {
    case 0:
      CpAsync<16>(slot, from, true);
      break;
    case 1:
      CpAsync<8>(slot, from, true);
      CpAsync<8>(slot + kW / 2, from + kW / 2, true);
      break;
    default:
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        CpAsync<4>(slot + w * kW / 4, from + w * kW / 4, true);
      }
  }
  if (shifted && c.extra >= 0) {
    if (p + kW < end) {
      CpAsync<4>(dst_row + c.extra, from + kW, true);
    } else {
      dst_row[c.extra] = p[kW - 1];  // the low half, all RealignSlot reads
    }
  }
}

// Realigns this thread's slot of a landed stage, after cp.async.wait_group
// and before the barrier that publishes the stage. All lanes of the warp
// call it (the next slot's first word comes by shuffle).
template <typename T>
__device__ __forceinline__ void RealignSlot(T* dst_row, int j,
                                            const SlotColumns& c, bool row_ok,
                                            uint32_t plan) {
  if constexpr (sizeof(T) == 2) {
    const bool shifted = row_ok && (plan & 4);
    if (!__any_sync(0xffffffffu, shifted)) return;
    uint4 w = *reinterpret_cast<const uint4*>(dst_row + j);
    const uint32_t next_slot = __shfl_down_sync(0xffffffffu, w.x, 1);
    if (!shifted) return;
    const uint32_t next =
        c.extra >= 0 ? *reinterpret_cast<const uint32_t*>(dst_row + c.extra)
                     : next_slot;
    // Little endian: a word's first element is its low half.
    w.x = __funnelshift_r(w.x, w.y, 16);
    w.y = __funnelshift_r(w.y, w.z, 16);
    w.z = __funnelshift_r(w.z, w.w, 16);
    w.w = __funnelshift_r(w.w, next, 16);
    *reinterpret_cast<uint4*>(dst_row + j) = w;
  }
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PRIMITIVES_STAGED_SLOTS_CUH_
