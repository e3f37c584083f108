// The channel loop of the n = 4 post backward (post.cu) on 16-byte vector
// rows: a step's words kept as loaded while the step before them computes.
#ifndef MHC_KERNELS_CUDA_POST_BACKWARD_STEPS_CUH_
#define MHC_KERNELS_CUDA_POST_BACKWARD_STEPS_CUH_

#include <cstdint>

#include "common.cuh"
#include "primitives/row_access.cuh"

namespace mhc::cuda {

// The four 16-byte words of one channel step of a token row (the thread's V
// channels of every stream), kept as loaded until its step computes.
struct StepWords {
  uint4 w[4];
};

// Value of stream i, channel slot v of a step's words: element v of word i
// in stream-major rows; in the stream-minor block (each channel's four
// streams together) element v * 4 + i of the four words in turn.
template <typename T, bool kMinor>
__device__ __forceinline__ float StepValue(const StepWords& words, int i,
                                           int v) {
  constexpr int kPer = 16 / sizeof(T);
  const int flat = kMinor ? v * 4 + i : i * kPer + v;
  return ToFloat(
      reinterpret_cast<const T*>(&words.w[flat / kPer])[flat % kPer]);
}
template <typename T, bool kMinor>
__device__ __forceinline__ void SetStepValue(StepWords& words, int i, int v,
                                             float value) {
  constexpr int kPer = 16 / sizeof(T);
  const int flat = kMinor ? v * 4 + i : i * kPer + v;
  reinterpret_cast<T*>(&words.w[flat / kPer])[flat % kPer] =
      FromFloat<T>(value);
}
// The word q of a step at channel c of a token row.
template <typename T, bool kMinor>
__device__ __forceinline__ int64_t StepWordAt(int64_t C, int64_t c, int q) {
  return kMinor ? c * 4 + q * (16 / sizeof(T)) : q * C + c;
}

// The n = 4 post backward's channel loop on 16-byte vector rows, in either
// layout, for a token row of kThreads threads: each step's loads go out
// before the step before it computes, held as loaded words and converted
// channel by channel, so every thread keeps two steps of loads in flight
// (with one, HBM idled between steps; docs/decisions.md). Every sum adds its
// terms in the order of post.cu's general loop (per sum, channel slots in
// order): the same bits. acc: dH_post[4], then dH_res[4][4]; publish() once
// the first loads are out.
template <typename T, bool kMinor, int kThreads, typename Publish>
__device__ __forceinline__ void PipelinedBackwardSteps(
    const DevSpec& s, const T* g_row, const T* x_row, const T* f_row,
    const float* bias, const float* r, const float* hp, T* df_row, T* dx_row,
    int thread, float (&acc)[20], Publish&& publish) {
  constexpr int kN = 4, V = 16 / sizeof(T);
  constexpr int kStep = kThreads * V;
  struct Words {
    StepWords g, x;
    uint4 f;
  };
  auto load = [&](int64_t c, Words& w) {
#pragma unroll
    for (int q = 0; q < kN; ++q) {
      const int64_t at = StepWordAt<T, kMinor>(s.C, c, q);
      w.g.w[q] = *reinterpret_cast<const uint4*>(g_row + at);
      w.x.w[q] = *reinterpret_cast<const uint4*>(x_row + at);
    }
    w.f = *reinterpret_cast<const uint4*>(f_row + c);
  };
  int64_t c = FirstChannel<V, false>(thread);
  Words cur;
  if (c < s.C) load(c, cur);
  publish();
  for (; c < s.C; c += kStep) {
    Words next;
    if (c + kStep < s.C) load(c + kStep, next);
    uint4 df_word;
    StepWords dx_words;
#pragma unroll
    for (int v = 0; v < V; ++v) {
      float g[kN], xv[kN];
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        g[i] = StepValue<T, kMinor>(cur.g, i, v);
        xv[i] = StepValue<T, kMinor>(cur.x, i, v);
      }
      float fv = ToFloat(reinterpret_cast<const T*>(&cur.f)[v]);
      if (s.has_bias) fv += bias[c + v];
      float d = 0.0f;
#pragma unroll
      for (int j = 0; j < kN; ++j) d = fmaf(hp[j], g[j], d);
      reinterpret_cast<T*>(&df_word)[v] = FromFloat<T>(d);
#pragma unroll
      for (int j = 0; j < kN; ++j) acc[j] = fmaf(g[j], fv, acc[j]);
#pragma unroll
      for (int a = 0; a < kN; ++a) {
#pragma unroll
        for (int j = 0; j < kN; ++j) {
          acc[kN + a * kN + j] = fmaf(xv[a], g[j], acc[kN + a * kN + j]);
        }
      }
      if (dx_row != nullptr) {
#pragma unroll
        for (int a = 0; a < kN; ++a) {
          float e = 0.0f;
#pragma unroll
          for (int j = 0; j < kN; ++j) e = fmaf(r[a * kN + j], g[j], e);
          SetStepValue<T, kMinor>(dx_words, a, v, e);
        }
      }
    }
    *reinterpret_cast<uint4*>(df_row + c) = df_word;
    if (dx_row != nullptr) {
#pragma unroll
      for (int q = 0; q < kN; ++q) {
        *reinterpret_cast<uint4*>(dx_row + StepWordAt<T, kMinor>(s.C, c, q)) =
            dx_words.w[q];
      }
    }
    cur = next;
  }
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_POST_BACKWARD_STEPS_CUH_
