// dphi^T partials of wide layers on mma.sync tiles
// (projection/backward/dphi_mma.h).
//
// A CTA owns kPhiCols columns of K x kPhiLogits logits of one token chunk;
// warp (wl, wc) the 32 columns 32 wc.. (2 mma row tiles) x the 48 logits
// 48 wl.. (6 tiles). A stage is kPhiTokens tokens: x [tokens x columns] in
// its own type and the rounded dh [logits x tokens]. x reaches the mma
// through ldmatrix.trans (16-bit), which hands each lane tokens 2u and
// 2u + 1, so the mma's k slots u and u + 4 are those tokens for both
// operands.
//
// Determinism / batch invariance: partials per (chunk, column, logit), the
// chunk's tokens in order (IEEE: each stage of kPhiTokens in fresh registers,
// added with rounded adds), reduced over chunks in order by
// LaunchPhiGradReduce. No atomics.
#include <cstdint>

#include "dispatch.cuh"
#include "primitives/kernel_fit.h"
#include "primitives/stage_pipeline.cuh"
#include "projection/backward/dphi_mma.h"
#include "projection/backward/dphi_tile.cuh"
#include "projection/backward/mma_tiles.cuh"
#include "projection/forward/mma.cuh"

namespace mhc::cuda {
namespace {

using dx_mma::LoadXTransposed;

constexpr int kThreads = 256;  // 8 warps

// The rounded dh^T (high and, under IEEE, low parts) and the partials.
struct PhiOperands {
  const float* dh_t[2];
  int64_t Mp;
  int Np;
  float* dphi_partial;
};

constexpr int kPhiCols = 128;
constexpr int kPhiLogits = 96;
constexpr int kPhiTokens = 32;
constexpr int kPhiStages = 3;
static_assert(kTokenChunk % kPhiTokens == 0, "stages tile a chunk");
// x rows: 16-bit strides of 16 mod 128 bytes (ldmatrix rows conflict free),
// fp32 of 8 mod 32 words over two rows (fragment loads of rows 2 quad).
template <typename T>
constexpr int PhiXStride() {
  return sizeof(T) == 4 ? kPhiCols + 4 : kPhiCols + 8;
}
// dh^T rows of a stage: 8 mod 32 words, so the lanes' 8-byte fragment loads
// (rows grp, words 2 quad) are conflict free.
constexpr int kDhStride = kPhiTokens + 8;
template <typename T, bool kIeee>
constexpr int PhiStageBytes() {
  return kPhiTokens * PhiXStride<T>() * static_cast<int>(sizeof(T)) +
         (kIeee ? 2 : 1) * kPhiLogits * kDhStride * 4;
}
template <typename T, bool kIeee>
constexpr int PhiSmemBytes() {
  return kPhiStages * PhiStageBytes<T, kIeee>();
}

template <typename T, bool kIeee, bool kVector>
__global__ void __launch_bounds__(kThreads, kIeee ? 1 : 2)
    wide_dphi_kernel(DevSpec s, int64_t tokens, int chunk_tokens,
                     const T* __restrict__ x, PhiOperands a) {
  WaitForPrerequisiteGrid();  // the rounded dh^T
  extern __shared__ __align__(16) char wide_phi_smem[];
  constexpr int XS = PhiXStride<T>();
  constexpr int kParts = kIeee ? 2 : 1;
  constexpr bool kSplitX = kIeee && sizeof(T) == 4;
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int grp = lane >> 2;
  const int quad = lane & 3;
  const PhiTile tile =
      PhiTileOf<kPhiLogits, kPhiCols, kPhiTokens>(s, tokens, chunk_tokens);

  auto stage_x = [&](int buf) {
    return reinterpret_cast<T*>(wide_phi_smem +
                                buf * PhiStageBytes<T, kIeee>());
  };
  auto stage_dh = [&](int buf, int part) {
    return reinterpret_cast<float*>(wide_phi_smem +
                                    buf * PhiStageBytes<T, kIeee>() +
                                    kPhiTokens * XS * sizeof(T)) +
           part * kPhiLogits * kDhStride;
  };
  auto load_stage = [&](int st) {
    if (st >= tile.stages) return;
    const int buf = st % kPhiStages;
    const int64_t m0 = tile.begin + st * kPhiTokens;
    const int rows = min(kPhiTokens, tile.chunk_tokens - st * kPhiTokens);
    T* xs = stage_x(buf);
    if constexpr (kVector) {
      StageXVectors<T, kPhiCols, kPhiTokens, kThreads>(s, x, tile, st, xs, XS);
    } else {
      // Unaligned rows (odd K, offset tensors): element copies.
      for (int v = tid; v < kPhiTokens * kPhiCols; v += kThreads) {
        const int t = v / kPhiCols;
        const int j = v % kPhiCols;
        xs[t * XS + j] = t < rows && j < tile.cols
                             ? x[(m0 + t) * s.K + tile.k0 + j]
                             : FromFloat<T>(0.0f);
      }
    }
    // Rounded dh rows of the tile's tile.logits (zero past Np), this stage's
    // tokens: pieces of 4 tokens, which Mp and the zero pad past M keep
    // inside the row.
    const int live = min(kPhiLogits, a.Np - tile.g0);
    for (int p = 0; p < kParts; ++p) {
      float* dhs = stage_dh(buf, p);
      for (int v = tid; v < kPhiLogits * 8; v += kThreads) {
        const int l = v >> 3;
        const int piece = (v & 7) * 4;
        const bool ok = l < live && piece < rows;
        CpAsync<16>(
            dhs + l * kDhStride + piece,
            ok ? a.dh_t[p] + (tile.g0 + l) * a.Mp + m0 + piece : a.dh_t[p], ok);
      }
    }
  };

  const int wl = warp >> 2;  // 48-logit half
  const int wc = warp & 3;   // 32-column quarter
  float dphi[2][6][4];
  [[maybe_unused]] float stage_sum[kIeee ? 2 : 1][kIeee ? 6 : 1][4];
  ZeroFill(dphi);
  // IEEE sums each stage in fresh registers and adds it with rounded adds,
  // as the forward does; tf32 accumulates in the mma.
  auto acc = [&](int mt, int nt) -> float(&)[4] {
    if constexpr (kIeee) {
      return stage_sum[mt][nt];
    } else {
      return dphi[mt][nt];
    }
  };

  Pipeline<kPhiStages>(tile.stages, load_stage, [&](int st) {
    const T* xs = stage_x(st % kPhiStages);
    if constexpr (kIeee) ZeroFill(stage_sum);
#pragma unroll
    for (int half = 0; half < kPhiTokens / 16; ++half) {
      // A = x^T: columns 32 wc + 16 mt + grp (+8), tokens 16 half + 8 step
      // + 2 quad (slot quad) and + 1 (slot quad + 4).
      uint32_t xa[2][2][4];
      [[maybe_unused]] uint32_t xl[2][2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        LoadXTransposed<kSplitX>(lane, xs, XS, half * 16, wc * 32 + mt * 16,
                                 xa[mt], xl[mt]);
      }
#pragma unroll
      for (int step = 0; step < 2; ++step) {
        // B = dh: logit 48 wl + 8 nt + grp, tokens as above (adjacent).
        const int off =
            (wl * 48 + grp) * kDhStride + half * 16 + step * 8 + 2 * quad;
#pragma unroll
        for (int nt = 0; nt < 6; ++nt) {
          uint32_t bf[kParts][2];
#pragma unroll
          for (int p = 0; p < kParts; ++p) {
            const float2 v = *reinterpret_cast<const float2*>(
                stage_dh(st % kPhiStages, p) + off + nt * 8 * kDhStride);
            bf[p][0] = __float_as_uint(v.x);
            bf[p][1] = __float_as_uint(v.y);
          }
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            Mma1688(acc(mt, nt), xa[mt][step], __uint_as_float(bf[0][0]),
                    __uint_as_float(bf[0][1]));
            if constexpr (kIeee) {
              Mma1688(acc(mt, nt), xa[mt][step], __uint_as_float(bf[1][0]),
                      __uint_as_float(bf[1][1]));
            }
            if constexpr (kSplitX) {
              Mma1688(acc(mt, nt), xl[mt][step], __uint_as_float(bf[0][0]),
                      __uint_as_float(bf[0][1]));
            }
          }
        }
      }
    }
    if constexpr (kIeee) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int nt = 0; nt < 6; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) dphi[mt][nt][e] += stage_sum[mt][nt][e];
        }
      }
    }
  });

  // dphi^T fragment: columns 32 wc + 16 mt + grp (+8), tile.logits 48 wl + 8 nt
  // + 2 quad (+1).
  float* partial = a.dphi_partial + blockIdx.z * s.N * s.K;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int j = wc * 32 + mt * 16 + grp + 8 * h;
      if (j >= tile.cols) continue;
#pragma unroll
      for (int nt = 0; nt < 6; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int g = wl * 48 + nt * 8 + 2 * quad + e;
          if (g < tile.logits) {
            partial[(tile.g0 + g) * s.K + tile.k0 + j] =
                dphi[mt][nt][2 * h + e];
          }
        }
      }
    }
  }
}

template <typename T, bool kIeee, bool kVector>
cudaError_t LaunchDphi(const DevSpec& s, int64_t tokens, int chunk_tokens,
                       const T* x, const PhiOperands& d, cudaStream_t stream) {
  // Logit tiles fastest: the CTAs of one x tile run side by side and read
  // it from HBM once.
  return LaunchLargeSmem(
      wide_dphi_kernel<T, kIeee, kVector>,
      dim3(GridSize((s.N + kPhiLogits - 1) / kPhiLogits),
           GridSize((s.K + kPhiCols - 1) / kPhiCols),
           GridSize((tokens + chunk_tokens - 1) / chunk_tokens)),
      kThreads, PhiSmemBytes<T, kIeee>(), stream, s, tokens, chunk_tokens, x,
      d);
}

}  // namespace

cudaError_t LaunchMmaPhiPartials(const DevSpec& s, int64_t tokens,
                                 int chunk_tokens, DType dtype, bool ieee,
                                 const void* x, bool vector_x,
                                 float* const (&dh_t)[2], int64_t Mp, int Np,
                                 float* partial, cudaStream_t stream) {
  const PhiOperands d{{dh_t[0], dh_t[1]}, Mp, Np, partial};
  cudaError_t err = cudaSuccess;
  DispatchDType(dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    DispatchBool(ieee, [&](auto ieee_tag) {
      constexpr bool kIeee = decltype(ieee_tag)::value;
      // TF32 with vector rows runs on warpgroup mmas: no vector build here.
      DispatchBool(kIeee && vector_x, [&](auto vector_tag) {
        constexpr bool kVector = kIeee && decltype(vector_tag)::value;
        err = LaunchDphi<T, kIeee, kVector>(
            s, tokens, chunk_tokens, static_cast<const T*>(x), d, stream);
      });
    });
  });
  return err;
}

}  // namespace mhc::cuda
