// Projection backward of n = 4 layers (24 logits, stream-major, 16-bit
// activations, TF32) without the fused pre backward's terms, on warpgroup
// mmas whose dx accumulators are the output rows: dx = dh phi' + dms 2 v / K
// and the per-chunk partials of dphi = dh^T v, from one read of x.
//
// The mma.sync kernel (projection/backward/mma.cuh) runs this op with the
// L1 / shared-memory pipe three quarters busy: each of its eight warps reads
// the whole staged dh tile for both of its products. Here a CTA owns 32
// channels of every stream (128 columns of K) and one chunk of kTokenChunk
// tokens, staged 64 tokens at a time through a cp.async ring; warpgroup wg
// owns columns 64 wg .. 64 wg + 63:
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
// tensor cores' fp32 accumulators. Determinism / batch invariance: a token's
// dx is the same products in a fixed order whatever M and the token's slot;
// dphi partials are per (chunk, logit, column), reduced over chunks in
// order by LaunchPhiGradReduce. No atomics.
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
#include "projection/backward/wgmma_tile.cuh"
#include "projection/forward/mma.cuh"

namespace mhc::cuda {
namespace {

using dx_mma::LoadXTransposed;

constexpr int kStreams = 4;
constexpr int kLogits = 2 * kStreams + kStreams * kStreams;
constexpr int kChans = 32;  // channels per CTA, of every stream
constexpr int kCols = kChans * kStreams;
constexpr int kThreads = 256;  // two warpgroups
constexpr int kStageTokens = 64;
// One stage copied while the other is multiplied and stored: three stages
// (two in flight) measured slower at most benchmark configs
// (docs/decisions.md).
constexpr int kStages = 2;
constexpr int kVec = 8;  // 16-bit elements per 16-byte copy
constexpr int kChanVecs = kChans / kVec;
static_assert(kTokenChunk % kStageTokens == 0, "stages tile a chunk");

// Staged row strides: eight consecutive tokens (the lanes of one
// shared-memory phase in the dh rounding, the x pairs of the epilogue, the
// ldmatrix rows) hit distinct banks.
constexpr int kXStride = kCols + 8;     // elements: 272 bytes
constexpr int kDhStride = kLogits + 4;  // floats: 112 bytes
// dh^T as dphi's B operand: one block of 24 logit rows per 32 tokens.
constexpr int kDhtBlockBytes = kLogits * 128;

// Byte offsets: the swizzled operands first, on atoms (the dynamic shared
// memory's start is aligned up to one in-kernel), then the ring.
struct Plan {
  static constexpr int kPhiT = 0;  // [128 cols][32 logits], rows of 128 B
  static constexpr int kDhx = kPhiT + kCols * 128;  // [64 tokens][32 logits]
  static constexpr int kDht = kDhx + kStageTokens * 128;
  static constexpr int kRing = kDht + (kStageTokens / 32) * kDhtBlockBytes;
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

template <typename T>
__global__ void __launch_bounds__(kThreads, 2)
    dx_rows_wgmma_kernel(DevSpec s, int64_t tokens, const T* __restrict__ x,
                         const float* __restrict__ phi,
                         const float* __restrict__ gamma,
                         const float* __restrict__ dh,
                         const float* __restrict__ dms, T* __restrict__ dx,
                         float* __restrict__ dphi_partial) {
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
  const auto tile = ThisDxTile<kChans, kStageTokens>(s, tokens);
  const bool want_dphi = dphi_partial != nullptr;

  // This thread's copies, the same slots at every stage. x: tokens xt + 16 i
  // (i < 4), 16-byte vector xv of the row (stream xv / 4, channels
  // 8 (xv % 4) on). dh: 16-byte chunk v = tid + kThreads i of the stage's
  // rows (token v / 6, chunk v % 6) where v < 384. dms: the last 64 threads.
  const int xt = tid >> 4;
  const int xv = tid & 15;
  const bool x_in = (xv % kChanVecs) * kVec < tile.chans;
  const int64_t x_col =
      (xv / kChanVecs) * s.C + tile.c0 + (xv % kChanVecs) * kVec;
  const int x_slot = xt * kXStride + xv * kVec;
  constexpr int kDhChunks = kStageTokens * kLogits / 4;
  constexpr int kDhCopies = (kDhChunks + kThreads - 1) / kThreads;
  const int dms_t = tid - (kThreads - kStageTokens);
  auto load = [&](int st) {
    if (st >= tile.stages) return;
    const int buf = st % kStages;
    const int64_t m0 = tile.StageToken(st);
    const int rows = tile.StageRows(st);
    T* xs = reinterpret_cast<T*>(stage_at(buf, P::kX));
    const int64_t x_at = (m0 + xt) * s.K + x_col;
#pragma unroll
    for (int i = 0; i < kStageTokens / 16; ++i) {
      const bool ok = x_in && xt + 16 * i < rows;
      CpAsync<16>(xs + x_slot + 16 * i * kXStride,
                  ok ? x + x_at + 16 * i * s.K : x, ok);
    }
    float* dhs = reinterpret_cast<float*>(stage_at(buf, P::kDh));
#pragma unroll
    for (int i = 0; i < kDhCopies; ++i) {
      const int v = tid + i * kThreads;
      const int t = v / (kLogits / 4);
      const int c = v % (kLogits / 4);
      const bool ok = t < rows;
      if (v < kDhChunks) {
        CpAsync<16>(dhs + t * kDhStride + 4 * c,
                    ok ? dh + (m0 + t) * kLogits + 4 * c : dh, ok);
      }
    }
    if (dms_t >= 0) {
      const bool ok = dms_t < rows;
      CpAsync<4>(reinterpret_cast<float*>(stage_at(buf, P::kDms)) + dms_t,
                 ok ? dms + m0 + dms_t : dms, ok);
    }
  };

  // phi'^T rounded to tf32 once: row j (column j of the tile: stream j / 32,
  // channel j % 32), logits of this thread's half.
  {
    const int j = tid & (kCols - 1);
    const int half = tid / kCols;
    const bool ok = j % kChans < tile.chans;
    const int64_t k = (j / kChans) * s.C + tile.c0 + j % kChans;
    const float gm = ok && gamma != nullptr ? gamma[k] : 1.0f;
#pragma unroll
    for (int i = 0; i < kLogits / 2; ++i) {
      const int g = half * (kLogits / 2) + i;
      phit[SwizzledRow(j, g)] = ok ? RoundTf32(phi[g * s.K + k] * gm) : 0.0f;
    }
  }

  const uint64_t dhx_desc = SwizzledDescriptor(dhx);
  const uint64_t dht_desc = SwizzledDescriptor(dht);
  const uint64_t phit_desc = SwizzledDescriptor(phit + wg * 64 * 32);
  const float ms_scale = 2.0f / static_cast<float>(s.K);
  // The dh rounding (warps 0-5): chunk `warp` of tokens lane and lane + 32.
  const int dh_pos = static_cast<int>(WgmmaTokenPosition(lane));
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

    // dh rounded to tf32 into dx's A (token rows) and dphi's B (logit rows
    // of each 32 tokens, at their WgmmaTokenPosition).
    if (warp < kLogits / 4) {
      const float* dhs = reinterpret_cast<const float*>(stage_at(buf, P::kDh));
#pragma unroll
      for (int u = 0; u < kStageTokens / 32; ++u) {
        const int t = lane + 32 * u;
        const float4 q =
            *reinterpret_cast<const float4*>(dhs + t * kDhStride + 4 * warp);
        StoreRoundedDh(q, t, warp, dh_pos, reinterpret_cast<char*>(dhx),
                       dht + u * (kDhtBlockBytes / 4));
      }
    }
    // The phi'^T tile (first stage) and the dh operands, to the wgmmas.
    FenceProxyAsyncShared();
    __syncthreads();

    uint32_t xa[kStageTokens / 16][2][4];
    [[maybe_unused]] uint32_t unused_low[kStageTokens / 16][2][4];
    if (want_dphi) {
#pragma unroll
      for (int q = 0; q < kStageTokens / 16; ++q) {
        LoadXTransposed<false>(lane, xs, kXStride, q * 16, col0, xa[q],
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
#pragma unroll
    for (int i = 0; i < kStageTokens / 16; ++i) {
      if (x_in && xt + 16 * i < rows) {
        const uint4 w =
            *reinterpret_cast<const uint4*>(xs + x_slot + 16 * i * kXStride);
        // One 16-byte store (the compiler splits a uint4 assignment).
        asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(
                         dx + (m0 + xt + 16 * i) * s.K + x_col),
                     "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w)
                     : "memory");
      }
    }
  });
  if (!want_dphi) return;
  StoreDphiPartial<kLogits, kChans>(dphi, s, tile, col0, lane,
                                    dphi_partial + blockIdx.y * s.N * s.K);
}

}  // namespace

absl::Status LaunchRowsWgmmaDxAndPhiPartials(const DxArgs& a,
                                             cudaStream_t stream) {
  static_assert(
      proj::kWgmmaVec == kVec && proj::kWgmmaN4StageTokens == kStageTokens,
      "the plan's geometry is the kernel's");
  const DevSpec s = MakeDevSpec(*a.spec);
  const dim3 grid(GridSize((s.C + kChans - 1) / kChans),
                  GridSize(NumChunks(a.tokens)));
  const float* gamma = s.has_gamma ? a.gamma : nullptr;
  cudaError_t err = cudaSuccess;
  auto go = [&](auto tt) {
    using T = typename decltype(tt)::type;
    err = LaunchLargeSmem(dx_rows_wgmma_kernel<T>, grid, kThreads, Plan::kSmem,
                          stream, s, a.tokens, static_cast<const T*>(a.x),
                          a.phi, gamma, a.dh, a.dms, static_cast<T*>(a.dx),
                          a.dphi_partial);
  };
  if (a.act_dtype == DType::kBF16) {
    go(TypeTag<__nv_bfloat16>{});
  } else {
    go(TypeTag<__half>{});
  }
  MHC_CUDA_RETURN_IF_ERROR(err, "projection backward wgmma_n4",
                           ShapeString(*a.spec, a.tokens, a.act_dtype));
  return absl::OkStatus();
}

}  // namespace mhc::cuda
