// What the two n = 4 warpgroup-mma dx / dphi kernels (wgmma_n4.cu, the
// projection backward alone, and wgmma_n4_terms.cu, with the fused pre
// backward's terms) share: the tile geometry (a CTA of two warpgroups owns
// 32 channels of every stream and stages 64 tokens at a time), the row
// copies in and out of a staged tile, and one stage's products.
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WGMMA_N4_STAGE_CUH_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WGMMA_N4_STAGE_CUH_

#include <cstdint>

#include "common.cuh"
#include "primitives/wgmma.cuh"
#include "projection/backward/dphi_wgmma.h"
#include "projection/backward/mma_tiles.cuh"
#include "projection/backward/wgmma_tile.cuh"
#include "projection/forward/mma.cuh"

namespace mhc::cuda::n4 {

inline constexpr int kStreams = 4;
inline constexpr int kLogits = 2 * kStreams + kStreams * kStreams;
inline constexpr int kChans = 32;  // channels per CTA, of every stream
inline constexpr int kCols = kChans * kStreams;
inline constexpr int kThreads = 256;  // two warpgroups
inline constexpr int kStageTokens = 64;
inline constexpr int kVec = 8;  // 16-bit elements per 16-byte copy
inline constexpr int kChanVecs = kChans / kVec;
static_assert(kTokenChunk % kStageTokens == 0, "stages tile a chunk");

// Staged row strides: eight consecutive tokens (the lanes of one
// shared-memory phase in the dh rounding, the x pairs of the epilogues, the
// ldmatrix rows) hit distinct banks.
inline constexpr int kXStride = kCols + 8;     // elements: 272 bytes
inline constexpr int kDhStride = kLogits + 4;  // floats: 112 bytes
// dh^T as dphi's B operand: one block of 24 logit rows per 32 tokens.
inline constexpr int kDhtBlockBytes = kLogits * 128;
// The operand tiles every stage rounds dh into, on atoms: dx's A ([64
// tokens][32 logits]) then dphi's B.
inline constexpr int kDhxBytes = kStageTokens * 128;
inline constexpr int kDhtBytes = (kStageTokens / 32) * kDhtBlockBytes;

// A thread's 16-byte slots of a staged [64 tokens x 128 columns] row tile,
// the same at every stage: tokens row + 16 i (i < 4), vector `vec` of the
// row (stream vec / 4, channels 8 (vec % 4) on).
struct RowSlots {
  int row;
  bool in;         // the vector's channels lie inside the tile
  int64_t column;  // its first element's offset in a global row
  int slot;        // and in the staged tile

  __device__ __forceinline__ RowSlots(const DevSpec& s, int64_t c0, int chans,
                                      int tid) {
    row = tid >> 4;
    const int vec = tid & 15;
    in = (vec % kChanVecs) * kVec < chans;
    column = (vec / kChanVecs) * s.C + c0 + (vec % kChanVecs) * kVec;
    slot = row * kXStride + vec * kVec;
  }

  // Copies tokens [m0, m0 + rows) of tensor src ([M, K]) into tile,
  // zero-filling past them and past the tile's channels.
  template <typename T>
  __device__ __forceinline__ void CopyIn(T* tile, const T* src, int64_t m0,
                                         int rows, int64_t K) const {
    const int64_t at = (m0 + row) * K + column;
#pragma unroll
    for (int i = 0; i < kStageTokens / 16; ++i) {
      const bool ok = in && row + 16 * i < rows;
      CpAsync<16>(tile + slot + 16 * i * kXStride,
                  ok ? src + at + 16 * i * K : src, ok);
    }
  }

  // Stores the tile's rows of tokens [m0, m0 + rows) to dst ([M, K]).
  template <typename T>
  __device__ __forceinline__ void StoreOut(const T* tile, T* dst, int64_t m0,
                                           int rows, int64_t K) const {
#pragma unroll
    for (int i = 0; i < kStageTokens / 16; ++i) {
      if (in && row + 16 * i < rows) {
        const uint4 w =
            *reinterpret_cast<const uint4*>(tile + slot + 16 * i * kXStride);
        // One 16-byte store (the compiler splits a uint4 assignment).
        asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(
                         dst + (m0 + row + 16 * i) * K + column),
                     "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w)
                     : "memory");
      }
    }
  }
};

// phi'^T rounded to tf32 once per CTA: tile column j (stream j / 32, channel
// j % 32; zeros past the tile's channels) into operand row row_of(j), the
// logits of this thread's half of the CTA.
template <typename RowOf>
__device__ __forceinline__ void FillPhiT(float* phit, const DevSpec& s,
                                         int64_t c0, int chans,
                                         const float* phi, const float* gamma,
                                         int tid, RowOf&& row_of) {
  const int j = tid & (kCols - 1);
  const int half = tid / kCols;
  const bool ok = j % kChans < chans;
  const int64_t k = (j / kChans) * s.C + c0 + j % kChans;
  const float gm = ok && gamma != nullptr ? gamma[k] : 1.0f;
  const int row = row_of(j);
#pragma unroll
  for (int i = 0; i < kLogits / 2; ++i) {
    const int g = half * (kLogits / 2) + i;
    phit[SwizzledRow(row, g)] = ok ? RoundTf32(phi[g * s.K + k] * gm) : 0.0f;
  }
}

// Copies tokens [m0, m0 + rows) of dh ([M, 24]) into dhs (rows of
// kDhStride floats) and of dms into dms_s, zeros past them: 16-byte chunk v =
// tid + 256 i (token v / 6, chunk v % 6) where v < 384; dms by the last 64
// threads.
__device__ __forceinline__ void CopyStageDh(float* dhs, float* dms_s,
                                            const float* dh, const float* dms,
                                            int64_t m0, int rows, int tid) {
  constexpr int kChunks = kStageTokens * kLogits / 4;
#pragma unroll
  for (int i = 0; i < (kChunks + kThreads - 1) / kThreads; ++i) {
    const int v = tid + i * kThreads;
    const int t = v / (kLogits / 4);
    const int c = v % (kLogits / 4);
    const bool ok = t < rows;
    if (v < kChunks) {
      CpAsync<16>(dhs + t * kDhStride + 4 * c,
                  ok ? dh + (m0 + t) * kLogits + 4 * c : dh, ok);
    }
  }
  const int dms_t = tid - (kThreads - kStageTokens);
  if (dms_t >= 0) {
    const bool ok = dms_t < rows;
    CpAsync<4>(dms_s + dms_t, ok ? dms + m0 + dms_t : dms, ok);
  }
}

// Rounds a stage's staged dh rows (stride kDhStride) to tf32 into dx's A
// (token rows, dhx) and dphi's B (logit rows of each 32 tokens at their
// WgmmaTokenPosition, dht): warp w < 6 takes logits 4 w .. 4 w + 3 of tokens
// lane and lane + 32.
__device__ __forceinline__ void RoundStageDh(int warp, int lane,
                                             const float* dhs, float* dhx,
                                             float* dht) {
  if (warp >= kLogits / 4) return;
  const int pos = static_cast<int>(WgmmaTokenPosition(lane));
#pragma unroll
  for (int u = 0; u < kStageTokens / 32; ++u) {
    const int t = lane + 32 * u;
    const float4 q =
        *reinterpret_cast<const float4*>(dhs + t * kDhStride + 4 * warp);
    StoreRoundedDh(q, t, warp, pos, reinterpret_cast<char*>(dhx),
                   dht + u * (kDhtBlockBytes / 4));
  }
}

// One stage's products for this warpgroup, once its dh operands are in
// place: acc = dh phi'^T over the 64 columns phit_desc names (m64n64k8) and,
// with want_dphi, dphi^T += x^T dh over the warp's 16 tile columns from col0
// (x^T from ldmatrix.trans of the staged tile xs). Returns once both are
// done, so the caller may overwrite xs and the dh operands.
template <typename T>
__device__ __forceinline__ void StageProducts(float (&acc)[32],
                                              float (&dphi)[kLogits / 2],
                                              const T* xs, int lane, int col0,
                                              bool want_dphi, uint64_t dhx_desc,
                                              uint64_t phit_desc,
                                              uint64_t dht_desc) {
  uint32_t xa[kStageTokens / 16][2][4];
  [[maybe_unused]] uint32_t unused_low[kStageTokens / 16][2][4];
  if (want_dphi) {
#pragma unroll
    for (int q = 0; q < kStageTokens / 16; ++q) {
      dx_mma::LoadXTransposed<false>(lane, xs, kXStride, q * 16, col0, xa[q],
                                     unused_low[q]);
    }
  }
  ZeroFill(acc);
  WgmmaFence();
#pragma unroll
  for (int kt = 0; kt < kLogits / 8; ++kt) {
    WgmmaTf32<64>(acc, DescriptorPlus(dhx_desc, kt * 32),
                  DescriptorPlus(phit_desc, kt * 32));
  }
  if (want_dphi) {
#pragma unroll
    for (int step = 0; step < kStageTokens / 8; ++step) {
      WgmmaTf32RegA<kLogits>(
          dphi, xa[step >> 1][step & 1],
          DescriptorPlus(dht_desc,
                         (step >> 2) * kDhtBlockBytes + (step & 3) * 32));
    }
  }
  WgmmaCommit();
  WgmmaWait<0>();
}

}  // namespace mhc::cuda::n4

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WGMMA_N4_STAGE_CUH_
