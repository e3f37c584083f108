// Tensor-core projection backward for the dynamic layers the
// register-resident kernel (projection/backward/mma.cuh) does not take: n
// not a power of two (n = 3, 5-7, 9-15), more than 80 logits (n = 16), or n
// = 1 / 8 where that kernel's tiles outgrow shared memory. The FFMA kernel
// (projection/launch.cu) that ran them re-read every phi row for every token,
// some thirty times slower at n = 16 (docs/decisions.md). Two GEMM-shaped
// kernels take its place:
//   dx      [M x K] = dh [M x N] . phi' [N x K] + dms 2 v / K (+ the fused
//                     pre backward's aggregate and residual terms, the
//                     latter summed apart by
//                     projection/backward/wide_terms.cu), rounded once;
//   dphi^T  [K x N] = x^T [K x tokens] . dh [tokens x N], per fixed chunk of
//                     PhiChunkTokens tokens: under TF32 with 16-byte x rows on
//                     warpgroup mmas (projection/backward/dphi_wgmma.cu), else
//                     on mma.sync tiles (projection/backward/dphi_mma.cu).
// x is read twice (once per kernel) instead of once: at these N the
// products, not the bytes, set the time.
//
// A first pass rounds dh and phi' (times gamma) to tf32 (IEEE: high and low
// parts) once, into scratch laid out for the mma fragments: logits padded
// to kLogitPad with zeros, dh as [M][Np] and phi' as [K][Np] with the
// logits of each group of 8 interleaved (q, q + 4 adjacent, so a lane's two
// k slots are one 8-byte load), dh also as [Np][Mp] for dphi (tokens in
// order, or for the wgmma kernel placed by WgmmaTokenPosition). The GEMM
// kernels then stage those with cp.async and feed the mma straight from
// shared memory; 16-bit x converts to tf32 exactly, fp32 x is rounded (or
// split) as it leaves shared memory.
//
// Determinism / batch invariance: a token's dx sums its logits in blocks of
// kLogitBlock in order, each block in the mma's fixed order, independent of
// M and of the token's slot in the tile. dphi partials are per (chunk,
// column, logit), each a fixed sum over the chunk's tokens, reduced over
// chunks in order by LaunchPhiGradReduce. No atomics.
#include <algorithm>
#include <cstdint>

#include "common.cuh"
#include "dispatch.cuh"
#include "primitives/kernel_fit.h"
#include "primitives/stage_pipeline.cuh"
#include "primitives/wgmma.cuh"
#include "projection/backward/dphi_mma.h"
#include "projection/backward/dphi_wgmma.h"
#include "projection/backward/mma_tiles.cuh"
#include "projection/backward/ms_term.cuh"
#include "projection/backward/wide.h"
#include "projection/backward/wide_terms.cuh"
#include "projection/forward/mma.cuh"

namespace mhc::cuda {
namespace {

using dx_mma::SplitTf32;

constexpr int kWideThreads = 256;  // 8 warps
constexpr int kLogitPad = 32;      // logits padded to a multiple of this
constexpr int kMaxParts = 2;       // tf32 high part, and low part (IEEE)

int PaddedLogits(const LayerSpec& spec) {
  return static_cast<int>((spec.NumLogits() + kLogitPad - 1) / kLogitPad *
                          kLogitPad);
}
// Whole groups of 8 (WgmmaTokenPosition).
int64_t PaddedTokens(int64_t tokens) { return (tokens + 7) / 8 * 8; }

// Position of logit g's value inside its group of 8: q and q + 4 adjacent.
__device__ __forceinline__ int Interleaved(int g) {
  const int q = g & 7;
  return (g & ~7) | (q < 4 ? 2 * q : 2 * (q - 4) + 1);
}
// The logit whose value sits at position p.
__device__ __forceinline__ int Deinterleaved(int p) {
  const int e = p & 7;
  return (p & ~7) | ((e & 1) ? 4 + (e >> 1) : e >> 1);
}

// The rounded operands: high parts, and low parts under IEEE (else null).
struct Rounded {
  float* dh[kMaxParts];     // [M][Np], logits interleaved
  float* dh_t[kMaxParts];   // [Np][Mp]
  float* phi_t[kMaxParts];  // [K][Np], logits interleaved
};

struct WideDev {
  Rounded op;
  int Np;
  int64_t Mp;
  const float* dms;
  const float* h_pre;  // null without the aggregate term
  const void* dy;
  const float* terms;  // both terms of the chunk's columns, or null
  ChannelChunk chunk;  // the columns of a dx launch
  void* dx;
};

// The parts laid out as the plan's workspace says: each part's dh, dh^T and
// phi'^T in turn.
Rounded RoundedIn(void* scratch, const ProjectionBackwardWorkspaceLayout& w) {
  char* at = static_cast<char*>(scratch);
  Rounded r{};
  for (int part = 0; part < w.parts; ++part) {
    r.dh[part] = reinterpret_cast<float*>(at);
    r.dh_t[part] = reinterpret_cast<float*>(at + w.part_dh);
    r.phi_t[part] = reinterpret_cast<float*>(at + w.part_dh + w.part_dh_t);
    at += w.part_dh + w.part_dh_t + w.part_phi_t;
  }
  return r;
}

// -------------------------------------------------------- rounding --
// A 32 x 32 tile per CTA, transposed through shared memory so that both the
// reads and the writes run along rows.
constexpr int kRoundTile = 32;

// kWgmmaTokens: dh^T rows in the token order of the wgmma dphi kernel.
template <bool kIeee, bool kWgmmaTokens>
__global__ void __launch_bounds__(kWideThreads)
    round_dh_kernel(int64_t tokens, int N, int Np, int64_t Mp, const float* dh,
                    Rounded out) {
  WaitForPrerequisiteGrid();  // dh; the scratch's previous readers
  constexpr int kParts = kIeee ? 2 : 1;
  __shared__ float tile[kMaxParts][kRoundTile][kRoundTile + 1];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int g0 = blockIdx.x * kRoundTile;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kRoundTile;
  for (int t = ty; t < kRoundTile; t += kWideThreads / 32) {
    const int64_t m = m0 + t;
    const int g = g0 + tx;
    const float v = m < tokens && g < N ? dh[m * N + g] : 0.0f;
    uint32_t part[2];
    SplitTf32<kIeee>(v, part[0], part[1]);
    for (int p = 0; p < kParts; ++p) {
      tile[p][t][tx] = __uint_as_float(part[p]);
      if (m < tokens) out.dh[p][m * Np + Interleaved(g)] = tile[p][t][tx];
    }
  }
  __syncthreads();
  for (int gl = ty; gl < kRoundTile; gl += kWideThreads / 32) {
    const int64_t m = m0 + tx;
    if (m >= Mp) continue;
    const int64_t at = kWgmmaTokens ? WgmmaTokenPosition(m) : m;
    for (int p = 0; p < kParts; ++p) {
      out.dh_t[p][(g0 + gl) * Mp + at] = tile[p][tx][gl];
    }
  }
}

template <bool kIeee>
__global__ void __launch_bounds__(kWideThreads)
    round_phi_kernel(DevSpec s, int Np, const float* phi, const float* gamma,
                     Rounded out) {
  WaitForPrerequisiteGrid();  // the scratch's previous readers
  constexpr int kParts = kIeee ? 2 : 1;
  __shared__ float tile[kMaxParts][kRoundTile][kRoundTile + 1];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * kRoundTile;
  const int g0 = blockIdx.y * kRoundTile;
  for (int gl = ty; gl < kRoundTile; gl += kWideThreads / 32) {
    const int g = g0 + gl;
    const int64_t k = k0 + tx;
    float v = 0.0f;
    if (g < s.N && k < s.K) {
      v = phi[g * s.K + k];
      if (gamma != nullptr) v *= gamma[k];
    }
    uint32_t part[2];
    SplitTf32<kIeee>(v, part[0], part[1]);
    for (int p = 0; p < kParts; ++p) {
      tile[p][gl][tx] = __uint_as_float(part[p]);
    }
  }
  __syncthreads();
  for (int kl = ty; kl < kRoundTile; kl += kWideThreads / 32) {
    const int64_t k = k0 + kl;
    if (k >= s.K) continue;
    for (int p = 0; p < kParts; ++p) {
      out.phi_t[p][k * Np + g0 + tx] = tile[p][Deinterleaved(tx)][kl];
    }
  }
}

// ---------------------------------------------------------------- dx --
// A CTA owns kDxTokens tokens x kDxCols columns of a channel chunk (all
// channels but with the residual term; ChunkColumnK maps them to runs of
// K). A stage is one block of kLogitBlock logits of the rounded dh rows and
// phi' columns. kWgmma (TF32 with at least kWgmmaDxBlocks blocks):
// warpgroup wg owns the 64 tokens 64 wg.. and every column, one
// wgmma.m64n128k8 per 8 logits, both operands in the 128-byte swizzle
// (primitives/wgmma.cuh; a block's 32 logits are one 128-byte row), which
// permutes neither operand's logits apart. Otherwise warp (wt, wc) owns the 64
// tokens 64 wt.. and the 32 columns 32 wc.. (4 x 4 mma.sync tiles; IEEE three
// products per tile).
constexpr int kDxTokens = 128;
constexpr int kDxCols = 128;
constexpr int kLogitBlock = 32;
// 8 mod 32 words: the lanes' 8-byte fragment loads (rows grp, words
// 2 quad) are conflict free; so are the output tile's float2 stores.
constexpr int kFragStride = kLogitBlock + 8;
constexpr int kOutStride = kDxCols + 8;
// Fewer logit blocks than this measured faster on mma.sync tiles (n = 6:
// 2 blocks, n = 9: 4; n = 16, 9 blocks, gained on wgmma).
constexpr int kWgmmaDxBlocks = 6;
static_assert(proj::kLogitPad == kLogitPad &&
                  proj::kLogitBlock == kLogitBlock &&
                  proj::kWgmmaDxBlocks == kWgmmaDxBlocks,
              "the plan's geometry is the kernel's");
template <bool kWgmma>
inline constexpr int kDxStages = kWgmma ? 3 : 2;
// Floats per operand row: a swizzled row, or padded for the fragment loads.
template <bool kWgmma>
inline constexpr int kDxRowFloats = kWgmma ? kLogitBlock : kFragStride;
template <bool kIeee, bool kWgmma>
constexpr int DxStageFloats() {
  return (kIeee ? 2 : 1) * (kDxTokens + kDxCols) * kDxRowFloats<kWgmma>;
}
// The wgmma tiles start on a swizzle atom, aligned up to one in-kernel.
template <bool kIeee, bool kWgmma>
constexpr int DxSmemBytes() {
  return kDxStages<kWgmma> * DxStageFloats<kIeee, kWgmma>() * 4 +
         (kWgmma ? kSwizzleAtomBytes : 0);
}
template <bool kIeee, bool kWgmma>
constexpr bool OutTileFits() {
  return kDxTokens * kOutStride <=
         kDxStages<kWgmma> * DxStageFloats<kIeee, kWgmma>();
}
static_assert(OutTileFits<false, false>() && OutTileFits<true, false>() &&
                  OutTileFits<false, true>(),
              "the output tile reuses the stages");
static_assert(kDxTokens * kLogitBlock * 4 % kSwizzleAtomBytes == 0,
              "the phi' tile starts on an atom");

// Column j of the chunk's tile `tile`: its flat k, -1 past the chunk.
__device__ __forceinline__ int64_t WideColumn(const DevSpec& s,
                                              ChannelChunk chunk, int64_t tile,
                                              int j) {
  const int col = static_cast<int>(tile) * kDxCols + j;
  return col < s.n * chunk.width ? ChunkColumnK(s, chunk, col) : -1;
}
static_assert(kDxTokens == kDxCols, "a thread copies the same rows of both");
constexpr int kCopyRows = kDxTokens * 8 / kWideThreads;  // rows per thread

// The aggregate term H_pre dy of elements k .. k + V - 1 of token m, as
// products to add. Stream major: one stream's consecutive channels; minor:
// one element at a time (consecutive k cross streams).
template <typename T, int V>
__device__ __forceinline__ void AggregateTerm(const DevSpec& s,
                                              const WideDev& a, int64_t m,
                                              int64_t k, float (&out)[V]) {
  const T* dy = static_cast<const T*>(a.dy) + m * s.C;
  const float* h = a.h_pre + m * s.n;
  if (!s.minor) {
    LoadVec<T, V>(dy + k % s.C, out);
    const float hk = h[k / s.C];
#pragma unroll
    for (int e = 0; e < V; ++e) out[e] *= hk;
    return;
  }
#pragma unroll
  for (int e = 0; e < V; ++e) {
    out[e] = h[(k + e) % s.n] * ToFloat(dy[(k + e) / s.n]);
  }
}

template <typename T, bool kIeee, bool kVector, bool kWgmma>
__global__ void __launch_bounds__(kWideThreads, kIeee ? 1 : 2)
    wide_dx_kernel(DevSpec s, int64_t tokens, const T* __restrict__ x,
                   WideDev a) {
  WaitForPrerequisiteGrid();  // the rounded operands and the terms
  static_assert(!(kIeee && kWgmma), "the wgmma form is TF32's");
  extern __shared__ __align__(16) float wide_dx_smem[];
  constexpr int kParts = kIeee ? 2 : 1;
  constexpr int kStages = kDxStages<kWgmma>;
  constexpr int RF = kDxRowFloats<kWgmma>;
  float* wide_smem = kWgmma ? AtomAligned(wide_dx_smem) : wide_dx_smem;
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int grp = lane >> 2;
  const int quad = lane & 3;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kDxTokens;
  const int64_t tile = blockIdx.y;
  const int rows =
      static_cast<int>(min(static_cast<int64_t>(kDxTokens), tokens - m0));
  const int blocks = a.Np / kLogitBlock;
  // This thread's 16-byte piece of rows copy_row + 32 r of each tile, and
  // the k of those columns.
  const int copy_row = tid >> 3;
  const int piece = (tid & 7) * 4;
  int col_k[kCopyRows];  // K < 2^31 (the plan)
#pragma unroll
  for (int r = 0; r < kCopyRows; ++r) {
    col_k[r] = static_cast<int>(
        WideColumn(s, a.chunk, tile, copy_row + r * (kWideThreads / 8)));
  }

  // Stage tiles: [part][dh rows | phi' columns][RF]; the wgmma tiles'
  // 16-byte chunk c of row r at c ^ (r % 8), which the copy rows 32 apart
  // share.
  auto dh_tile = [&](int buf, int part) {
    return wide_smem + buf * DxStageFloats<kIeee, kWgmma>() +
           part * (kDxTokens + kDxCols) * RF;
  };
  const int piece_at = kWgmma ? ((tid & 7) ^ (copy_row & 7)) * 4 : piece;
  auto load_stage = [&](int b) {
    if (b >= blocks) return;
    const int g0 = b * kLogitBlock + piece;
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
      float* dhs = dh_tile(b % kStages, p) + copy_row * RF + piece_at;
      float* phs = dhs + kDxTokens * RF;
#pragma unroll
      for (int r = 0; r < kCopyRows; ++r) {
        const int row = copy_row + r * (kWideThreads / 8);
        const int offset = r * (kWideThreads / 8) * RF;
        const bool token = row < rows;
        CpAsync<16>(dhs + offset,
                    token ? a.op.dh[p] + (m0 + row) * a.Np + g0 : a.op.dh[p],
                    token);
        const bool column = col_k[r] >= 0;
        CpAsync<16>(
            phs + offset,
            column ? a.op.phi_t[p] + static_cast<int64_t>(col_k[r]) * a.Np + g0
                   : a.op.phi_t[p],
            column);
      }
    }
  };

  // The products through shared memory, so that each thread finishes whole
  // vectors of one row: 16-byte loads of x and stores of dx.
  float* out_tile = wide_smem;
  if constexpr (!kWgmma) {
    const int wt = warp >> 2;  // 64-token half
    const int wc = warp & 3;   // 32-column quarter
    float acc[4][4][4];
    ZeroFill(acc);
    // A fragment of (mt, kt): rows 64 wt + 16 mt + grp (+8), logits 8 kt +
    // quad (+4) at words 2 quad, 2 quad + 1. B of (kt, nt): column 32 wc +
    // 8 nt + grp, the same logits.
    const int a_off = (wt * 64 + grp) * kFragStride + 2 * quad;
    const int b_off = (kDxTokens + wc * 32 + grp) * kFragStride + 2 * quad;

    Pipeline<kStages>(blocks, load_stage, [&](int b) {
#pragma unroll
      for (int kt = 0; kt < kLogitBlock / 8; ++kt) {
        uint32_t af[kParts][4][4];
        uint32_t bf[kParts][4][2];
#pragma unroll
        for (int p = 0; p < kParts; ++p) {
          const float* tile = dh_tile(b % kStages, p) + kt * 8;
#pragma unroll
          for (int mt = 0; mt < 4; ++mt) {
            const float2 top = *reinterpret_cast<const float2*>(
                tile + a_off + mt * 16 * kFragStride);
            const float2 bottom = *reinterpret_cast<const float2*>(
                tile + a_off + (mt * 16 + 8) * kFragStride);
            af[p][mt][0] = __float_as_uint(top.x);
            af[p][mt][1] = __float_as_uint(bottom.x);
            af[p][mt][2] = __float_as_uint(top.y);
            af[p][mt][3] = __float_as_uint(bottom.y);
          }
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const float2 v = *reinterpret_cast<const float2*>(
                tile + b_off + nt * 8 * kFragStride);
            bf[p][nt][0] = __float_as_uint(v.x);
            bf[p][nt][1] = __float_as_uint(v.y);
          }
        }
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            Mma1688(acc[mt][nt], af[0][mt], __uint_as_float(bf[0][nt][0]),
                    __uint_as_float(bf[0][nt][1]));
            if constexpr (kIeee) {
              Mma1688(acc[mt][nt], af[1][mt], __uint_as_float(bf[0][nt][0]),
                      __uint_as_float(bf[0][nt][1]));
              Mma1688(acc[mt][nt], af[0][mt], __uint_as_float(bf[1][nt][0]),
                      __uint_as_float(bf[1][nt][1]));
            }
          }
        }
      }
    });
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        float* p = out_tile + (wt * 64 + mt * 16 + grp) * kOutStride + wc * 32 +
                   nt * 8 + 2 * quad;
        *reinterpret_cast<float2*>(p) =
            make_float2(acc[mt][nt][0], acc[mt][nt][1]);
        *reinterpret_cast<float2*>(p + 8 * kOutStride) =
            make_float2(acc[mt][nt][2], acc[mt][nt][3]);
      }
    }
  } else {
    const int wg = warp >> 2;  // 64-token half
    const uint64_t a_desc0 =
        SwizzledDescriptor(dh_tile(0, 0) + wg * 64 * kLogitBlock);
    const uint64_t b_desc0 =
        SwizzledDescriptor(dh_tile(0, 0) + kDxTokens * kLogitBlock);
    float acc[kDxCols / 2];
#pragma unroll
    for (int i = 0; i < kDxCols / 2; ++i) acc[i] = 0.0f;
    Pipeline<kStages, true>(blocks, load_stage, [&](int b) {
      const int at = (b % kStages) * DxStageFloats<false, true>() * 4;
      WgmmaFence();
#pragma unroll
      for (int step = 0; step < kLogitBlock / 8; ++step) {
        WgmmaTf32<kDxCols>(acc, DescriptorPlus(a_desc0, at + 32 * step),
                           DescriptorPlus(b_desc0, at + 32 * step));
      }
      WgmmaCommit();
      WgmmaWait<0>();
    });
    __syncthreads();
    // Accumulators i, i + 1: token 64 wg + 16 (warp % 4) + grp (+ 8),
    // columns 8 (i / 4) + 2 quad and + 1.
#pragma unroll
    for (int i = 0; i < kDxCols / 2; i += 2) {
      const int t = 64 * wg + 16 * (warp & 3) + grp + 8 * ((i >> 1) & 1);
      *reinterpret_cast<float2*>(out_tile + t * kOutStride + 8 * (i >> 2) +
                                 2 * quad) = make_float2(acc[i], acc[i + 1]);
    }
  }
  __syncthreads();

  const float ms_scale = 2.0f / static_cast<float>(s.K);
  T* dx = static_cast<T*>(a.dx);
  constexpr int V = kVector ? 16 / static_cast<int>(sizeof(T)) : 1;
  constexpr int kPerRow = kDxCols / V;
  constexpr int kBatch = 4;
  static_assert(kDxTokens * kPerRow % (kBatch * kWideThreads) == 0,
                "whole batches");
  const int64_t columns = s.n * a.chunk.width;
  const bool aggregate = a.terms == nullptr && a.h_pre != nullptr;
  for (int first = tid; first < kDxTokens * kPerRow;
       first += kBatch * kWideThreads) {
    // Every load of a batch before its stores, which the compiler may not
    // move loads across (dx could alias them as far as it knows): the
    // epilogue waits on memory once per batch, not per vector.
    int64_t k[kBatch];
    float v[kBatch][V], term[kBatch][V];
    MsTerm dm[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int idx = first + u * kWideThreads;
      const int t = idx / kPerRow;
      // kVector: a vector's columns are consecutive k (ChunkColumnK).
      k[u] = t < rows ? WideColumn(s, a.chunk, tile, idx % kPerRow * V) : -1;
      if (k[u] < 0) continue;
      const int64_t m = m0 + t;
      dm[u] = MsTermOf(a.dms[m], ms_scale);
      LoadVec<T, V>(x + m * s.K + k[u], v[u]);
      if (a.terms != nullptr) {
        LoadTerms<V>(a.terms + m * columns + tile * kDxCols + idx % kPerRow * V,
                     term[u]);
      } else if (aggregate) {
        AggregateTerm<T, V>(s, a, m, k[u], term[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (k[u] < 0) continue;
      const int idx = first + u * kWideThreads;
      const int t = idx / kPerRow;
      const int j = idx % kPerRow * V;
      float out[V];
      dm[u].With([&](auto add) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          out[e] = add(v[u][e], out_tile[t * kOutStride + j + e]);
        }
      });
      if (a.terms != nullptr || aggregate) {
#pragma unroll
        for (int e = 0; e < V; ++e) out[e] += term[u][e];
      }
      StoreVec<T, V>(dx + (m0 + t) * s.K + k[u], out);
    }
  }
}

template <bool kIeee>
cudaError_t LaunchRounding(const DevSpec& s, int64_t tokens, const float* phi,
                           const float* gamma, const float* dh,
                           bool wgmma_tokens, const WideDev& d,
                           cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  DispatchBool(wgmma_tokens, [&](auto tag) {
    err = LaunchAfterPrevious(
        round_dh_kernel<kIeee, decltype(tag)::value>,
        dim3(GridSize(d.Np / kRoundTile),
             GridSize((tokens + kRoundTile - 1) / kRoundTile)),
        dim3(kWideThreads), 0, stream, tokens, s.N, d.Np, d.Mp, dh, d.op);
  });
  if (err != cudaSuccess) return err;
  return LaunchAfterPrevious(round_phi_kernel<kIeee>,
                             dim3(GridSize((s.K + kRoundTile - 1) / kRoundTile),
                                  GridSize(d.Np / kRoundTile)),
                             dim3(kWideThreads), 0, stream, s, d.Np, phi, gamma,
                             d.op);
}

template <typename T, bool kIeee, bool kVector, bool kWgmma>
cudaError_t LaunchDx(const DevSpec& s, int64_t tokens, const T* x,
                     const WideDev& d, cudaStream_t stream) {
  // Token tiles vary fastest, so the CTAs resident together share columns
  // and read the same phi' rows from L2; dh stays in L2 throughout.
  const int64_t tiles = (s.n * d.chunk.width + kDxCols - 1) / kDxCols;
  return LaunchLargeSmem(
      wide_dx_kernel<T, kIeee, kVector, kWgmma>,
      dim3(GridSize((tokens + kDxTokens - 1) / kDxTokens), GridSize(tiles)),
      kWideThreads, DxSmemBytes<kIeee, kWgmma>(), stream, s, tokens, x, d);
}

}  // namespace

absl::Status LaunchWideDxAndPhiPartials(const DxArgs& a,
                                        const ProjectionBackwardPlan& plan,
                                        cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*a.spec);
  const bool ieee = a.spec->matmul_precision == MatmulPrecision::kIeee;
  const bool residual = a.r != nullptr;
  const ProjectionBackwardWorkspaceLayout& w = plan.workspace;
  WideDev d;
  d.op = RoundedIn(a.wide_scratch, w);
  d.Np = PaddedLogits(*a.spec);
  d.Mp = PaddedTokens(a.tokens);
  d.dms = a.dms;
  d.h_pre = a.h_pre;
  d.dy = a.dy;
  d.chunk = {0, s.C};
  d.dx = a.dx;
  // The residual path's terms follow the rounded operands.
  float* terms =
      residual ? reinterpret_cast<float*>(static_cast<char*>(a.wide_scratch) +
                                          w.wide_scratch - w.terms)
               : nullptr;
  d.terms = terms;
  // With the residual term, chunks of channels (its terms summed apart
  // first); otherwise every column at once.
  const int64_t width = residual ? TermsChunkChannels(s.C) : s.C;
  // 16-byte vectors of x rows; for dx also of dx, and of dy for the
  // aggregate term (the plan's).
  const bool vector_x = plan.vector_x;
  const bool vector_dx = plan.vector_dx;
  // dphi on warpgroup mmas (TF32 with vector x rows), dx there too past a
  // few logit blocks: the plan's variants.
  const bool wgmma_dphi = plan.dphi == ProjectionDphiVariant::kWgmmaWide;
  const bool wgmma_dx = plan.variant == ProjectionBackwardVariant::kWgmmaWide;
  const float* gamma = s.has_gamma ? a.gamma : nullptr;
  cudaError_t err = cudaSuccess;
  DispatchDType(a.act_dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    const T* x = static_cast<const T*>(a.x);
    DispatchBool(ieee, [&](auto ieee_tag) {
      constexpr bool kIeee = decltype(ieee_tag)::value;
      err = LaunchRounding<kIeee>(s, a.tokens, a.phi, gamma, a.dh, wgmma_dphi,
                                  d, stream);
      for (int64_t begin = 0; begin < s.C && err == cudaSuccess;
           begin += width) {
        d.chunk = {begin, std::min(width, s.C - begin)};
        if (residual) {
          err = LaunchDxTerms(s, a.tokens, a.act_dtype, d.chunk, a.h_pre, a.dy,
                              a.r, a.dx_next, terms, stream);
          if (err != cudaSuccess) return;
        }
        DispatchBool(vector_dx, [&](auto vector_tag) {
          constexpr bool kVector = decltype(vector_tag)::value;
          if (wgmma_dx) {
            err = LaunchDx<T, false, kVector, true>(s, a.tokens, x, d, stream);
          } else {
            err = LaunchDx<T, kIeee, kVector, false>(s, a.tokens, x, d, stream);
          }
        });
      }
    });
  });
  if (err == cudaSuccess && a.dphi_partial != nullptr) {
    const int chunk_tokens = static_cast<int>(w.phi_chunk_tokens);
    // The mma.sync kernel: IEEE, or TF32 with x rows off 16 bytes.
    err = wgmma_dphi
              ? LaunchWgmmaPhiPartials(s, a.tokens, chunk_tokens, a.act_dtype,
                                       a.x, d.op.dh_t[0], d.Mp, d.Np,
                                       a.dphi_partial, stream)
              : LaunchMmaPhiPartials(s, a.tokens, chunk_tokens, a.act_dtype,
                                     ieee, a.x, vector_x, d.op.dh_t, d.Mp, d.Np,
                                     a.dphi_partial, stream);
  }
  MHC_CUDA_RETURN_IF_ERROR(
      err, absl::StrCat("projection backward ", ToString(plan.variant)),
      LaunchShape(*a.spec, a.tokens, a.act_dtype));
  return absl::OkStatus();
}

}  // namespace mhc::cuda
