// The fused pre backward's dx of n = 4 layers (24 logits, stream-major,
// 16-bit activations, TF32) on warpgroup mmas: dx = dh phi' + dms 2 v / K +
// H_pre dy (+ the residual term sum_i R_si dx_next_i), and the per-chunk
// partials of dphi = dh^T v, from one read of x, dx_next and dy. The plan
// takes it while the mma.sync kernel would have fewer than two CTAs per SM
// (small batches), where that kernel's serial walk of each chunk (or of
// dphi and dx apart) is latency bound; above, the mma kernel is faster
// (docs/decisions.md).
//
// The geometry is wgmma_n4's (projection/backward/wgmma_n4.cu): a CTA owns
// 32 channels of every stream (128 columns of K) and one chunk of
// kTokenChunk tokens (or a part of one, as there), staged 64 tokens at a
// time, two CTAs per SM (where the chunks fill the GPU) so that one's
// products overlap the other's epilogue. Two changes make room for the terms:
//   - x, dh and dms go through a ring of two stages; the terms' tiles
//     (dx_next, dy, H_pre, R) have one buffer, refilled for the next stage
//     as soon as this stage's epilogue has read it, so they land while the
//     next stage's dh is rounded and multiplied;
//   - warpgroup wg's dx wgmma (m64n64k8) covers channels 16 wg .. 16 wg + 15
//     of all four streams (its phi'^T rows in (stream, channel) order), so a
//     thread's accumulators hold two channel pairs of every stream: it reads
//     each dx_next pair once for four outputs.
// dphi^T [64 cols x 24] += x^T [64 x 64 tokens] . dh [64 x 24] as in
// wgmma_n4, over the tile's natural columns. Each thread writes its dx pairs
// over the x pairs beside them in the staged tile; the rows leave in 16-byte
// stores.
//
// Numerics: the mma.sync kernel's dx bits (TF32: phi' and dh rounded to
// tf32 to nearest, x exact, fp32 accumulation over the logits in k steps of
// 8, then fmaf(dm, x, dx) and the terms summed in its order: H_pre dy first,
// then the R products in stream order), so the plan picks either by M and a
// token's dx stays batch invariant (the determinism tests run the two on
// the same tokens). dphi sums a chunk's tokens in the tensor cores' fp32
// accumulators, as wgmma_n4 does: deterministic, its bits this kernel's own.
// dphi partials are per (chunk, logit, column), reduced over chunks in
// order by LaunchPhiGradReduce, or with one chunk added into the
// gradients by the kernel itself in the reduction's order. No atomics.
#include <cstdint>

#include "common.cuh"
#include "dispatch.cuh"
#include "primitives/kernel_fit.h"
#include "projection/backward/ms_term.cuh"
#include "projection/backward/wgmma_n4_stage.cuh"
#include "projection/backward/wgmma_n4_terms.h"
#include "projection/backward/wgmma_tile.cuh"
#include "projection/forward/mma.cuh"

namespace mhc::cuda {
namespace {

using namespace n4;  // NOLINT: the geometry both n = 4 kernels share

constexpr int kGroupChans = kChans / 2;  // dx channels per warpgroup
constexpr int kStages = 2;
constexpr int kDyStride = kChans + 8;  // elements: 80 bytes (padded as x)

// Byte offsets: the swizzled operands first, on atoms (the dynamic shared
// memory's start is aligned up to one in-kernel), then the terms' tiles,
// then the ring.
struct Plan {
  static constexpr int kPhiT = 0;  // [128 rows][32 logits], rows of 128 B
  static constexpr int kDhx = kPhiT + kCols * 128;  // [64 tokens][32 logits]
  static constexpr int kDht = kDhx + kDhxBytes;
  static constexpr int kDxn = kDht + kDhtBytes;
  static constexpr int kDy = kDxn + kStageTokens * kXStride * 2;
  static constexpr int kR = kDy + kStageTokens * kDyStride * 2;
  static constexpr int kHp = kR + kStageTokens * kStreams * kStreams * 4;
  static constexpr int kRing = kHp + kStageTokens * kStreams * 4;
  // Inside one stage of the ring.
  static constexpr int kX = 0;
  static constexpr int kDh = kX + kStageTokens * kXStride * 2;
  static constexpr int kDms = kDh + kStageTokens * kDhStride * 4;
  static constexpr int kStageBytes = kDms + kStageTokens * 4;
  static_assert(kStageBytes % 16 == 0 && kDy % 16 == 0 && kR % 16 == 0 &&
                    kHp % 16 == 0 && kRing % 16 == 0 && kDh % 16 == 0,
                "16-byte copies");
  static_assert(kDht % kSwizzleAtomBytes == 0 &&
                    kDhtBlockBytes % kSwizzleAtomBytes == 0,
                "operand tiles on atoms");
  static constexpr int kSmem =
      kRing + kStages * kStageBytes + kSwizzleAtomBytes;
};

// Operand row of tile column j (stream j / 32, channel j % 32) in phi'^T:
// warpgroup c / 16's 64 rows hold 8-channel blocks stream by stream, so its
// accumulator block b is stream b / 2, channels 16 wg + 8 (b % 2) on.
__device__ __forceinline__ int PhiRow(int j) {
  const int stream = j / kChans, chan = j % kChans;
  const int block = 2 * stream + (chan % kGroupChans) / 8;
  return (chan / kGroupChans) * 64 + block * 8 + chan % 8;
}

template <typename T, bool kResidual, bool kGradsInKernel>
__global__ void __launch_bounds__(kThreads, 2)
    dx_terms_wgmma_kernel(DevSpec s, int64_t tokens, const T* __restrict__ x,
                          const float* __restrict__ phi,
                          const float* __restrict__ gamma,
                          const float* __restrict__ dh,
                          const float* __restrict__ dms,
                          const float* __restrict__ h_pre,
                          const T* __restrict__ dy, const float* __restrict__ r,
                          const T* __restrict__ dx_next, T* __restrict__ dx,
                          float* __restrict__ dphi_partial, ChunkSplit split,
                          DphiGrads grads, bool dependents_beside) {
  using P = Plan;
  extern __shared__ __align__(16) char dx_terms_smem[];
  char* smem = AtomAligned(dx_terms_smem);
  float* phit = reinterpret_cast<float*>(smem + P::kPhiT);
  float* dhx = reinterpret_cast<float*>(smem + P::kDhx);
  float* dht = reinterpret_cast<float*>(smem + P::kDht);
  T* xns = reinterpret_cast<T*>(smem + P::kDxn);
  T* dys = reinterpret_cast<T*>(smem + P::kDy);
  float* rs = reinterpret_cast<float*>(smem + P::kR);
  float* hps = reinterpret_cast<float*>(smem + P::kHp);
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

  // This thread's copies and stores, the same slots at every stage. x and
  // dx_next: RowSlots; dh and dms: CopyStageDh; dy: token tid / 4, vector
  // tid % 4; R: token tid / 4, row tid % 4; H_pre: token tid (tid < 64).
  const RowSlots x_rows(s, tile.c0, tile.chans, tid);
  const int dy_t = tid >> 2;
  const int dy_v = tid & 3;
  const bool dy_in = dy_v * kVec < tile.chans;
  auto load_ring = [&](int st) {
    if (st >= tile.stages) return;
    const int buf = st % kStages;
    const int64_t m0 = tile.StageToken(st);
    const int rows = tile.StageRows(st);
    x_rows.CopyIn(reinterpret_cast<T*>(stage_at(buf, P::kX)), x, m0, rows, s.K);
    CopyStageDh(reinterpret_cast<float*>(stage_at(buf, P::kDh)),
                reinterpret_cast<float*>(stage_at(buf, P::kDms)), dh, dms, m0,
                rows, tid);
  };
  auto load_terms = [&](int st) {
    if (st >= tile.stages) return;
    const int64_t m0 = tile.StageToken(st);
    const int rows = tile.StageRows(st);
    if constexpr (kResidual) {
      x_rows.CopyIn(xns, dx_next, m0, rows, s.K);
      const bool r_ok = dy_t < rows;
      CpAsync<16>(rs + 4 * tid,
                  r_ok ? r + m0 * kStreams * kStreams + 4 * tid : r, r_ok);
    }
    const bool dy_ok = dy_in && dy_t < rows;
    CpAsync<16>(dys + dy_t * kDyStride + dy_v * kVec,
                dy_ok ? dy + (m0 + dy_t) * s.C + tile.c0 + dy_v * kVec : dy,
                dy_ok);
    if (tid < kStageTokens) {
      const bool ok = tid < rows;
      CpAsync<16>(hps + 4 * tid, ok ? h_pre + (m0 + tid) * kStreams : h_pre,
                  ok);
    }
  };

  // phi'^T with each warpgroup's rows in its accumulators' column order.
  FillPhiT(phit, s, tile.c0, tile.chans, phi, gamma, tid, PhiRow);
  // Only now: phi and gamma are weights no kernel of the pre backward
  // writes, so the tile fills while the backward mixing kernel, which lets
  // this kernel launch early, still runs. What follows reads its outputs
  // (dh, dms, H_pre, R).
  WaitForPrerequisiteGrid();
  // The column sums that may follow read only the mixing kernel's rows.
  if (dependents_beside) AllowDependentLaunch();

  const uint64_t dhx_desc = SwizzledDescriptor(dhx);
  const uint64_t dht_desc = SwizzledDescriptor(dht);
  const uint64_t phit_desc = SwizzledDescriptor(phit + wg * 64 * 32);
  const float ms_scale = 2.0f / static_cast<float>(s.K);
  // dphi^T: this warp's 16 columns of the tile.
  const int col0 = 64 * wg + 16 * (warp & 3);
  // dx: this thread's channel pairs chan and chan + 8 of every stream.
  const int chan = kGroupChans * wg + 2 * quad;
  float dphi[kLogits / 2];
  ZeroFill(dphi);
  float acc[32];

  // Groups in commit order: ring(0), terms(0), then per stage st the ring of
  // st + 1 and, once st's epilogue has read them, the terms of st + 1. So
  // at the top of stage st one group (its terms) may stay in flight, and
  // before its epilogue one (the next ring).
  load_ring(0);
  CpAsyncCommit();
  load_terms(0);
  CpAsyncCommit();
  for (int st = 0; st < tile.stages; ++st) {
    const int buf = st % kStages;
    const int64_t m0 = tile.StageToken(st);
    const int rows = tile.StageRows(st);
    T* xs = reinterpret_cast<T*>(stage_at(buf, P::kX));
    CpAsyncWait<1>();
    // Stage st has landed for everyone, and everyone is done with stage
    // st - 1's slot (refilled now) and its dh operands.
    __syncthreads();
    load_ring(st + 1);
    CpAsyncCommit();

    RoundStageDh(warp, lane,
                 reinterpret_cast<const float*>(stage_at(buf, P::kDh)), dhx,
                 dht);
    // The phi'^T tile (first stage) and the dh operands, to the wgmmas.
    FenceProxyAsyncShared();
    __syncthreads();
    StageProducts(acc, dphi, xs, lane, col0, want_dphi, dhx_desc, phit_desc,
                  dht_desc);

    // This stage's terms have landed for everyone, and every warp's
    // ldmatrix of x is done: dx over x in the tile. acc[4 b + 2 h + e] is
    // token 16 (warp % 4) + grp + 8 h, stream b / 2, channel chan + 8 (b %
    // 2) + e. Branch free: rows past the stage's tokens and columns past the
    // tile hold zeros; only the global stores skip them.
    const float* dms_s = reinterpret_cast<const float*>(stage_at(buf, P::kDms));
    CpAsyncWait<1>();
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = 16 * (warp & 3) + grp + 8 * h;
      const MsTerm dm = MsTermOf(dms_s[t], ms_scale);
      const float4 hp = *reinterpret_cast<const float4*>(hps + 4 * t);
      const float hpv[kStreams] = {hp.x, hp.y, hp.z, hp.w};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int c = chan + 8 * half;
        float g[2];
        LoadVec<T, 2>(dys + t * kDyStride + c, g);
        [[maybe_unused]] float next[kStreams][2];
        if constexpr (kResidual) {
#pragma unroll
          for (int i = 0; i < kStreams; ++i) {
            LoadVec<T, 2>(xns + t * kXStride + kChans * i + c, next[i]);
          }
        }
#pragma unroll
        for (int j = 0; j < kStreams; ++j) {
          float term[2] = {hpv[j] * g[0], hpv[j] * g[1]};
          if constexpr (kResidual) {
            const float4 rv4 =
                *reinterpret_cast<const float4*>(rs + (4 * t + j) * 4);
            const float rv[kStreams] = {rv4.x, rv4.y, rv4.z, rv4.w};
#pragma unroll
            for (int i = 0; i < kStreams; ++i) {
              term[0] = fmaf(rv[i], next[i][0], term[0]);
              term[1] = fmaf(rv[i], next[i][1], term[1]);
            }
          }
          const int b = 2 * j + half;
          T* pair = xs + t * kXStride + kChans * j + c;
          float v[2];
          LoadVec<T, 2>(pair, v);
          const float out[2] = {dm.Add(v[0], acc[4 * b + 2 * h]) + term[0],
                                dm.Add(v[1], acc[4 * b + 2 * h + 1]) + term[1]};
          StoreVec<T, 2>(pair, out);
        }
      }
    }
    // The terms' tiles are free: the next stage's go in now.
    __syncthreads();
    load_terms(st + 1);
    CpAsyncCommit();
    // The rows out in the slots x came in by, 16 bytes a thread.
    x_rows.StoreOut(xs, dx, m0, rows, s.K);
  }
  CpAsyncWait<0>();
  if (!want_dphi) return;
  FinishChunkDphi<T, kGradsInKernel, kLogits, kChans>(
      dphi, s, tokens, tile, col0, lane, split, dphi_partial, grads);
}

}  // namespace

absl::Status LaunchTermsWgmmaDxAndPhiPartials(
    const DxArgs& a, const ProjectionBackwardPlan& plan, cudaStream_t stream) {
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
  auto go = [&](auto tt, auto residual_tag, auto in_kernel_tag) {
    using T = typename decltype(tt)::type;
    err = LaunchLargeSmem(
        dx_terms_wgmma_kernel<T, decltype(residual_tag)::value,
                              decltype(in_kernel_tag)::value>,
        grid, kThreads, smem, stream, s, a.tokens, static_cast<const T*>(a.x),
        a.phi, gamma, a.dh, a.dms, a.h_pre, static_cast<const T*>(a.dy), a.r,
        static_cast<const T*>(a.dx_next), static_cast<T*>(a.dx), a.dphi_partial,
        split, grads, a.dependents_beside);
  };
  DispatchBool(a.r != nullptr, [&](auto residual_tag) {
    DispatchBool(grads.InKernel(), [&](auto in_kernel_tag) {
      if (a.act_dtype == DType::kBF16) {
        go(TypeTag<__nv_bfloat16>{}, residual_tag, in_kernel_tag);
      } else {
        go(TypeTag<__half>{}, residual_tag, in_kernel_tag);
      }
    });
  });
  MHC_CUDA_RETURN_IF_ERROR(err, "projection backward wgmma_n4_terms",
                           LaunchShape(*a.spec, a.tokens, a.act_dtype));
  return absl::OkStatus();
}

}  // namespace mhc::cuda
