// What the warpgroup-mma dx / dphi kernels (projection/backward/wgmma_n8.cu,
// projection/backward/wgmma_n4*.cu) share: a CTA's tile (kChans channels of
// every stream, one token chunk or, split over several CTAs, a run of its
// stages), the per-stage rounding of dh into both operand layouts, and the
// dphi^T accumulators into the chunk's partial rows or, for a launch of one
// chunk, straight into the phi / gamma gradients.
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WGMMA_TILE_CUH_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WGMMA_TILE_CUH_

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common.cuh"
#include "dispatch.cuh"
#include "launch.h"
#include "overflow_repair.cuh"
#include "primitives/grid_arrival.cuh"
#include "primitives/wgmma.cuh"
#include "projection/backward/dphi_grads.cuh"
#include "projection/forward/mma.cuh"
#include "projection/geometry.h"
#include "projection/plan.h"

namespace mhc::cuda {

// Channels [c0, c0 + chans) of every stream (chans < kChans past the last
// full tile) and tokens [begin, begin + chunk_tokens) of token chunk
// `chunk`, in stages of kStageTokens tokens.
template <int kStageTokens>
struct DxTile {
  int64_t c0;
  int chans;
  int64_t chunk;
  int64_t begin;
  int chunk_tokens;
  int stages;

  __device__ __forceinline__ int64_t StageToken(int st) const {
    return begin + static_cast<int64_t>(st) * kStageTokens;
  }
  __device__ __forceinline__ int StageRows(int st) const {
    return min(kStageTokens, chunk_tokens - st * kStageTokens);
  }
};

// How a launch splits its token chunks: ctas CTAs per chunk and, where they
// sum dphi, each CTA's accumulators at partials ([group][rank][kLogits / 2]
// [threads], group = chunk x gridDim.x + channel tile) and one arrival
// counter per group, 0 between launches (its last CTA resets it).
struct ChunkSplit {
  int ctas = 1;
  float* partials = nullptr;
  unsigned* arrivals = nullptr;
};

// The split of a launch of `grid` CTAs by `plan`, with the scratch and
// counters of `a` where its CTAs sum dphi.
inline absl::Status ChunkSplitOf(const DxArgs& a,
                                 const ProjectionBackwardPlan& plan, dim3 grid,
                                 ChunkSplit* split) {
  split->ctas = plan.chunk_ctas;
  const bool want_dphi =
      a.dphi_partial != nullptr || DphiGradsOf(a, plan).InKernel();
  if (plan.chunk_ctas == 1 || !want_dphi) return absl::OkStatus();
  const int64_t groups =
      static_cast<int64_t>(grid.x) * grid.y / plan.chunk_ctas;
  if (a.split_partials == nullptr || a.split_arrivals == nullptr ||
      groups > proj::kSplitArrivals) {
    return absl::InternalError(
        absl::StrCat("projection backward ",
                     ShapeText(LaunchShape(*a.spec, a.tokens, a.act_dtype)),
                     ": a split chunk's dphi needs its scratch and one "
                     "counter per chunk and tile"));
  }
  split->partials = a.split_partials;
  split->arrivals = a.split_arrivals;
  return absl::OkStatus();
}

// The dynamic shared memory of a chunk-split launch of `ctas` CTAs: the
// kernel's own or, where they all fit one per SM, enough that no SM holds a
// second.
inline size_t ChunkSplitSmem(const ProjectionBackwardPlan& plan, int64_t ctas,
                             size_t kernel_smem) {
  return plan.chunk_ctas > 1 && ctas <= proj::kTunedSms
             ? std::max(kernel_smem, size_t{proj::kOneCtaPerSmSmem})
             : kernel_smem;
}

// This CTA's tile. With chunk_ctas > 1 the grid's y is chunk_ctas CTAs per
// chunk: rank q of a chunk takes the q-th run of ceil(stages / chunk_ctas)
// consecutive stages (possibly none), so the ranks hold the chunk's tokens
// in rank order.
template <int kChans, int kStageTokens>
__device__ __forceinline__ DxTile<kStageTokens> ThisDxTile(const DevSpec& s,
                                                           int64_t tokens,
                                                           int chunk_ctas) {
  DxTile<kStageTokens> t;
  t.c0 = static_cast<int64_t>(blockIdx.x) * kChans;
  t.chans = static_cast<int>(min(static_cast<int64_t>(kChans), s.C - t.c0));
  t.chunk = blockIdx.y / chunk_ctas;
  const int rank = static_cast<int>(blockIdx.y % chunk_ctas);
  const int64_t chunk_begin = t.chunk * kTokenChunk;
  const int whole = static_cast<int>(
      min(tokens - chunk_begin, static_cast<int64_t>(kTokenChunk)));
  const int run =
      (whole + kStageTokens * chunk_ctas - 1) / (kStageTokens * chunk_ctas);
  const int first = min(whole, rank * run * kStageTokens);
  t.begin = chunk_begin + first;
  t.chunk_tokens = min(whole - first, run * kStageTokens);
  t.stages = (t.chunk_tokens + kStageTokens - 1) / kStageTokens;
  return t;
}

// Logits 4 c .. 4 c + 3 (of a 32-logit block) of token t's dh, q, rounded to
// tf32 into both operand layouts: chunk c of the token's 128-byte swizzled
// row t at token_rows (dx's operand), and element pos (the token's
// WgmmaTokenPosition in its 32-token block) of logit rows 4 c .. 4 c + 3 at
// logit_rows (dphi's B).
__device__ __forceinline__ void StoreRoundedDh(float4 q, int t, int c, int pos,
                                               char* token_rows,
                                               float* logit_rows) {
  const float r[4] = {RoundTf32(q.x), RoundTf32(q.y), RoundTf32(q.z),
                      RoundTf32(q.w)};
  *reinterpret_cast<float4*>(token_rows + SwizzledChunkAt(t, c)) =
      make_float4(r[0], r[1], r[2], r[3]);
#pragma unroll
  for (int e = 0; e < 4; ++e) logit_rows[SwizzledRow(4 * c + e, pos)] = r[e];
}

// A warp's dphi^T accumulators of m64nNk8 wgmmas over its 16 columns of the
// tile from col0 (column j: stream j / kChans, channel j % kChans): dphi[i]
// is column col0 + grp + 8 ((i / 2) % 2), logit 8 (i / 4) + 2 quad + i % 2.
// partial: the chunk's [N][K] rows.
template <int kLogits, int kChans, int kStageTokens>
__device__ __forceinline__ void StoreDphiPartial(
    const float (&dphi)[kLogits / 2], const DevSpec& s,
    const DxTile<kStageTokens>& tile, int col0, int lane, float* partial) {
  const int grp = lane >> 2, quad = lane & 3;
#pragma unroll
  for (int i = 0; i < kLogits / 2; ++i) {
    const int j = col0 + grp + 8 * ((i >> 1) & 1);
    const int g = 8 * (i >> 2) + 2 * quad + (i & 1);
    if (j % kChans < tile.chans) {
      partial[g * s.K + (j / kChans) * s.C + tile.c0 + j % kChans] = dphi[i];
    }
  }
}

// What AddDphiToGrads reads besides dphi: this thread's columns' phi, phi
// gradient and gamma values and their gamma gradients, loaded apart so
// that a split chunk's last CTA has them before its exchange ends.
template <int kLogits>
struct DphiGradOperands {
  int64_t k[2];
  bool in[2];
  float gamma_k[2];
  float dgamma[2];
  float phi[kLogits / 2];
  float grad[kLogits / 2];
};

template <int kLogits, int kChans, int kStageTokens>
__device__ __forceinline__ DphiGradOperands<kLogits> LoadDphiGradOperands(
    const DevSpec& s, const DxTile<kStageTokens>& tile, int col0, int lane,
    const DphiGrads& grads) {
  const int grp = lane >> 2, quad = lane & 3;
  DphiGradOperands<kLogits> o;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int j = col0 + grp + 8 * h;
    o.in[h] = j % kChans < tile.chans;
    o.k[h] = o.in[h] ? (j / kChans) * s.C + tile.c0 + j % kChans : 0;
    o.gamma_k[h] =
        o.in[h] && grads.gamma != nullptr ? grads.gamma[o.k[h]] : 1.0f;
    o.dgamma[h] = o.in[h] && quad == 0 && grads.grads_gamma != nullptr
                      ? grads.grads_gamma[o.k[h]]
                      : 0.0f;
  }
#pragma unroll
  for (int i = 0; i < kLogits / 2; ++i) {
    const int h = (i >> 1) & 1;
    const int64_t at = (8 * (i >> 2) + 2 * quad + (i & 1)) * s.K + o.k[h];
    o.phi[i] = o.in[h] ? grads.phi[at] : 0.0f;
    o.grad[i] =
        o.in[h] && grads.grads_phi != nullptr ? grads.grads_phi[at] : 0.0f;
  }
  return o;
}

// Adds this CTA's dphi^T accumulators (StoreDphiPartial's layout), the
// whole of a one-chunk launch, into the gradients as PhiGradAfter and the
// reduction's dgamma order (dphi_grads.cuh) say: lane quad holds rows
// 2 quad and 2 quad + 1 of each of its two columns, every g of them in
// order, so the column's row sums come together by shuffles. Every lane of
// the warp calls it, with the operands LoadDphiGradOperands read.
template <int kLogits>
__device__ __forceinline__ void AddDphiToGrads(
    const float (&dphi)[kLogits / 2], const DphiGradOperands<kLogits>& o,
    const DevSpec& s, int lane, const DphiGrads& grads) {
  static_assert(kPhiGradRows == 8, "a quad's lanes hold two rows each");
  const int quad = lane & 3;
  float row_sum[2][2] = {};  // [column h][row 2 quad + b]
#pragma unroll
  for (int i = 0; i < kLogits / 2; ++i) {
    const int h = (i >> 1) & 1, b = i & 1;
    const float sum = 0.0f + dphi[i];  // the reduction's sum of one chunk
    if (o.in[h] && grads.grads_phi != nullptr) {
      grads.grads_phi[(8 * (i >> 2) + 2 * quad + b) * s.K + o.k[h]] =
          PhiGradAfter(o.grad[i], sum, o.gamma_k[h]);
    }
    row_sum[h][b] = fmaf(sum, o.phi[i], row_sum[h][b]);
  }
  if (grads.grads_gamma == nullptr) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float total = 0.0f;
#pragma unroll
    for (int r = 0; r < kPhiGradRows; ++r) {
      total +=
          __shfl_sync(0xffffffffu, row_sum[h][r & 1], (lane & ~3) | (r >> 1));
    }
    if (quad == 0 && o.in[h]) grads.grads_gamma[o.k[h]] = o.dgamma[h] + total;
  }
}

// The overflow repair's pass (RepairColumn) over this thread's columns, once
// the chunk's dx stores and this warp's gradient stores are visible.
template <typename T, int kChans, int kStageTokens>
__device__ __forceinline__ void RepairDxColumns(
    const DevSpec& s, int64_t tokens, const DxTile<kStageTokens>& tile,
    int col0, int lane, const RepairBackwardArgs& repair) {
  if ((lane & 3) != 0) return;
#pragma unroll 1
  for (int h = 0; h < 2; ++h) {
    const int j = col0 + (lane >> 2) + 8 * h;
    if (j % kChans >= tile.chans) continue;
    RepairColumn<T>(s, tokens, (j / kChans) * s.C + tile.c0 + j % kChans,
                    repair);
  }
}

// The chunk's dphi when split.ctas CTAs split it: each leaves its
// accumulators in split.partials and counts itself in; the last to arrive
// adds every rank's in rank order, which is the chunk's stage order. That CTA
// (or the chunk's one CTA) then stores the sum into the chunk's partial rows
// (partial: [chunks][N][K]) or, with grads.InKernel() (a one-chunk launch),
// adds it into the gradients and runs the repair pass. Every thread of the
// CTA calls it. kInKernel: the launch's grads.InKernel(), compiled in so
// that the partials' kernels keep their code.
template <typename T, bool kInKernel, int kLogits, int kChans, int kStageTokens>
__device__ __forceinline__ void FinishChunkDphi(
    float (&dphi)[kLogits / 2], const DevSpec& s, int64_t tokens,
    const DxTile<kStageTokens>& tile, int col0, int lane,
    const ChunkSplit& split, float* partial, const DphiGrads& grads) {
  constexpr int kCount = kLogits / 2;
  // Loaded first, so that their latency hides under the split's exchange.
  [[maybe_unused]] int repaired = 0;
  [[maybe_unused]] DphiGradOperands<kLogits> operands;
  if constexpr (kInKernel) {
    if (grads.repair.count != nullptr) repaired = *grads.repair.count;
    operands =
        LoadDphiGradOperands<kLogits, kChans>(s, tile, col0, lane, grads);
  }
  if (split.ctas > 1) {
    const int slot = threadIdx.x, threads = blockDim.x;
    const int rank = static_cast<int>(blockIdx.y) % split.ctas;
    const unsigned group = blockIdx.y / split.ctas * gridDim.x + blockIdx.x;
    const float* ranks = split.partials + static_cast<size_t>(group) *
                                              split.ctas * kCount * threads;
    float* mine =
        split.partials +
        (static_cast<size_t>(group) * split.ctas + rank) * kCount * threads;
#pragma unroll
    for (int i = 0; i < kCount; ++i) __stcg(mine + i * threads + slot, dphi[i]);
    // Also: the other ranks' dx stores are visible to the last after it.
    if (!LastOfCtasToArrive(split.arrivals + group, split.ctas)) return;
    float v[proj::kMaxChunkCtas][kCount];
#pragma unroll
    for (int q = 0; q < proj::kMaxChunkCtas; ++q) {
#pragma unroll
      for (int i = 0; i < kCount; ++i) {
        v[q][i] = q < split.ctas
                      ? __ldcg(ranks + (q * kCount + i) * threads + slot)
                      : 0.0f;
      }
    }
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      dphi[i] = v[0][i];
#pragma unroll
      for (int q = 1; q < proj::kMaxChunkCtas; ++q) {
        if (q < split.ctas) dphi[i] += v[q][i];
      }
    }
    ResetArrivals(split.arrivals + group);
  }
  if constexpr (!kInKernel) {
    StoreDphiPartial<kLogits, kChans>(dphi, s, tile, col0, lane,
                                      partial + tile.chunk * s.N * s.K);
  } else {
    AddDphiToGrads<kLogits>(dphi, operands, s, lane, grads);
    if (repaired == 0) return;
    __syncthreads();  // this CTA's dx and gradient stores
    RepairDxColumns<T, kChans>(s, tokens, tile, col0, lane, grads.repair);
  }
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WGMMA_TILE_CUH_
