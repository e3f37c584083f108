// Strided rows (row_access.cuh) staged through shared memory. Rows that
// start anywhere (odd C) keep the strided slots, lane l of a warp holding
// channels cw + l + 32 v of a window of 32 V channels, but the warp copies
// the 16-byte chunks that enclose the window with cp.async and each lane
// then reads its slots from the copy. Element loads hold a register per
// element until it lands, which kept too few CTAs per SM for the loads HBM
// needs in flight; the copies hold none. The slots and their values are the
// element loads', so every result keeps its bits.
//
// For 16-bit stream-major rows of tensors that start on 16 bytes (the row
// access plan's `staged`, plans/row_access.h): a window's first chunk may
// begin in the row before, never before the tensor, and no copy reads past
// the tensor's end.
#ifndef MHC_KERNELS_CUDA_PRIMITIVES_STAGED_WINDOWS_CUH_
#define MHC_KERNELS_CUDA_PRIMITIVES_STAGED_WINDOWS_CUH_

#include <cstdint>

#include "common.cuh"
#include "primitives/row_access.cuh"

namespace mhc::cuda {

// A warp's copy of one row's window: kChunks 16-byte chunks, one more than
// the window's span since it may start off 16 bytes.
template <typename T, int V>
struct StagedWindow {
  static constexpr int kPerChunk = 16 / sizeof(T);
  static constexpr int kChunks = 32 * V / kPerChunk + 1;
  static constexpr int kElems = kChunks * kPerChunk;
  static_assert(32 * V % kPerChunk == 0, "whole chunks per window");
};

// One 16-byte cp.async from global `src` to shared `dst`.
template <typename T>
__device__ __forceinline__ void CopyChunkAsync(T* dst, const T* src) {
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to),
               "l"(src));
}

// Copies the chunks holding channels [cw, cw + 32 V) of a row of C channels,
// in a tensor that ends before `end`, into `stage` (StagedWindow::kElems
// elements, 16-byte aligned). Chunks past the row's end are skipped and a
// chunk across it may copy the next row's first elements: ReadWindow reads
// neither. Only a chunk across the tensor's end (its last row's last chunk)
// is copied by its elements, since a cp.async reads all 16 bytes; the rest
// stay asynchronous, so no row waits for another's copies.
template <typename T, int V>
__device__ __forceinline__ void CopyWindow(const T* row, const T* end,
                                           int64_t cw, int64_t C, int lane,
                                           T* stage) {
  using W = StagedWindow<T, V>;
  const T* row_end = row + C;
  const T* base = reinterpret_cast<const T*>(
      reinterpret_cast<uintptr_t>(row + cw) & ~uintptr_t{15});
  if (cw + 32 * V + W::kPerChunk <= C) {
    // Every chunk inside the row, so inside the tensor: no checks.
    for (int k = lane; k < W::kChunks; k += 32) {
      CopyChunkAsync(stage + k * W::kPerChunk, base + k * W::kPerChunk);
    }
    return;
  }
  for (int k = lane; k < W::kChunks; k += 32) {
    const T* src = base + k * W::kPerChunk;
    T* dst = stage + k * W::kPerChunk;
    if (src >= row_end) continue;
    if (src + W::kPerChunk <= end) {
      CopyChunkAsync(dst, src);
    } else {
#pragma unroll
      for (int e = 0; e < W::kPerChunk; ++e) {
        if (src + e < row_end) dst[e] = src[e];
      }
    }
  }
}

// The lane's slots of a landed window that CopyWindow copied from row + cw;
// slots past C read as zero, as the element loads make them.
template <typename T, int V>
__device__ __forceinline__ void ReadWindow(const T* stage, const T* row,
                                           int64_t cw, int64_t C, int lane,
                                           float (&out)[V]) {
  const int shift = static_cast<int>(
      (reinterpret_cast<uintptr_t>(row + cw) & uintptr_t{15}) / sizeof(T));
  const T* at = stage + shift + lane;
  const bool inside = StridedSlotsInside<V>(cw + lane, C);
#pragma unroll
  for (int v = 0; v < V; ++v) {
    out[v] = inside || cw + lane + 32 * v < C ? ToFloat(at[32 * v]) : 0.0f;
  }
}

// Windows a warp keeps in flight: two where their stages fit the 48 KB of
// static shared memory a CTA may hold, so that the next window's copies
// land while this one computes; else one, copied, awaited and read in turn.
template <typename T, int V, int kCtaWarps, int kRows>
inline constexpr int kStagedWindows =
    2 * kCtaWarps* kRows* StagedWindow<T, V>::kElems * sizeof(T) <= 48 * 1024
        ? 2
        : 1;

// The strided channel loop (ForEachChannelStep's) on staged windows where
// kStaged (the row access plan's `staged`); returns false, running
// nothing, otherwise. Thread `thread` of kThreads striding a token's channels
// belongs to the warp that takes the windows from 32 V (thread / 32), kThreads
// V apart; its CTA holds kCtaWarps warps. rows(loaded, visit) calls visit(row,
// end, slots) for each of at most kRows rows, always in the same order: row is
// where the row's channel 0 lies, end the end of its tensor, slots the Loaded's
// V floats that its slots fill. After publish(), per window: the copies of
// every row (issued a window ahead where kStagedWindows is two), and once
// they have landed the lane's slots; step(c, loaded) then runs for the lanes
// whose first slot c lies inside the row, as on element loads. The stages
// are the warp's own, so warp barriers alone order them.
template <typename Loaded, typename T, int V, bool kStaged, int kThreads,
          int kCtaWarps, int kRows, typename Rows, typename Publish,
          typename Step>
__device__ __forceinline__ bool ForEachStagedStep(int64_t C, int thread,
                                                  Rows rows, Publish publish,
                                                  Step step) {
  if constexpr (!kStaged) {
    return false;
  } else {
    using W = StagedWindow<T, V>;
    constexpr int kWindows = kStagedWindows<T, V, kCtaWarps, kRows>;
    constexpr int64_t kWindowStep = int64_t{kThreads} * V;
    __shared__ alignas(16) T stage[kCtaWarps][kWindows][kRows][W::kElems];
    T(&mine)[kWindows][kRows][W::kElems] = stage[threadIdx.x / 32];
    const int lane = thread & 31;
    auto copy = [&](int64_t cw, int buf) {
      if (cw < C) {
        Loaded unused;
        int k = 0;
        rows(unused, [&](const T* row, const T* end, float(&)[V]) {
          CopyWindow<T, V>(row, end, cw, C, lane, mine[buf][k++]);
        });
      }
      // An empty group past the last window keeps the wait's count.
      asm volatile("cp.async.commit_group;\n" ::);
    };
    publish();
    int64_t cw = int64_t{thread >> 5} * 32 * V;
    if constexpr (kWindows == 2) copy(cw, 0);
    for (int buf = 0; cw < C; cw += kWindowStep, buf = (buf + 1) % kWindows) {
      if constexpr (kWindows == 2) {
        copy(cw + kWindowStep, buf ^ 1);
        asm volatile("cp.async.wait_group 1;\n" ::);
      } else {
        copy(cw, 0);
        asm volatile("cp.async.wait_group 0;\n" ::);
      }
      __syncwarp();
      Loaded loaded;
      int k = 0;
      rows(loaded, [&](const T* row, const T*, float(&slots)[V]) {
        ReadWindow<T, V>(mine[buf][k++], row, cw, C, lane, slots);
      });
      __syncwarp();  // every lane has read this stage before it is refilled
      const int64_t c = cw + lane;
      if (c < C) step(c, loaded);
    }
    return true;
  }
}

// The channel loop of kernels that read a token's NT streams alone (`row`
// its first, `end` the end of the tensor): step(c, x) with x[NT][V] the
// slots from c, staged where kStaged, else by LoadStreams.
template <typename T, int NT, int V, bool kStrided, bool kStaged, int kThreads,
          int kCtaWarps, typename Step>
__device__ __forceinline__ void ForEachStreamsStep(const DevSpec& s, int n,
                                                   const T* row, const T* end,
                                                   int thread, Step step) {
  struct Loaded {
    float x[NT][V];
  };
  auto rows = [&](Loaded& l, auto&& visit) {
#pragma unroll
    for (int i = 0; i < NT; ++i) visit(row + i * s.C, end, l.x[i]);
  };
  auto step_loaded = [&](int64_t c, const Loaded& l) { step(c, l.x); };
  if (ForEachStagedStep<Loaded, T, V, kStaged, kThreads, kCtaWarps, NT>(
          s.C, thread, rows, [] {}, step_loaded)) {
    return;
  }
  for (int64_t c = FirstChannel<V, kStrided>(thread); c < s.C;
       c += int64_t{kThreads} * V) {
    Loaded l;
    LoadStreams<T, NT, V, kStrided>(s, n, row, c, l.x);
    step(c, l.x);
  }
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PRIMITIVES_STAGED_WINDOWS_CUH_
