// dphi^T partials of wide layers on warpgroup mmas
// (projection/backward/dphi_wgmma.h).
//
// A CTA owns kCols columns of K x kW logits of one token chunk, walked in
// stages of kStageTokens tokens through a cp.async pipeline; warpgroup wg
// owns the columns 64 wg .. 64 wg + 63 and issues one
// wgmma.m64n{kW}k8.f32.tf32.tf32 per 8 tokens. B, the rounded dh^T rows of
// the tile's logits, lands in the 128-byte swizzle the tensor cores read (a
// stage's 32 tokens are one 128-byte row per logit). A, x^T, comes from
// registers: each warp loads its 16 columns' fragments from the staged x rows
// with ldmatrix.trans (16-bit x, converted exactly) or rounds fp32 x, which
// puts tokens 2 u and 2 u + 1 in k slots u and u + 4; the dh^T rows were
// written in that order (WgmmaTokenPosition), so the product is over the
// same tokens for every slot.
//
// Numerics are the mma.sync kernel's under TF32: x exact (fp32 x rounded to
// tf32), dh rounded to nearest once, fp32 accumulation over the chunk's
// tokens in the tensor cores. Determinism / batch invariance: partials per
// (chunk, logit, column), each a fixed sum over the chunk's tokens; no
// atomics.
#include <cstdint>

#include "dispatch.cuh"
#include "primitives/kernel_fit.h"
#include "primitives/wgmma.cuh"
#include "projection/backward/dphi_tile.cuh"
#include "projection/backward/dphi_wgmma.h"
#include "projection/backward/mma_tiles.cuh"
#include "projection/forward/mma.cuh"

namespace mhc::cuda {
namespace {

using dx_mma::LoadXTransposed;

constexpr int kThreads = 256;  // two warpgroups
constexpr int kCols = 128;     // 64 per warpgroup
constexpr int kStageTokens = 32;
static_assert(kTokenChunk % kStageTokens == 0, "stages tile a chunk");

template <typename T, int kW>
struct DphiPlan {
  static_assert(kW % 8 == 0, "B rows in whole swizzle atoms");
  // x rows: 16-bit strides of 16 mod 128 bytes (ldmatrix rows conflict
  // free), fp32 of 4 mod 32 words.
  static constexpr int kXStride = sizeof(T) == 4 ? kCols + 4 : kCols + 8;
  static constexpr int kStages = sizeof(T) == 4 ? 3 : 4;
  static constexpr int kDhBytes = kW * kStageTokens * 4;
  static constexpr int kXBytes = kStageTokens * kXStride * sizeof(T);
  static constexpr int kXAt = kStages * kDhBytes;
  // The dynamic shared memory's start is aligned up to an atom in-kernel.
  static constexpr int kSmem = kXAt + kStages * kXBytes + kSwizzleAtomBytes;
  static_assert(kDhBytes % kSwizzleAtomBytes == 0, "tiles stay on atoms");
};

template <typename T, int kW>
__global__ void __launch_bounds__(kThreads, 2)
    wgmma_dphi_kernel(DevSpec s, int64_t tokens, int chunk_tokens,
                      const T* __restrict__ x, const float* __restrict__ dh_t,
                      int64_t Mp, int Np, float* __restrict__ partial) {
  WaitForPrerequisiteGrid();  // the rounded dh^T
  using Plan = DphiPlan<T, kW>;
  constexpr int kStages = Plan::kStages;
  constexpr int XS = Plan::kXStride;
  extern __shared__ __align__(16) char wgmma_dphi_smem[];
  char* smem = AtomAligned(wgmma_dphi_smem);
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int grp = lane >> 2;
  const int quad = lane & 3;
  const PhiTile tile =
      PhiTileOf<kW, kCols, kStageTokens>(s, tokens, chunk_tokens);

  auto dh_stage = [&](int buf) {
    return reinterpret_cast<float*>(smem + buf * Plan::kDhBytes);
  };
  auto x_stage = [&](int buf) {
    return reinterpret_cast<T*>(smem + Plan::kXAt + buf * Plan::kXBytes);
  };
  auto load = [&](int st) {
    if (st >= tile.stages) return;
    const int buf = st % kStages;
    const int64_t m0 = tile.begin + static_cast<int64_t>(st) * kStageTokens;
    StageXVectors<T, kCols, kStageTokens, kThreads>(s, x, tile, st,
                                                    x_stage(buf), XS);
    // dh^T: 16-byte chunk c (4 token positions) of logit row l at c ^ (l % 8);
    // rows past Np and positions past Mp land as zeros.
    float* dhs = dh_stage(buf);
    for (int v = tid; v < kW * 8; v += kThreads) {
      const int l = v >> 3;
      const int c = v & 7;
      const bool ok = tile.g0 + l < Np && m0 + 4 * c < Mp;
      CpAsync<16>(dhs + l * kStageTokens + ((c ^ (l & 7)) << 2),
                  ok ? dh_t + (tile.g0 + l) * Mp + m0 + 4 * c : dh_t, ok);
    }
  };

  const int wg = warp >> 2;                   // 64-column half
  const int col = 64 * wg + 16 * (warp & 3);  // this warp's 16 columns
  const uint64_t b_desc0 = SwizzledDescriptor(dh_stage(0));
  float acc[kW / 2];
#pragma unroll
  for (int i = 0; i < kW / 2; ++i) acc[i] = 0.0f;

#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    load(st);
    CpAsyncCommit();
  }
  for (int st = 0; st < tile.stages; ++st) {
    CpAsyncWait<kStages - 2>();
    // This thread's landed copies, visible to the async proxy the wgmmas
    // read through, then everyone's.
    FenceProxyAsyncShared();
    __syncthreads();
    // The buffer refilled here was last read by stage st - 1, whose wgmmas
    // every thread waited for before the barrier.
    load(st + kStages - 1);
    CpAsyncCommit();
    const T* xs = x_stage(st % kStages);
    uint32_t xa[2][2][4];
    [[maybe_unused]] uint32_t unused_low[2][2][4];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      LoadXTransposed<false>(lane, xs, XS, half * 16, col, xa[half],
                             unused_low[half]);
    }
    const uint64_t b_desc =
        DescriptorPlus(b_desc0, (st % kStages) * Plan::kDhBytes);
    WgmmaFence();
#pragma unroll
    for (int step = 0; step < kStageTokens / 8; ++step) {
      WgmmaTf32RegA<kW>(acc, xa[step >> 1][step & 1],
                        DescriptorPlus(b_desc, 32 * step));
    }
    WgmmaCommit();
    WgmmaWait<0>();
  }
  CpAsyncWait<0>();

  // Accumulator i: column col + grp (+ 8), logit 8 (i / 4) + 2 quad (+ 1).
  float* out = partial + blockIdx.z * s.N * s.K;
#pragma unroll
  for (int i = 0; i < kW / 2; ++i) {
    const int j = col + grp + 8 * ((i >> 1) & 1);
    const int g = 8 * (i >> 2) + 2 * quad + (i & 1);
    if (j < tile.cols && g < tile.logits) {
      out[(tile.g0 + g) * s.K + tile.k0 + j] = acc[i];
    }
  }
}

// Logits per CTA: the fewest computed (tiles x width), the wider on a tie.
int DphiTileWidth(int N) {
  int best = 0;
  int64_t best_padded = 0;
  for (int w : {144, 96, 80}) {
    const int64_t padded = (N + w - 1) / w * static_cast<int64_t>(w);
    if (best == 0 || padded < best_padded) {
      best = w;
      best_padded = padded;
    }
  }
  return best;
}

template <typename T, int kW>
cudaError_t LaunchTiles(const DevSpec& s, int64_t tokens, int chunk_tokens,
                        const void* x, const float* dh_t, int64_t Mp, int Np,
                        float* partial, cudaStream_t stream) {
  // Logit tiles fastest: the CTAs of one x tile run side by side and read it
  // from HBM once.
  return LaunchLargeSmem(
      wgmma_dphi_kernel<T, kW>,
      dim3(GridSize((s.N + kW - 1) / kW), GridSize((s.K + kCols - 1) / kCols),
           GridSize((tokens + chunk_tokens - 1) / chunk_tokens)),
      kThreads, DphiPlan<T, kW>::kSmem, stream, s, tokens, chunk_tokens,
      static_cast<const T*>(x), dh_t, Mp, Np, partial);
}

}  // namespace

cudaError_t LaunchWgmmaPhiPartials(const DevSpec& s, int64_t tokens,
                                   int chunk_tokens, DType dtype, const void* x,
                                   const float* dh_t, int64_t Mp, int Np,
                                   float* partial, cudaStream_t stream) {
  const int width = DphiTileWidth(static_cast<int>(s.N));
  cudaError_t err = cudaSuccess;
  DispatchDType(dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    if (width == 144) {
      err = LaunchTiles<T, 144>(s, tokens, chunk_tokens, x, dh_t, Mp, Np,
                                partial, stream);
    } else if (width == 96) {
      err = LaunchTiles<T, 96>(s, tokens, chunk_tokens, x, dh_t, Mp, Np,
                               partial, stream);
    } else {
      err = LaunchTiles<T, 80>(s, tokens, chunk_tokens, x, dh_t, Mp, Np,
                               partial, stream);
    }
  });
  return err;
}

}  // namespace mhc::cuda
