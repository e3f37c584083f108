// What the two dphi kernels of wide layers (projection/backward/wide.cu's
// mma.sync one and projection/backward/dphi_wgmma.cu) share: a CTA's share of
// the logits, columns and tokens, and the 16-byte staging of its x rows.
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_DPHI_TILE_CUH_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_DPHI_TILE_CUH_

#include <cstdint>

#include "common.cuh"
#include "projection/forward/mma.cuh"

namespace mhc::cuda {

// blockIdx: x the logit tile, y the column tile, z the token chunk (of
// chunk_tokens, PhiChunkTokens: a multiple of kTokenChunk).
struct PhiTile {
  int g0;         // first logit
  int64_t k0;     // first column of K
  int64_t begin;  // first token of the chunk
  int chunk_tokens, stages, cols, logits;
};
template <int kLogits, int kCols, int kStageTokens>
__device__ __forceinline__ PhiTile PhiTileOf(const DevSpec& s, int64_t tokens,
                                             int chunk_tokens) {
  PhiTile t;
  t.g0 = static_cast<int>(blockIdx.x) * kLogits;
  t.k0 = static_cast<int64_t>(blockIdx.y) * kCols;
  t.begin = static_cast<int64_t>(blockIdx.z) * chunk_tokens;
  t.chunk_tokens = static_cast<int>(
      min(static_cast<int64_t>(chunk_tokens), tokens - t.begin));
  t.stages = (t.chunk_tokens + kStageTokens - 1) / kStageTokens;
  t.cols = static_cast<int>(min(static_cast<int64_t>(kCols), s.K - t.k0));
  t.logits = min(kLogits, s.N - t.g0);
  return t;
}

// Stage st's x rows (kStageTokens tokens x kCols columns, xs rows of XS
// elements) by 16-byte cp.async from rows on 16 bytes; tokens past the chunk
// and columns past K land as zeros.
template <typename T, int kCols, int kStageTokens, int kThreads>
__device__ __forceinline__ void StageXVectors(const DevSpec& s, const T* x,
                                              const PhiTile& tile, int st,
                                              T* xs, int XS) {
  constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));
  constexpr int kPerRow = kCols / kVecElems;
  const int64_t m0 = tile.begin + static_cast<int64_t>(st) * kStageTokens;
  const int rows = min(kStageTokens, tile.chunk_tokens - st * kStageTokens);
#pragma unroll
  for (int v = threadIdx.x; v < kStageTokens * kPerRow; v += kThreads) {
    const int t = v / kPerRow;
    const int j = v % kPerRow * kVecElems;
    const bool ok = t < rows && j < tile.cols;
    CpAsync<16>(xs + t * XS + j, ok ? x + (m0 + t) * s.K + tile.k0 + j : x, ok);
  }
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_DPHI_TILE_CUH_
