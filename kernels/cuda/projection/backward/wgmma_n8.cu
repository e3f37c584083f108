// Projection backward of n = 8 layers (80 logits, stream-major, 16-bit
// activations, TF32) on warpgroup mmas: dx = dh phi' + dms 2 v / K (+ the
// fused pre backward's aggregate and residual terms) and the per-chunk
// partials of dphi = dh^T v, from one read of x.
//
// The register-resident mma.sync kernel (projection/backward/mma.cuh) keeps
// 80 phi' columns and dphi rows per warp at one CTA per SM and ran at a
// quarter of DRAM bandwidth: every warp issued 80 small mmas per stage
// besides its copies and terms. Here a CTA owns 16 channels of all eight
// streams (128 columns of K, so the residual term's reads stay in the CTA)
// and one chunk of kTokenChunk tokens, staged 32 tokens at a time through a
// cp.async ring; warpgroup wg owns streams 4 wg .. 4 wg + 3 (64 columns):
//   dx^T  [64 cols x 32 tokens] = phi'^T [64 x 80] . dh^T [80 x 32 tokens]
//         wgmma.m64n32k8, phi'^T (rounded to tf32 once) in registers as A,
//         dh rows K-major in shared memory as B;
//   dphi^T [64 cols x 80]     += x^T [64 x 32 tokens] . dh [32 tokens x 80]
//         wgmma.m64n80k8, x^T from ldmatrix.trans as A (16-bit x converts
//         to tf32 exactly), dh^T rows as B, accumulated over the chunk.
// dh is rounded to tf32 once per stage into both B layouts. The dx^T
// accumulators go through shared memory as fp32 rows, and each thread then
// finishes 8 channels of two streams of one token: the dms term, the
// aggregate and residual terms from the staged rows, one 16-byte store per
// stream. That epilogue of stage st - 1 runs while the tensor cores multiply
// stage st, so the ring holds those two and the stages in flight: eight
// stages in all (four with the residual term's rows, as many as fit).
//
// Numerics are the mma.sync kernel's under TF32: phi' and dh rounded to
// tf32 to nearest, x exact, fp32 accumulation; dphi sums a chunk's tokens in
// the tensor cores' fp32 accumulators. Determinism / batch invariance: a
// token's dx is the same products in a fixed order whatever M and the
// token's slot; dphi partials are per (chunk, logit, column), reduced over
// chunks in order by LaunchPhiGradReduce. No atomics.
#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "dispatch.cuh"
#include "primitives/kernel_fit.h"
#include "primitives/wgmma.cuh"
#include "projection/backward/dphi_wgmma.h"
#include "projection/backward/mma_tiles.cuh"
#include "projection/backward/ms_term.cuh"
#include "projection/backward/wgmma_n8.h"
#include "projection/backward/wgmma_tile.cuh"
#include "projection/forward/mma.cuh"

namespace mhc::cuda {
namespace {

using dx_mma::LoadXTransposed;

constexpr int kStreams = 8;
constexpr int kLogits = 2 * kStreams + kStreams * kStreams;
constexpr int kChans = 16;  // channels per CTA, of every stream
constexpr int kCols = kChans * kStreams;
constexpr int kThreads = 256;  // two warpgroups
constexpr int kStageTokens = 32;
constexpr int kVec = 8;  // 16-bit elements per 16-byte copy
// The first of the threads that copy dms, dy and H_pre (32 + 64 + 64 copies
// per stage): 96 onwards, mostly past the 128 with a third dh copy.
constexpr int kSmallRunsThread = 96;
static_assert(kTokenChunk % kStageTokens == 0, "stages tile a chunk");

// Strides of the staged rows, chosen so that eight consecutive tokens (the
// lanes of one shared-memory phase in the epilogue and in the dh rounding)
// hit distinct 16-byte bank groups, and the ldmatrix rows of x as well.
constexpr int kXStride = kCols + 8;                // elements: 272 bytes
constexpr int kDyStride = kChans + 8;              // elements: 48 bytes
constexpr int kDhStride = kLogits + 4;             // floats: 336 bytes
constexpr int kRStride = kStreams * kStreams + 4;  // floats: 272 bytes
constexpr int kDStride = kCols + 4;                // floats of the dx^T rows
// dh as dx's B operand: 32-logit blocks of 128-byte swizzled token rows.
constexpr int kDhBlocks = (kLogits + 31) / 32;
constexpr int kDhBlockBytes = kStageTokens * 128;

// kTerms: 0 the projection backward alone, 1 with the aggregate term, 2 with
// the aggregate and residual terms; kStages: the ring's length. Byte offsets
// inside one stage of the ring, and of the buffers used once per stage.
template <int kTerms, int kStages>
struct Plan {
  static constexpr int kX = 0;
  static constexpr int kDh = kX + kStageTokens * kXStride * 2;
  static constexpr int kDms = kDh + kStageTokens * kDhStride * 4;
  static constexpr int kDy = kDms + kStageTokens * 4;
  static constexpr int kHp =
      kDy + (kTerms >= 1 ? kStageTokens * kDyStride * 2 : 0);
  static constexpr int kDxn =
      kHp + (kTerms >= 1 ? kStageTokens * kStreams * 4 : 0);
  static constexpr int kR =
      kDxn + (kTerms == 2 ? kStageTokens * kXStride * 2 : 0);
  static constexpr int kStageBytes =
      kR + (kTerms == 2 ? kStageTokens * kRStride * 4 : 0);
  static_assert(kStageBytes % 16 == 0, "stages on 16 bytes");
  // Swizzled operands first, on atoms (the dynamic shared memory's start is
  // aligned up to one in-kernel).
  static constexpr int kDhx = 0;
  static constexpr int kDht = kDhx + kDhBlocks * kDhBlockBytes;
  static constexpr int kRing = kDht + kLogits * 128;
  static constexpr int kD = kRing + kStages * kStageBytes;
  static constexpr int kSmem =
      kD + kStageTokens * kDStride * 4 + kSwizzleAtomBytes;
};

// Eight floats rounded to 16-bit T, as one 16-byte word.
template <typename T>
__device__ __forceinline__ uint4 Pack8(const float (&v)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const __nv_bfloat162 p = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&p);
    } else {
      const __half2 p = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&p);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <typename T, int kTerms, int kStages>
__global__ void __launch_bounds__(kThreads, 1)
    dx_dphi_wgmma_kernel(DevSpec s, int64_t tokens, const T* __restrict__ x,
                         WgmmaDxDev a) {
  WaitForPrerequisiteGrid();  // dh, dms and the terms' inputs
  using P = Plan<kTerms, kStages>;
  extern __shared__ __align__(16) char dx_wgmma_smem[];
  char* smem = AtomAligned(dx_wgmma_smem);
  float* dhx = reinterpret_cast<float*>(smem + P::kDhx);
  float* dht = reinterpret_cast<float*>(smem + P::kDht);
  float* dbuf = reinterpret_cast<float*>(smem + P::kD);
  auto stage_at = [&](int buf, int offset) {
    return smem + P::kRing + buf * P::kStageBytes + offset;
  };
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int grp = lane >> 2;
  const int quad = lane & 3;
  const int wg = warp >> 2;
  const auto tile = ThisDxTile<kChans, kStageTokens>(s, tokens, 1);
  const bool want_dphi = a.dphi_partial != nullptr;
  const T* dy = static_cast<const T*>(a.dy);
  const T* dx_next = static_cast<const T*>(a.dx_next);
  T* dx = static_cast<T*>(a.dx);

  // This thread's copies, the same slots at every stage (a stage moves the
  // global rows on by kStageTokens tokens). x and dx_next: tokens xt + 16 i
  // (i = 0, 1), 16-byte vector xv of the row (stream xv / 2, channels
  // 8 (xv % 2) on); R the same tokens' vector xv.
  const int xt = tid >> 4;
  const int xv = tid & 15;
  const bool x_in = (xv & 1) * kVec < tile.chans;
  const int64_t x_col = (xv >> 1) * s.C + tile.c0 + (xv & 1) * kVec;
  const int x_slot = xt * kXStride + xv * kVec;
  // dh: 16-byte chunk v = tid + kThreads i of the stage's rows (token v / 20,
  // chunk v % 20), for i < 2 and, where v < 640, i = 2.
  constexpr int kDhChunks = kStageTokens * kLogits / 4;
  constexpr int kDhCopies = (kDhChunks + kThreads - 1) / kThreads;
  int dh_token[kDhCopies], dh_slot[kDhCopies], dh_at[kDhCopies];
#pragma unroll
  for (int i = 0; i < kDhCopies; ++i) {
    const int v = tid + i * kThreads;
    dh_token[i] = v < kDhChunks ? v / (kLogits / 4) : kStageTokens;
    dh_slot[i] = dh_token[i] * kDhStride + 4 * (v % (kLogits / 4));
    dh_at[i] = dh_token[i] * kLogits + 4 * (v % (kLogits / 4));
  }
  auto load = [&](int st) {
    if (st >= tile.stages) return;
    const int buf = st % kStages;
    const int64_t m0 = tile.StageToken(st);
    const int rows = tile.StageRows(st);
    T* xs = reinterpret_cast<T*>(stage_at(buf, P::kX));
    const int64_t x_at = (m0 + xt) * s.K + x_col;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const bool ok = x_in && xt + 16 * i < rows;
      const int64_t at = x_at + 16 * i * s.K;
      CpAsync<16>(xs + x_slot + 16 * i * kXStride, ok ? x + at : x, ok);
      if constexpr (kTerms == 2) {
        CpAsync<16>(reinterpret_cast<T*>(stage_at(buf, P::kDxn)) + x_slot +
                        16 * i * kXStride,
                    ok ? dx_next + at : dx_next, ok);
      }
    }
    float* dhs = reinterpret_cast<float*>(stage_at(buf, P::kDh));
    const float* dh = a.dh + m0 * kLogits;
#pragma unroll
    for (int i = 0; i < kDhCopies; ++i) {
      if (dh_token[i] == kStageTokens) break;
      const bool ok = dh_token[i] < rows;
      CpAsync<16>(dhs + dh_slot[i], ok ? dh + dh_at[i] : a.dh, ok);
    }
    // The per-token runs of a few floats, on threads whose share of the dh
    // copies above is the smaller.
    const int small = tid - kSmallRunsThread;
    if (small >= 0 && small < kStageTokens) {
      const bool ok = small < rows;
      CpAsync<4>(reinterpret_cast<float*>(stage_at(buf, P::kDms)) + small,
                 ok ? a.dms + m0 + small : a.dms, ok);
    }
    if constexpr (kTerms >= 1) {
      const int dy_v = small - kStageTokens;
      if (dy_v >= 0 && dy_v < 2 * kStageTokens) {
        const int t = dy_v >> 1;
        const int ch = (dy_v & 1) * kVec;
        const bool ok = t < rows && ch < tile.chans;
        CpAsync<16>(
            reinterpret_cast<T*>(stage_at(buf, P::kDy)) + t * kDyStride + ch,
            ok ? dy + (m0 + t) * s.C + tile.c0 + ch : dy, ok);
      }
      const int hp_v = dy_v - 2 * kStageTokens;
      if (hp_v >= 0 && hp_v < kStageTokens * kStreams / 4) {
        const bool ok = hp_v / 2 < rows;
        CpAsync<16>(reinterpret_cast<float*>(stage_at(buf, P::kHp)) + 4 * hp_v,
                    ok ? a.h_pre + m0 * kStreams + 4 * hp_v : a.h_pre, ok);
      }
    }
    if constexpr (kTerms == 2) {
      float* rs = reinterpret_cast<float*>(stage_at(buf, P::kR));
      const float* r = a.r + (m0 + xt) * kStreams * kStreams + 4 * xv;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const bool ok = xt + 16 * i < rows;
        CpAsync<16>(rs + (xt + 16 * i) * kRStride + 4 * xv,
                    ok ? r + 16 * i * kStreams * kStreams : a.r, ok);
      }
    }
  };

  // phi'^T as the dx product's A, for the lifetime of the CTA: rows (this
  // warp's columns) col0 + grp (+ 8), logits 8 kt + quad (+ 4).
  const int col0 = 64 * wg + 16 * (warp & 3);
  uint32_t phi_a[kLogits / 8][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int j = col0 + grp + 8 * h;
    const bool ok = (j & (kChans - 1)) < tile.chans;
    const int64_t k = (j >> 4) * s.C + tile.c0 + (j & (kChans - 1));
    const float gm = ok && a.gamma != nullptr ? a.gamma[k] : 1.0f;
#pragma unroll
    for (int kt = 0; kt < kLogits / 8; ++kt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int g = 8 * kt + quad + 4 * e;
        const float v = ok ? a.phi[g * s.K + k] * gm : 0.0f;
        phi_a[kt][h + 2 * e] = __float_as_uint(RoundTf32(v));
      }
    }
  }

  const uint64_t dhx_desc = SwizzledDescriptor(dhx);
  const uint64_t dht_desc = SwizzledDescriptor(dht);
  const float ms_scale = 2.0f / static_cast<float>(s.K);
  const int dh_pos = static_cast<int>(WgmmaTokenPosition(lane));
  float dphi[kLogits / 2];
  ZeroFill(dphi);
  // The epilogue's token, channels and streams (see the header).
  const int et = (lane & 15) + 16 * (warp & 1);
  const int ec = (lane >> 4) * kVec;
  const int es = 4 * wg + 2 * ((warp & 3) >> 1);

  // dx of stage st from the dbuf rows, finished and stored.
  auto epilogue = [&](int st) {
    const int buf = st % kStages;
    const int64_t m0 = tile.StageToken(st);
    const int rows = tile.StageRows(st);
    const T* xs = reinterpret_cast<const T*>(stage_at(buf, P::kX));
    if (et < rows && ec < tile.chans) {
      const MsTerm dm = MsTermOf(
          reinterpret_cast<const float*>(stage_at(buf, P::kDms))[et], ms_scale);
      float terms[2][kVec];
      if constexpr (kTerms >= 1) {
        float dyv[kVec];
        LoadVec<T, kVec>(reinterpret_cast<const T*>(stage_at(buf, P::kDy)) +
                             et * kDyStride + ec,
                         dyv);
        const float2 hp = *reinterpret_cast<const float2*>(
            reinterpret_cast<const float*>(stage_at(buf, P::kHp)) +
            et * kStreams + es);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          terms[0][e] = hp.x * dyv[e];
          terms[1][e] = hp.y * dyv[e];
        }
      }
      if constexpr (kTerms == 2) {
        const float* r = reinterpret_cast<const float*>(stage_at(buf, P::kR)) +
                         et * kRStride + es * kStreams;
        float rv[2][kStreams];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
#pragma unroll
          for (int i = 0; i < kStreams; i += 4) {
            const float4 q =
                *reinterpret_cast<const float4*>(r + u * kStreams + i);
            rv[u][i] = q.x;
            rv[u][i + 1] = q.y;
            rv[u][i + 2] = q.z;
            rv[u][i + 3] = q.w;
          }
        }
        const T* xn = reinterpret_cast<const T*>(stage_at(buf, P::kDxn)) +
                      et * kXStride + ec;
#pragma unroll
        for (int i = 0; i < kStreams; ++i) {
          float g[kVec];
          LoadVec<T, kVec>(xn + i * kChans, g);
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            terms[0][e] = fmaf(rv[0][i], g[e], terms[0][e]);
            terms[1][e] = fmaf(rv[1][i], g[e], terms[1][e]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int col = (es + u) * kChans + ec;
        float v[kVec];
        LoadVec<T, kVec>(xs + et * kXStride + col, v);
        const float4* d4 =
            reinterpret_cast<const float4*>(dbuf + et * kDStride + col);
        const float4 lo = d4[0], hi = d4[1];
        const float d[kVec] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        float out[kVec];
        dm.With([&](auto add) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) out[e] = add(v[e], d[e]);
        });
        if constexpr (kTerms >= 1) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) out[e] += terms[u][e];
        }
        const uint4 w = Pack8<T>(out);
        // One 16-byte store: the compiler splits a uint4 assignment here.
        asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(
                         dx + (m0 + et) * s.K + (es + u) * s.C + tile.c0 + ec),
                     "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w)
                     : "memory");
      }
    }
  };
  float dxt[16];
  // dxt[4 i + 2 h + e]: column col0 + grp + 8 h, token 8 i + 2 quad + e.
  auto store_dxt = [&] {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          dbuf[(8 * i + 2 * quad + e) * kDStride + col0 + grp + 8 * h] =
              dxt[4 * i + 2 * h + e];
        }
      }
    }
  };

  // The ring holds the stage multiplied, the one whose epilogue runs beside
  // those products, and kAhead in flight.
  constexpr int kAhead = kStages - 2;
#pragma unroll
  for (int st = 0; st < kAhead; ++st) {
    load(st);
    CpAsyncCommit();
  }
  for (int st = 0; st < tile.stages; ++st) {
    CpAsyncWait<kAhead - 1>();
    // Stage st has landed for everyone, and everyone is done with the
    // epilogue of stage st - 2 (its ring slot is refilled here) and with
    // stage st - 1's dh operands and dbuf rows (rewritten below).
    __syncthreads();
    if (st > 0) store_dxt();
    load(st + kAhead);
    CpAsyncCommit();
    const int buf = st % kStages;
    const T* xs = reinterpret_cast<const T*>(stage_at(buf, P::kX));

    // dh rounded to tf32 into both B layouts: token rows of 32-logit blocks
    // (dx) and logit rows of the stage's tokens at their WgmmaTokenPosition
    // (dphi). Chunk i of this thread: token `lane`, logits 4 c .. 4 c + 3
    // for c = warp + 8 i, in block i.
    const float* dhs = reinterpret_cast<const float*>(stage_at(buf, P::kDh));
#pragma unroll
    for (int i = 0; i < kDhBlocks; ++i) {
      if (warp + 8 * i >= kLogits / 4) break;
      const float4 q = *reinterpret_cast<const float4*>(dhs + lane * kDhStride +
                                                        4 * (warp + 8 * i));
      StoreRoundedDh(q, lane, warp, dh_pos,
                     reinterpret_cast<char*>(dhx) + i * kDhBlockBytes,
                     dht + i * 32 * 32);
    }
    FenceProxyAsyncShared();
    __syncthreads();

    uint32_t xa[2][2][4];
    [[maybe_unused]] uint32_t unused_low[2][2][4];
    if (want_dphi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        LoadXTransposed<false>(lane, xs, kXStride, half * 16, col0, xa[half],
                               unused_low[half]);
      }
    }
    ZeroFill(dxt);
    WgmmaFence();
#pragma unroll
    for (int kt = 0; kt < kLogits / 8; ++kt) {
      WgmmaTf32RegA<kStageTokens>(
          dxt, phi_a[kt],
          DescriptorPlus(dhx_desc, (kt >> 2) * kDhBlockBytes + (kt & 3) * 32));
    }
    if (want_dphi) {
#pragma unroll
      for (int step = 0; step < kStageTokens / 8; ++step) {
        WgmmaTf32RegA<kLogits>(dphi, xa[step >> 1][step & 1],
                               DescriptorPlus(dht_desc, 32 * step));
      }
    }
    WgmmaCommit();
    // The previous stage's epilogue runs while the tensor cores work.
    if (st > 0) epilogue(st - 1);
    WgmmaWait<0>();
  }
  __syncthreads();
  store_dxt();
  __syncthreads();
  epilogue(tile.stages - 1);
  CpAsyncWait<0>();
  if (!want_dphi) return;
  StoreDphiPartial<kLogits, kChans>(dphi, s, tile, col0, lane,
                                    a.dphi_partial + tile.chunk * s.N * s.K);
}

// The deepest ring of at most 8 stages that fits the CTA in an SM's 228 KB
// of shared memory (less the 1 KB a CTA reserves): more stages in flight
// where the stages are small, since one CTA per SM leaves few warps to hide
// DRAM latency with.
template <int kTerms>
constexpr int DeepestRing() {
  using P1 = Plan<kTerms, 1>;
  constexpr int fit =
      (227 * 1024 - (P1::kSmem - P1::kStageBytes)) / P1::kStageBytes;
  return fit < 8 ? fit : 8;
}

template <typename T, int kTerms>
cudaError_t LaunchTerms(const DevSpec& s, int64_t tokens, const void* x,
                        const WgmmaDxDev& d, cudaStream_t stream) {
  constexpr int kStages = DeepestRing<kTerms>();
  static_assert(kStages >= 3, "a stage multiplied, one finished, one ahead");
  const dim3 grid(GridSize((s.C + kChans - 1) / kChans),
                  GridSize(NumChunks(tokens)));
  return LaunchLargeSmem(dx_dphi_wgmma_kernel<T, kTerms, kStages>, grid,
                         kThreads, Plan<kTerms, kStages>::kSmem, stream, s,
                         tokens, static_cast<const T*>(x), d);
}

}  // namespace

absl::Status LaunchWgmmaDxAndPhiPartials(const DxArgs& a,
                                         const ProjectionBackwardPlan& plan,
                                         cudaStream_t stream) {
  static_assert(
      proj::kWgmmaVec == kVec && proj::kWgmmaN8StageTokens == kStageTokens,
      "the plan's geometry is the kernel's");
  const DevSpec s = MakeDevSpec(*a.spec);
  const WgmmaDxDev d{a.phi,   s.has_gamma ? a.gamma : nullptr,
                     a.dh,    a.dms,
                     a.h_pre, a.dy,
                     a.r,     a.dx_next,
                     a.dx,    a.dphi_partial};
  const int terms = plan.terms;
  cudaError_t err = cudaSuccess;
  auto go = [&](auto tt) {
    using T = typename decltype(tt)::type;
    err = terms == 2   ? LaunchTerms<T, 2>(s, a.tokens, a.x, d, stream)
          : terms == 1 ? LaunchTerms<T, 1>(s, a.tokens, a.x, d, stream)
                       : LaunchTerms<T, 0>(s, a.tokens, a.x, d, stream);
  };
  if (a.act_dtype == DType::kBF16) {
    go(TypeTag<__nv_bfloat16>{});
  } else {
    go(TypeTag<__half>{});
  }
  MHC_CUDA_RETURN_IF_ERROR(err, "projection backward wgmma_n8",
                           LaunchShape(*a.spec, a.tokens, a.act_dtype));
  return absl::OkStatus();
}

}  // namespace mhc::cuda
