// The fused pre backward's per-token terms of dx, H_pre dy + R dx_next (the
// post's residual path folded in), summed in fp32 for one chunk of channels
// at a time, for the wide projection backward to add before its single
// rounding (projection/backward/wide.cu). Computing them apart keeps that
// kernel on runs of K: added in its epilogue they took it onto 16-byte
// channel tiles and made it wait on dx_next, half of its time at n = 16.
//
// A chunk is the channels [begin, begin + width) of every stream; its
// columns j < n width run in the layout's order: stream major j = i width +
// (c - begin), stream minor j = (c - begin) n + i (consecutive k either way
// within a stream's run). The terms are [tokens][n width] fp32 in that order.
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WIDE_TERMS_CUH_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WIDE_TERMS_CUH_

#include <cstdint>

#include "common.cuh"
#include "projection/geometry.h"

namespace mhc::cuda {

struct ChannelChunk {
  int64_t begin;
  int64_t width;
};

// Channels per chunk of the terms (the plan sizes their scratch from it).
using proj::TermsChunkChannels;

// Flat k of column j of the chunk (j < n width <= K < 2^31, so 32-bit
// division).
__host__ __device__ __forceinline__ int64_t ChunkColumnK(const DevSpec& s,
                                                         ChannelChunk chunk,
                                                         int j) {
  if (s.minor || chunk.width == s.C) return chunk.begin * s.n + j;
  const int width = static_cast<int>(chunk.width);
  return static_cast<int64_t>(j / width) * s.C + chunk.begin + j % width;
}

// V consecutive terms of a row: 16-byte loads for whole fours (the caller
// keeps the row width and the first column multiples of 4 there).
template <int V>
__device__ __forceinline__ void LoadTerms(const float* p, float (&out)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int q = 0; q < V; q += 4) {
      const float4 f = *reinterpret_cast<const float4*>(p + q);
      out[q] = f.x, out[q + 1] = f.y, out[q + 2] = f.z, out[q + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) out[e] = p[e];
  }
}

// terms[m][j] = H_pre[m][i] dy[m][c] + sum_l R[m][i][l] dx_next[m][l][c]
// for column j = (i, c) of the chunk; dx_next and r may be null (no
// residual term).
cudaError_t LaunchDxTerms(const DevSpec& s, int64_t tokens, DType dtype,
                          ChannelChunk chunk, const float* h_pre,
                          const void* dy, const float* r, const void* dx_next,
                          float* terms, cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WIDE_TERMS_CUH_
