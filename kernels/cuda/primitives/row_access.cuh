// Stream and channel accesses of the row kernels (aggregate, expand, post,
// the fused pre's aggregate and dh_pre): each thread handles V channels of
// every stream of a token (or of a slice of its streams, where a kernel
// splits them over thread groups), or of a [C] row, per loop step; the
// token's mixing values reach its CTA through CtaValues and the channel
// loop runs through ForEachChannelStep.
//
// Three modes, picked per launch by the row access plan
// (plans/row_access.h):
//  - element (V == 1): any n, C, layout and alignment;
//  - vector (V > 1): channels [c, c + V) with one 8- or 16-byte access per
//    stream, for rows that start on a vector boundary (C % V == 0, aligned
//    tensors);
//  - strided (V > 1, kStrided): rows that start anywhere, e.g. every odd C.
//    Channels c, c + 32, ..., c + 32 (V - 1) with element accesses: each warp
//    instruction still reads 32 consecutive elements, and a thread keeps the
//    vector path's V independent loads per stream in flight, which is what
//    the bandwidth needs (a single channel per thread leaves HBM idle).
// Elementwise results are the same bits in every mode. Sums over channels
// (dh_pre, dH_post, dH_res) follow the threads' channel slots, so their bits
// depend on the mode, which C and the tensors' alignment choose; they never
// depend on M or on the other tokens.
#ifndef MHC_KERNELS_CUDA_PRIMITIVES_ROW_ACCESS_CUH_
#define MHC_KERNELS_CUDA_PRIMITIVES_ROW_ACCESS_CUH_

#include <cstdint>

#include "common.cuh"

namespace mhc::cuda {

// Distance between a thread's consecutive channel slots.
template <bool kStrided>
inline constexpr int kSlotStride = kStrided ? 32 : 1;

// The first channel of thread t (of a block or, with one warp per row, of a
// warp): warp w of a strided step covers channels [32 V w, 32 V (w + 1)).
template <int V, bool kStrided>
__device__ __forceinline__ int64_t FirstChannel(int t) {
  if constexpr (kStrided) {
    return static_cast<int64_t>(t >> 5) * 32 * V + (t & 31);
  } else {
    return static_cast<int64_t>(t) * V;
  }
}

// Whether all V strided slots from c0 lie in a row of C channels, as at every
// step but a row's last. The accessors then skip the per-slot bounds checks
// and test the layout once rather than per element: most of a strided
// step's address arithmetic.
template <int V>
__device__ __forceinline__ bool StridedSlotsInside(int64_t c0, int64_t C) {
  return c0 + 32 * (V - 1) < C;
}

// The strided slots from c0 of streams first .. first + S - 1 of one token
// row (n == NT streams), every slot inside the row: read into `out`, or
// written from `in`.
template <typename T, int NT, int S, int V>
__device__ __forceinline__ void LoadStridedInside(const DevSpec& s,
                                                  const T* row, int first,
                                                  int64_t c0,
                                                  float (&out)[S][V]) {
  if (s.minor) {
    const T* at = row + c0 * NT + first;
#pragma unroll
    for (int a = 0; a < S; ++a) {
#pragma unroll
      for (int v = 0; v < V; ++v) out[a][v] = ToFloat(at[32 * v * NT + a]);
    }
  } else {
#pragma unroll
    for (int a = 0; a < S; ++a) {
      const T* at = row + (first + a) * s.C + c0;
#pragma unroll
      for (int v = 0; v < V; ++v) out[a][v] = ToFloat(at[32 * v]);
    }
  }
}
template <typename T, int NT, int S, int V>
__device__ __forceinline__ void StoreStridedInside(const DevSpec& s, T* row,
                                                   int first, int64_t c0,
                                                   const float (&in)[S][V]) {
  if (s.minor) {
    T* at = row + c0 * NT + first;
#pragma unroll
    for (int a = 0; a < S; ++a) {
#pragma unroll
      for (int v = 0; v < V; ++v) at[32 * v * NT + a] = FromFloat<T>(in[a][v]);
    }
  } else {
#pragma unroll
    for (int a = 0; a < S; ++a) {
      T* at = row + (first + a) * s.C + c0;
#pragma unroll
      for (int v = 0; v < V; ++v) at[32 * v] = FromFloat<T>(in[a][v]);
    }
  }
}

// Streams 0..n-1 of the channel slots from c0 of one token row. NT is the
// stream capacity; V > 1 requires n == NT, and the vector path also
// C % V == 0 and 16-byte aligned rows; the launchers check.
template <typename T, int NT, int V, bool kStrided>
__device__ __forceinline__ void LoadStreams(const DevSpec& s, int n,
                                            const T* row, int64_t c0,
                                            float (&out)[NT][V]) {
  if constexpr (kStrided) {
    if (StridedSlotsInside<V>(c0, s.C)) {
      LoadStridedInside<T, NT, NT, V>(s, row, 0, c0, out);
      return;
    }
#pragma unroll
    for (int i = 0; i < NT; ++i) {
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const int64_t c = c0 + kSlotStride<kStrided> * v;
        out[i][v] = c < s.C ? ToFloat(row[XIndex(s, i, c)]) : 0.0f;
      }
    }
  } else if constexpr (V > 1) {
    if (s.minor) {
      // The block (c0..c0+V) x (all streams) is contiguous: NT*V elements.
      constexpr int kPer = 16 / sizeof(T);
      constexpr int kVecs = NT * V / kPer;
      const T* base = row + c0 * NT;
#pragma unroll
      for (int q = 0; q < kVecs; ++q) {
        float tmp[kPer];
        LoadVec<T, kPer>(base + q * kPer, tmp);
#pragma unroll
        for (int e = 0; e < kPer; ++e) {
          const int flat = q * kPer + e;
          out[flat % NT][flat / NT] = tmp[e];
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < NT; ++i) LoadVec<T, V>(row + i * s.C + c0, out[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      out[i][0] = i < n ? ToFloat(row[XIndex(s, i, c0)]) : 0.0f;
    }
  }
}

template <typename T, int NT, int V, bool kStrided>
__device__ __forceinline__ void StoreStreams(const DevSpec& s, int n, T* row,
                                             int64_t c0,
                                             const float (&in)[NT][V]) {
  if constexpr (kStrided) {
    if (StridedSlotsInside<V>(c0, s.C)) {
      StoreStridedInside<T, NT, NT, V>(s, row, 0, c0, in);
      return;
    }
#pragma unroll
    for (int i = 0; i < NT; ++i) {
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const int64_t c = c0 + kSlotStride<kStrided> * v;
        if (c < s.C) row[XIndex(s, i, c)] = FromFloat<T>(in[i][v]);
      }
    }
  } else if constexpr (V > 1) {
    if (s.minor) {
      constexpr int kPer = 16 / sizeof(T);
      constexpr int kVecs = NT * V / kPer;
      T* base = row + c0 * NT;
#pragma unroll
      for (int q = 0; q < kVecs; ++q) {
        float tmp[kPer];
#pragma unroll
        for (int e = 0; e < kPer; ++e) {
          const int flat = q * kPer + e;
          tmp[e] = in[flat % NT][flat / NT];
        }
        StoreVec<T, kPer>(base + q * kPer, tmp);
      }
    } else {
#pragma unroll
      for (int i = 0; i < NT; ++i) StoreVec<T, V>(row + i * s.C + c0, in[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      if (i < n) row[XIndex(s, i, c0)] = FromFloat<T>(in[i][0]);
    }
  }
}

// The channel slots from c0 of a [C] row.
template <typename T, int V, bool kStrided>
__device__ __forceinline__ void LoadChannels(const T* row, int64_t c0,
                                             int64_t C, float (&out)[V]) {
  if constexpr (kStrided) {
    const bool inside = StridedSlotsInside<V>(c0, C);
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const int64_t c = c0 + kSlotStride<kStrided> * v;
      out[v] = inside || c < C ? ToFloat(row[c]) : 0.0f;
    }
  } else {
    LoadVec<T, V>(row + c0, out);
  }
}

template <typename T, int V, bool kStrided>
__device__ __forceinline__ void StoreChannels(T* row, int64_t c0, int64_t C,
                                              const float (&in)[V]) {
  if constexpr (kStrided) {
    const bool inside = StridedSlotsInside<V>(c0, C);
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const int64_t c = c0 + kSlotStride<kStrided> * v;
      if (inside || c < C) row[c] = FromFloat<T>(in[v]);
    }
  } else {
    StoreVec<T, V>(row + c0, in);
  }
}

// The bias of every channel slot added to v.
template <int V, bool kStrided>
__device__ __forceinline__ void AddChannels(const float* bias, int64_t c0,
                                            int64_t C, float (&v)[V]) {
  const bool inside = !kStrided || StridedSlotsInside<V>(c0, C);
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int64_t c = c0 + kSlotStride<kStrided> * k;
    if (inside || c < C) v[k] += bias[c];
  }
}

// Streams first .. first + S - 1 of the NT of the channel slots from c0 of
// one token row (streams past n read as zero and are not written): all of
// them through LoadStreams / StoreStreams when S == NT. Otherwise the vector
// path takes one access per stream in the stream-major layout and element
// accesses in the stream-minor one, where a slice of streams is not
// contiguous.
template <typename T, int NT, int S, int V, bool kStrided>
__device__ __forceinline__ void LoadStreamSlice(const DevSpec& s, int n,
                                                const T* row, int first,
                                                int64_t c0,
                                                float (&out)[S][V]) {
  if constexpr (S == NT) {
    LoadStreams<T, NT, V, kStrided>(s, n, row, c0, out);
  } else {
    if constexpr (V > 1 && !kStrided) {
      if (!s.minor) {
#pragma unroll
        for (int a = 0; a < S; ++a) {
          LoadVec<T, V>(row + (first + a) * s.C + c0, out[a]);
        }
        return;
      }
    }
    if constexpr (kStrided) {
      if (StridedSlotsInside<V>(c0, s.C)) {
        LoadStridedInside<T, NT, S, V>(s, row, first, c0, out);
        return;
      }
    }
#pragma unroll
    for (int a = 0; a < S; ++a) {
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const int64_t c = c0 + kSlotStride<kStrided> * v;
        const int i = first + a;
        out[a][v] = i < n && c < s.C ? ToFloat(row[XIndex(s, i, c)]) : 0.0f;
      }
    }
  }
}

template <typename T, int NT, int S, int V, bool kStrided>
__device__ __forceinline__ void StoreStreamSlice(const DevSpec& s, int n,
                                                 T* row, int first, int64_t c0,
                                                 const float (&in)[S][V]) {
  if constexpr (S == NT) {
    StoreStreams<T, NT, V, kStrided>(s, n, row, c0, in);
  } else {
    if constexpr (V > 1 && !kStrided) {
      if (!s.minor) {
#pragma unroll
        for (int a = 0; a < S; ++a) {
          StoreVec<T, V>(row + (first + a) * s.C + c0, in[a]);
        }
        return;
      }
    }
    if constexpr (kStrided) {
      if (StridedSlotsInside<V>(c0, s.C)) {
        StoreStridedInside<T, NT, S, V>(s, row, first, c0, in);
        return;
      }
    }
#pragma unroll
    for (int a = 0; a < S; ++a) {
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const int64_t c = c0 + kSlotStride<kStrided> * v;
        const int i = first + a;
        if (i < n && c < s.C) row[XIndex(s, i, c)] = FromFloat<T>(in[a][v]);
      }
    }
  }
}

// A token's values that every thread of a row kernel's CTA of kThreads
// reads (H_pre, H_post, R), slot t held by thread t % kThreads. Fetch issues
// the global loads into registers; the kernel then issues its first channel
// loads and Publish stores the values to shared memory and syncs, so the two
// round trips overlap. (Loaded and synced first, they added a round trip to
// every CTA, whose whole life is a few of them.)
template <int kSlots, int kThreads = kRowThreads>
class CtaValues {
 public:
  // value_of(slot) reads the slot's value from global memory.
  template <typename ValueOf>
  __device__ __forceinline__ void Fetch(ValueOf value_of) {
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
      const int slot = static_cast<int>(threadIdx.x) + q * kThreads;
      value_[q] = slot < kSlots ? value_of(slot) : 0.0f;
    }
  }
  __device__ __forceinline__ void Publish(float (&shared)[kSlots]) {
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
      const int slot = static_cast<int>(threadIdx.x) + q * kThreads;
      if (slot < kSlots) shared[slot] = value_[q];
    }
    __syncthreads();
  }

 private:
  static constexpr int kPer = (kSlots + kThreads - 1) / kThreads;
  float value_[kPer];
};

// A row kernel's channel loop over the slots of thread (of kThreads threads
// per token row): load(c, loaded) fills a Loaded with the
// channel step at c, step(c, loaded) consumes it, after publish()
// (CtaValues::Publish of values fetched earlier). With kOverlapFirst the
// first step's loads are issued before publish(), so their round trips
// overlap; that step is peeled rather than its values carried around the
// loop, which would hold them converted to fp32 across the back edge. It
// costs registers: measured faster for the backward kernels' vector and
// element paths, slower for the forward kernels and strided rows
// (docs/decisions.md).
template <typename Loaded, int V, bool kStrided, bool kOverlapFirst,
          int kThreads = kRowThreads, typename Load, typename Publish,
          typename Step>
__device__ __forceinline__ void ForEachChannelStep(int64_t C, int thread,
                                                   Load load, Publish publish,
                                                   Step step) {
  constexpr int kStep = kThreads * V;
  int64_t c = FirstChannel<V, kStrided>(thread);
  if constexpr (kOverlapFirst) {
    {
      Loaded first;
      if (c < C) load(c, first);
      publish();
      if (c < C) step(c, first);
    }
    c += kStep;
  } else {
    publish();
  }
  for (; c < C; c += kStep) {
    Loaded next;
    load(c, next);
    step(c, next);
  }
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PRIMITIVES_ROW_ACCESS_CUH_
