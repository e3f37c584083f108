// Projection backward of n = 4 layers (24 logits, stream-major, 16-bit
// activations, TF32) without the fused pre backward's terms, on warpgroup
// mmas whose dx accumulators are the output rows: dx = dh phi' + dms 2 v / K
// and the per-chunk partials of dphi = dh^T v, from one read of x.
//
// The mma.sync kernel (projection/backward/mma.cuh) runs this op with the
// L1 / shared-memory pipe three quarters busy: each of its eight warps reads
// the whole staged dh tile for both of its products. Here a CTA owns 32
// channels of every stream (128 columns of K) and one chunk of kTokenChunk
// tokens (in small batches a part of one, the plan's chunk_ctas: up to four
// CTAs per chunk whose dphi the last to finish adds, wgmma_tile.cuh),
// staged 64 tokens at a time through a cp.async ring; warpgroup wg owns
// columns 64 wg .. 64 wg + 63:
//   dx    [64 tokens x 64 cols] = dh [64 x 24] . phi' [24 x 64 cols]
//         wgmma.m64n64k8, dh token rows and phi'^T column rows (rounded to
//         tf32 once per CTA) both from shared memory;
//   dphi^T [64 cols x 24]      += x^T [64 x 64 tokens] . dh [64 tokens x 24]
//         wgmma.m64n24k8, x^T from ldmatrix.trans as A (16-bit x converts
//         to tf32 exactly), dh^T rows as B, accumulated over the chunk.
// Each thread's dx accumulators are column pairs of two tokens: it adds the
// dms term from the pair of x beside them and writes the rounded pair over
// it, and the tile's rows leave in 16-byte stores, so dh is read by each
// warpgroup once per product and dx crosses shared memory as 16-bit pairs.
// Two CTAs per SM overlap one's products with the other's epilogue.
//
// Numerics are the mma.sync kernel's under TF32: phi' and dh rounded to
// tf32 to nearest, x exact, fp32 accumulation over the logits in the same
// k steps of 8, then fmaf(dm, x, dx); dphi sums a chunk's tokens in the
// tensor cores' fp32 accumulators (split chunks: the CTAs' sums added
// in rank order). Determinism / batch invariance: a token's
// dx is the same products in a fixed order whatever M and the token's slot;
// dphi partials are per (chunk, logit, column), reduced over chunks in
// order by LaunchPhiGradReduce, or with one chunk added into the
// gradients by the kernel itself in the reduction's order. No atomics.
#include <cstdint>

#include "common.cuh"
#include "dispatch.cuh"
#include "primitives/kernel_fit.h"
#include "primitives/stage_pipeline.cuh"
#include "primitives/wgmma.cuh"
#include "projection/backward/dphi_wgmma.h"
#include "projection/backward/mma_tiles.cuh"
#include "projection/backward/ms_term.cuh"
#include "projection/backward/wgmma_n4.h"
#include "projection/backward/wgmma_n4_stage.cuh"
#include "projection/backward/wgmma_tile.cuh"
#include "projection/forward/mma.cuh"

namespace mhc::cuda {
namespace {

using namespace n4;  // NOLINT: the geometry both n = 4 kernels share

// One stage copied while the other is multiplied and stored: three stages
// (two in flight) measured slower at most benchmark configs
// (docs/decisions.md).
constexpr int kStages = 2;

// Byte offsets: the swizzled operands first, on atoms (the dynamic shared
// memory's start is aligned up to one in-kernel), then the ring.
struct Plan {
  static constexpr int kPhiT = 0;  // [128 cols][32 logits], rows of 128 B
  static constexpr int kDhx = kPhiT + kCols * 128;  // [64 tokens][32 logits]
  static constexpr int kDht = kDhx + kDhxBytes;
  static constexpr int kRing = kDht + kDhtBytes;
  // Inside one stage of the ring.
  static constexpr int kX = 0;
  static constexpr int kDh = kX + kStageTokens * kXStride * 2;
  static constexpr int kDms = kDh + kStageTokens * kDhStride * 4;
  static constexpr int kStageBytes = kDms + kStageTokens * 4;
  static_assert(kStageBytes % 16 == 0, "stages on 16 bytes");
  static_assert(kDht % kSwizzleAtomBytes == 0 &&
                    kDhtBlockBytes % kSwizzleAtomBytes == 0,
                "operand tiles on atoms");
  static constexpr int kSmem =
      kRing + kStages * kStageBytes + kSwizzleAtomBytes;
};

template <typename T, bool kGradsInKernel>
__global__ void __launch_bounds__(kThreads, 2)
    dx_rows_wgmma_kernel(DevSpec s, int64_t tokens, const T* __restrict__ x,
                         const float* __restrict__ phi,
                         const float* __restrict__ gamma,
                         const float* __restrict__ dh,
                         const float* __restrict__ dms, T* __restrict__ dx,
                         float* __restrict__ dphi_partial, ChunkSplit split,
                         DphiGrads grads) {
  WaitForPrerequisiteGrid();  // dh and dms
  using P = Plan;
  extern __shared__ __align__(16) char dx_rows_smem[];
  char* smem = AtomAligned(dx_rows_smem);
  float* phit = reinterpret_cast<float*>(smem + P::kPhiT);
  float* dhx = reinterpret_cast<float*>(smem + P::kDhx);
  float* dht = reinterpret_cast<float*>(smem + P::kDht);
  auto stage_at = [&](int buf, int offset) {
    return smem + P::kRing + buf * P::kStageBytes + offset;
  };
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int grp = lane >> 2;
  const int quad = lane & 3;
  const int wg = warp >> 2;
  const auto tile = ThisDxTile<kChans, kStageTokens>(s, tokens, split.ctas);
  const bool want_dphi = kGradsInKernel || dphi_partial != nullptr;

  // This thread's copies and stores, the same slots at every stage.
  const RowSlots x_rows(s, tile.c0, tile.chans, tid);
  auto load = [&](int st) {
    if (st >= tile.stages) return;
    const int buf = st % kStages;
    const int64_t m0 = tile.StageToken(st);
    const int rows = tile.StageRows(st);
    x_rows.CopyIn(reinterpret_cast<T*>(stage_at(buf, P::kX)), x, m0, rows, s.K);
    CopyStageDh(reinterpret_cast<float*>(stage_at(buf, P::kDh)),
                reinterpret_cast<float*>(stage_at(buf, P::kDms)), dh, dms, m0,
                rows, tid);
  };

  // phi'^T in tile column order.
  FillPhiT(phit, s, tile.c0, tile.chans, phi, gamma, tid,
           [](int j) { return j; });

  const uint64_t dhx_desc = SwizzledDescriptor(dhx);
  const uint64_t dht_desc = SwizzledDescriptor(dht);
  const uint64_t phit_desc = SwizzledDescriptor(phit + wg * 64 * 32);
  const float ms_scale = 2.0f / static_cast<float>(s.K);
  // dphi^T: this warp's 16 columns.
  const int col0 = 64 * wg + 16 * (warp & 3);
  float dphi[kLogits / 2];
  ZeroFill(dphi);
  float acc[32];

  // Each stage runs after a barrier by which it has landed for everyone and
  // everyone is done with stage st - 1 (its slot is being refilled) and its
  // dh operands.
  Pipeline<kStages>(tile.stages, load, [&](int st) {
    const int buf = st % kStages;
    const int64_t m0 = tile.StageToken(st);
    const int rows = tile.StageRows(st);
    T* xs = reinterpret_cast<T*>(stage_at(buf, P::kX));

    RoundStageDh(warp, lane,
                 reinterpret_cast<const float*>(stage_at(buf, P::kDh)), dhx,
                 dht);
    // The phi'^T tile (first stage) and the dh operands, to the wgmmas.
    FenceProxyAsyncShared();
    __syncthreads();
    StageProducts(acc, dphi, xs, lane, col0, want_dphi, dhx_desc, phit_desc,
                  dht_desc);

    // dx over x in the tile, once every warp's ldmatrix of it is done:
    // acc[4 j + 2 h + e] is token 16 (warp % 4) + grp + 8 h, column 64 wg +
    // 8 j + 2 quad + e, beside the pair of x it replaces.
    const float* dms_s = reinterpret_cast<const float*>(stage_at(buf, P::kDms));
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = 16 * (warp & 3) + grp + 8 * h;
      if (t >= rows) continue;
      MsTermOf(dms_s[t], ms_scale).With([&](auto add) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int col = 64 * wg + 8 * j + 2 * quad;
          if (col % kChans >= tile.chans) continue;
          T* pair = xs + t * kXStride + col;
          float v[2];
          LoadVec<T, 2>(pair, v);
          const float out[2] = {add(v[0], acc[4 * j + 2 * h]),
                                add(v[1], acc[4 * j + 2 * h + 1])};
          StoreVec<T, 2>(pair, out);
        }
      });
    }
    // The rows out in the slots x came in by, 16 bytes a thread.
    __syncthreads();
    x_rows.StoreOut(xs, dx, m0, rows, s.K);
  });
  if (!want_dphi) return;
  FinishChunkDphi<T, kGradsInKernel, kLogits, kChans>(
      dphi, s, tokens, tile, col0, lane, split, dphi_partial, grads);
}

}  // namespace

absl::Status LaunchRowsWgmmaDxAndPhiPartials(const DxArgs& a,
                                             const ProjectionBackwardPlan& plan,
                                             cudaStream_t stream) {
  static_assert(
      proj::kWgmmaVec == kVec && proj::kWgmmaN4StageTokens == kStageTokens,
      "the plan's geometry is the kernel's");
  const DevSpec s = MakeDevSpec(*a.spec);
  const dim3 grid(GridSize((s.C + kChans - 1) / kChans),
                  GridSize(NumChunks(a.tokens) * plan.chunk_ctas));
  ChunkSplit split;
  MHC_RETURN_IF_ERROR(ChunkSplitOf(a, plan, grid, &split));
  const size_t smem =
      ChunkSplitSmem(plan, static_cast<int64_t>(grid.x) * grid.y, Plan::kSmem);
  const float* gamma = s.has_gamma ? a.gamma : nullptr;
  cudaError_t err = cudaSuccess;
  const DphiGrads grads = DphiGradsOf(a, plan);
  auto go = [&](auto tt, auto in_kernel_tag) {
    using T = typename decltype(tt)::type;
    err = LaunchLargeSmem(
        dx_rows_wgmma_kernel<T, decltype(in_kernel_tag)::value>, grid, kThreads,
        smem, stream, s, a.tokens, static_cast<const T*>(a.x), a.phi, gamma,
        a.dh, a.dms, static_cast<T*>(a.dx), a.dphi_partial, split, grads);
  };
  DispatchBool(grads.InKernel(), [&](auto in_kernel_tag) {
    if (a.act_dtype == DType::kBF16) {
      go(TypeTag<__nv_bfloat16>{}, in_kernel_tag);
    } else {
      go(TypeTag<__half>{}, in_kernel_tag);
    }
  });
  MHC_CUDA_RETURN_IF_ERROR(err, "projection backward wgmma_n4",
                           LaunchShape(*a.spec, a.tokens, a.act_dtype));
  return absl::OkStatus();
}

}  // namespace mhc::cuda
