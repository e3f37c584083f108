// Tile geometry, shared-memory plan and fragment helpers of the tensor-core
// dx / dphi kernel (projection/backward/mma.cuh): a CTA's 128 columns of K
// and their streams and channels, the staged rows' strides and pads, the dh
// fragment layouts, and the aggregate / residual terms of an output pair.
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MMA_TILES_CUH_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MMA_TILES_CUH_

#include <cuda.h>

#include <cstdint>

#include "common.cuh"
#include "projection/forward/mma.cuh"
#include "projection/plan.h"
#include "projection/run_maps.h"

// Named, since kCols and kThreads mean this kernel's tiles only.
namespace mhc::cuda::dx_mma {

constexpr int kCols = 128;                    // columns of K per CTA
constexpr int kStageTokens = 32;              // tokens per pipeline stage
constexpr int kThreads = 256;                 // 8 warps x 16 columns
constexpr int kMaxSmemPerBlock = 227 * 1024;  // sm_90 opt-in limit
// Logit tiles of 8 the kernel is built for: N <= 8, N <= 24 (n <= 4 layers,
// heads up to n = 16) and N <= 80 (n = 8 layers). Up to 24 logits two CTAs
// share an SM; the n = 8 build keeps 80 phi' columns and dphi rows in
// registers and runs one CTA per SM.
constexpr int kMaxTiles = 10;
__host__ __device__ constexpr int TilesFor(int N) {
  return N <= 8 ? 1 : N <= 24 ? 3 : 10;
}
constexpr int kDphiGroupTiles = 5;  // dphi tiles accumulated per pass (n = 8)
// dh of the current stage, rounded to tf32 once for all warps and laid out
// as the mma fragments themselves, so a warp's operand is one conflict-free
// vector load per lane: the dx product's A as [mt][kt][lane][4] (tokens
// 16 mt + grp (+8), logits 8 kt + quad (+4)), the dphi product's B as
// [half][step][nt][lane][2] (tokens 16 half + 8 step + 2 quad (+1), logit
// 8 nt + grp).
__host__ __device__ constexpr int DhAFloats(int nt) {
  return kStageTokens / 16 * nt * 32 * 4;
}
__host__ __device__ constexpr int DhBFloats(int nt) {
  return kStageTokens / 8 * nt * 32 * 2;
}
static_assert(kTokenChunk % kStageTokens == 0, "stages tile a chunk");

// The thread that issues the first copy of each per-stage run, so the warps
// issue about as many copies each and meet at the barrier together. At n = 4
// (bf16, 24 logits): dh 192 copies on warps 0-5, R 128 on warps 6, 7, 0, 1,
// dy 128 on 2-5, H_pre 32 on 6, dms 8 on 7; of the dh fragments, the A
// fragments on warps 0-5 and the B fragments' second pass on 6, 7, 0, 1.
struct FirstThread {
  static constexpr int kDh = 0, kR = 192, kDy = 64, kHPre = 192, kDms = 224;
  static constexpr int kDhB = 192;
};

// Elements of one staged activation row: 128 columns plus a pad that makes
// the ldmatrix rows (16-bit: the stride is 16 mod 128 bytes times an odd
// number) and the fp32 fragment loads bank-conflict free. A 16-bit row's pad
// also holds the extra word of each stream run of unaligned slot copies:
// n = 8 layers (the widest tiles) get 12 words, the rest 4.
template <typename T>
__host__ __device__ constexpr int RowStride(int nt) {
  return sizeof(T) == 4 ? kCols + 4 : nt == kMaxTiles ? kCols + 24 : kCols + 8;
}
// Stream runs per staged row whose extra words the pad holds (16-bit).
template <typename T>
__host__ __device__ constexpr int PadRuns(int nt) {
  return (RowStride<T>(nt) - kCols) * static_cast<int>(sizeof(T)) / 4;
}

// How the kernel stages activation rows (x, dx_next, dy) and stores dx: the
// plan's choice.
using RowCopy = DxRowCopy;

struct MmaDxDev {
  const float* phi;
  const float* gamma;  // null without gamma
  const float* dh;
  const float* dms;
  const float* h_pre;   // null without the aggregate term
  const void* dy;       // with h_pre
  const float* r;       // null without the residual term
  const void* dx_next;  // with r
  void* dx;
  float* dphi_partial;  // null: no parameter gradients
  RowCopy copy;
  // 16-byte copies of the per-token float runs (dh, dms, H_pre, R): their
  // bases are 16-byte aligned, and so is every stage's run (32 tokens on).
  bool runs16;
  int apart_tokens = 0;  // the plan's dx_apart_tokens
  // Set per launch: tokens per CTA (kTokenChunk wherever dphi partials are
  // written, a multiple of kStageTokens), and the dphi-only pass.
  int token_chunk = kTokenChunk;
  bool skip_dx = false;
};

// Launches the kernel for T activations (projection/backward/
// mma_launch.cuh, built by backward/mma_<dtype>.cu).
template <typename T>
cudaError_t LaunchDxMmaFor(const DevSpec& s, int64_t tokens, const void* x,
                           const MmaDxDev& d, bool ieee, cudaStream_t stream);

// Elements per staged dy row: the tile's 128 / n channels plus a 16-byte
// pad.
template <typename T>
__host__ __device__ constexpr int DyRow(int n) {
  return kCols / n + 16 / static_cast<int>(sizeof(T));
}

// Byte offsets of one CTA's shared memory, all stages of each buffer
// together. Depends on n (the dy tile is 128 / n channels wide) and on
// which of the aggregate (dy, h_pre) and residual (dx_next, r) terms are
// staged.
struct SmemPlan {
  int land, x, dxn, dy, dh_raw, dh_a, dh_b, dms, hp, r, terms, bars, total;
  int dy_row;  // elements per staged dy row
};

constexpr int kTermsStride = proj::kDxTermsStride;  // floats a summed row

// The tensor-copy build (n = 4, stream major, 16-bit, both terms summed):
// every per-stage tile and run lands by the tensor memory accelerator, so a
// stage is nine copies by one thread instead of every thread's 16-byte
// copies, which cost the shared-memory pipe several times their ideal
// wavefronts (each warp's copy gathered eight 64-byte runs). An activation
// tile (x, dx_next) is a [stream][token][32 channels] box in the 64-byte
// swizzle: 16-byte chunk q of token t's run sits at chunk q ^ (t / 2 % 4),
// so any eight consecutive tokens of one chunk fall on distinct banks. dy
// lands as dense 64-byte rows, the float runs as they are in memory.
// Needs the smem base on the swizzle's 512-byte repeat: the plan reserves
// an atom for the kernel to align it.
inline constexpr int kTileAlignBytes = 1024;
// Element offset of (token row, tile column j) in a 16-bit staged tile.
template <bool kSwizzled, int kRowStride>
__device__ __forceinline__ int TileOffset(int row, int j) {
  if constexpr (kSwizzled) {
    constexpr int kWc = kCols / 4;  // channels per stream run
    const int chunk = (j % kWc / 8) ^ (row / 2 % 4);
    return j / kWc * (kStageTokens * kWc) + row * kWc + chunk * 8 + j % 8;
  } else {
    return row * kRowStride + j;
  }
}

// The tensor-copy build's maps (EncodeDxTensorMaps in mma.cuh): the
// activation tiles as 3-d boxes {32 channels, 32 tokens, 4 streams}, dy as
// {32 channels, 32 tokens}, dh, H_pre and R as {width, 32 tokens}, dms as
// {32 tokens}. The n = 4 layer's logits: 4 + 4 + 16.
inline constexpr int kSummedLogits = 24;
struct DxTensorMaps {
  CUtensorMap x, dx_next, dy, dh, dms, h_pre, r;
};

// The run-map build (16-bit rows off 16 bytes, projection/run_maps.h): the
// activations' maps per residue of their row groups (x and dx_next rows of
// 4 C: 1 or 2; dy rows of C: up to 8), each box a run of 32 channels and
// the 16 bytes before it, landed as rows of proj::kDxLandElems. The float
// runs as in DxTensorMaps.
inline constexpr int kMaxActGroup = 2, kMaxDyGroup = 8;
struct DxRunMaps {
  CUtensorMap x[kMaxActGroup], dx_next[kMaxActGroup], dy[kMaxDyGroup];
  CUtensorMap dh, dms, h_pre, r;
};

// kSummedTerms: the build that sums a stage's terms ahead, on a ring of
// proj::DxStages. kTensorCopies: its tensor-copy build (dense tiles, the
// ring's barriers, an alignment atom). kRunMaps: its run-map build, whose
// ring holds the landed rows of x, dx_next and dy, and which shifts x into
// one dense tile (the terms read dx_next and dy where they landed).
template <typename T, bool kSummedTerms, bool kTensorCopies = false,
          bool kRunMaps = false>
__host__ __device__ constexpr SmemPlan PlanSmem(int n, int N, bool ieee,
                                                bool aggregate, bool residual) {
  SmemPlan p{};
  constexpr bool kTma = kTensorCopies || kRunMaps;
  constexpr int stages = proj::DxStages(kSummedTerms, kRunMaps);
  const int row = kTma ? kCols : RowStride<T>(TilesFor(N));
  const int xb = (kRunMaps ? 1 : stages) * kStageTokens * row * sizeof(T);
  p.dy_row = kTma ? kCols / n : DyRow<T>(n);
  int at = 0;
  p.land = at;
  at += kRunMaps ? stages * proj::kDxLandStageBytes : 0;
  p.x = at;
  at += xb;
  p.dxn = at;
  at += residual && !kRunMaps ? xb : 0;
  p.dy = at;
  at +=
      aggregate && !kRunMaps ? stages * kStageTokens * p.dy_row * sizeof(T) : 0;
  p.dh_raw = at;
  at += stages * kStageTokens * N * 4;  // a multiple of 16 bytes
  const int copies = ieee ? 2 : 1;      // tf32 high (and low) parts
  const int nt = TilesFor(N);
  p.dh_a = at;
  at += copies * DhAFloats(nt) * 4;
  p.dh_b = at;
  at += copies * DhBFloats(nt) * 4;
  p.dms = at;
  at += stages * kStageTokens * 4;
  p.hp = at;
  at += aggregate ? stages * kStageTokens * n * 4 : 0;
  p.r = at;
  at += residual ? stages * kStageTokens * n * n * 4 : 0;
  p.terms = at;
  at += kSummedTerms ? kStageTokens * kTermsStride * 4 : 0;
  p.bars = at;
  at += kTma ? stages * 8 : 0;
  p.total = at + (kTma ? kTileAlignBytes : 0);
  return p;
}

__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4],
                                                const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(a));
}

// The two 16-bit values of a packed pair as floats (low half first).
__device__ __forceinline__ float2 Unpack(uint32_t u, __nv_bfloat16) {
  return make_float2(__uint_as_float(u << 16),
                     __uint_as_float(u & 0xffff0000u));
}
__device__ __forceinline__ float2 Unpack(uint32_t u, __half) {
  return __half22float2(*reinterpret_cast<const __half2*>(&u));
}

template <typename T>
__device__ __forceinline__ float2 LoadPair(const T* p) {
  if constexpr (sizeof(T) == 4) {
    return *reinterpret_cast<const float2*>(p);
  } else {
    return Unpack(*reinterpret_cast<const uint32_t*>(p), T{});
  }
}

// tf32 high part, and the low part when split (IEEE).
template <bool kSplit>
__device__ __forceinline__ void SplitTf32(float v, uint32_t& hi, uint32_t& lo) {
  const float h = RoundTf32(v);
  hi = __float_as_uint(h);
  if constexpr (kSplit) lo = __float_as_uint(RoundTf32(v - h));
}

// 16-bit x from the lane's ldmatrix row: token (lane & 7) + 8 (mat >> 1)
// and column (mat & 1) * 8 of the 16 x 16 block, mat = lane >> 3.
template <typename T>
__device__ __forceinline__ void LoadXTransposedAt(const T* lane_row,
                                                  uint32_t (&hi)[2][4]) {
  static_assert(sizeof(T) == 2, "ldmatrix of 16-bit rows");
  uint32_t r[4];
  LdMatrixX4Trans(r, lane_row);
#pragma unroll
  for (int step = 0; step < 2; ++step) {
    const float2 c = Unpack(r[2 * step], T{});
    const float2 d = Unpack(r[2 * step + 1], T{});
    hi[step][0] = __float_as_uint(c.x);
    hi[step][1] = __float_as_uint(d.x);
    hi[step][2] = __float_as_uint(c.y);
    hi[step][3] = __float_as_uint(d.y);
  }
}

// The tf32 A fragments of x^T (dphi^T = x^T dh) for the two k steps of 16
// staged tokens, rows row0.. of a tile of `stride` elements per row, columns
// col.. col + 15 (col + grp and + 8 per lane). 16-bit x goes through
// ldmatrix.trans, which hands each lane tokens 2 quad and 2 quad + 1: they
// are the mma's k slots quad and quad + 4, for the B operand as well. fp32
// x is rounded, or split into lo as well under kSplit.
template <bool kSplit, typename T>
__device__ __forceinline__ void LoadXTransposed(int lane, const T* tile,
                                                int stride, int row0, int col,
                                                uint32_t (&hi)[2][4],
                                                uint32_t (&lo)[2][4]) {
  if constexpr (sizeof(T) == 2) {
    const int mat = lane >> 3;
    LoadXTransposedAt(tile + (row0 + (mat >> 1) * 8 + (lane & 7)) * stride +
                          col + (mat & 1) * 8,
                      hi);
  } else {
    const int grp = lane >> 2, quad = lane & 3;
#pragma unroll
    for (int step = 0; step < 2; ++step) {
      const float* p = reinterpret_cast<const float*>(tile) +
                       (row0 + step * 8 + 2 * quad) * stride + col + grp;
      const float v[4] = {p[0], p[8], p[stride], p[stride + 8]};
#pragma unroll
      for (int e = 0; e < 4; ++e)
        SplitTf32<kSplit>(v[e], hi[step][e], lo[step][e]);
    }
  }
}

// Column j (0..127) of the CTA's tile: its stream, channel offset from c0
// and flat k (k < 0 past the last channel). n is a power of two, so the
// tile splits into streams with shifts.
struct Column {
  int stream;
  int chan;  // channel - c0
  int k;
};
__device__ __forceinline__ Column ColumnOf(const DevSpec& s, int log_n,
                                           int64_t c0, int j) {
  Column c;
  if (s.minor) {
    c.stream = j & (s.n - 1);
    c.chan = j >> log_n;
  } else {
    c.stream = j >> (7 - log_n);
    c.chan = j & ((kCols >> log_n) - 1);
  }
  c.k = c0 + c.chan < s.C ? static_cast<int>(XIndex(s, c.stream, c0 + c.chan))
                          : -1;
  return c;
}
// Column of (stream, channel offset) inside the tile.
__device__ __forceinline__ int TileColumn(const DevSpec& s, int log_n,
                                          int stream, int chan) {
  return s.minor ? (chan << log_n) + stream : (stream << (7 - log_n)) + chan;
}

// The pre backward's terms a stage loop is built for: none (kN = 0), n
// streams known at compile time (kN = 4, 8) or any n read at run time
// (kN = -1). kMinor / kResidual: the layout and whether the residual term
// is on, fixed (0, 1) or read at run time (-1). Fixed flags keep a runtime
// check per output pair from splitting the epilogue into small blocks the
// compiler cannot interleave.
template <int kN, int kMinor = -1, int kResidual = -1>
struct TermsTag {
  static constexpr int value = kN;
  __device__ static bool Minor(bool at_run_time) {
    return kMinor < 0 ? at_run_time : kMinor != 0;
  }
  __device__ static bool Residual(bool at_run_time) {
    return kResidual < 0 ? at_run_time : kResidual != 0;
  }
};

// The staged rows of the aggregate and residual terms as one lane reads
// them for its output pair (stage row grp, tile column j0 + 2 quad), set once
// per stage so every pair of the stage is these pointers plus compile-time
// offsets. The pair shares a stream and a dx_next run (stream major) or a
// channel (stream minor), so R rows, gates and dx_next come in vector loads.
template <typename T>
struct TermLane {
  const T* dxn;     // dx_next at the pair's channel (major) / channel run
  const T* dy;      // dy at the pair's channel
  const float* hp;  // H_pre at the pair's (first) stream
  const float* r;   // the R row of that stream
};

// kRowStride: elements per staged dx_next row.
template <typename T, int kN, int kRowStride>
__device__ __forceinline__ TermLane<T> TermLaneOf(bool minor, int j0, int quad,
                                                  int row, const T* dxns,
                                                  const T* dys,
                                                  const float* hps,
                                                  const float* rs) {
  constexpr int kWc = kCols / kN;  // channels per stream in the tile
  const int j = j0 + 2 * quad;
  const int stream = minor ? j % kN : j / kWc;
  const int chan = minor ? j / kN : j % kWc;
  TermLane<T> p;
  p.dxn = dxns + row * kRowStride + (minor ? kN * chan : chan);
  p.dy = dys + row * DyRow<T>(kN) + chan;
  p.hp = hps + row * kN + stream;
  p.r = rs + (row * kN + stream) * kN;
  return p;
}

// Adds the aggregate and residual terms to output pair out of the lane's
// pair dt rows below and 8 nt columns right of its TermLane (n = 4, the
// production shape, and n = 8). Same products in the same order as the
// general path.
template <typename T, int kN, int kRowStride>
__device__ __forceinline__ void AddTerms(bool minor, bool residual,
                                         const TermLane<T>& p, int dt, int nt,
                                         float (&out)[2]) {
  static_assert(kN % 4 == 0, "R rows load as float4");
  constexpr int kWc = kCols / kN;
  const T* dxn = p.dxn + dt * kRowStride + 8 * nt;
  const float* hp = p.hp + dt * kN;
  const float* r = p.r + dt * kN * kN;
  float acc[2];
  if (!minor) {
    const float2 d = LoadPair(p.dy + dt * DyRow<T>(kN) + 8 * nt);
    acc[0] = hp[0] * d.x;
    acc[1] = hp[0] * d.y;
    if (residual) {
#pragma unroll
      for (int i0 = 0; i0 < kN; i0 += 4) {
        const float4 rv4 = *reinterpret_cast<const float4*>(r + i0);
        const float rv[4] = {rv4.x, rv4.y, rv4.z, rv4.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 g = LoadPair(dxn + kWc * (i0 + q));
          acc[0] = fmaf(rv[q], g.x, acc[0]);
          acc[1] = fmaf(rv[q], g.y, acc[1]);
        }
      }
    }
  } else {
    const float d = ToFloat(p.dy[dt * DyRow<T>(kN) + 8 * nt / kN]);
#pragma unroll
    for (int e = 0; e < 2; ++e) acc[e] = hp[e] * d;
    if (residual) {
      float g[kN];
#pragma unroll
      for (int i = 0; i < kN; i += 2) {
        const float2 pair = LoadPair(dxn + i);
        g[i] = pair.x;
        g[i + 1] = pair.y;
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int i0 = 0; i0 < kN; i0 += 4) {
          const float4 rv4 = *reinterpret_cast<const float4*>(r + kN * e + i0);
          const float rv[4] = {rv4.x, rv4.y, rv4.z, rv4.w};
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[e] = fmaf(rv[q], g[i0 + q], acc[e]);
        }
      }
    }
  }
  out[0] += acc[0];
  out[1] += acc[1];
}

// Four consecutive activations as floats: one 8-byte (16-bit) or 16-byte
// (fp32) load.
template <typename T>
__device__ __forceinline__ void LoadFour(const T* p, float (&v)[4]) {
  if constexpr (sizeof(T) == 2) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 a = Unpack(u.x, T{}), b = Unpack(u.y, T{});
    v[0] = a.x;
    v[1] = a.y;
    v[2] = b.x;
    v[3] = b.y;
  } else {
    const float4 f = *reinterpret_cast<const float4*>(p);
    v[0] = f.x;
    v[1] = f.y;
    v[2] = f.z;
    v[3] = f.w;
  }
}

// The aggregate and residual terms of one token's four channels c .. c + 3
// in every stream (n = 4, stream major), into `terms` (the token's row of
// [token][kTermsStride], tile columns): H_pre_i dy_c + sum_q R_iq
// dx_next_qc, the products and order of AddTerms, so every dx keeps its
// bits. d: dy, g[q]: stream q's dx_next; hp, r: the token's H_pre and R.
__device__ __forceinline__ void SumTokenTerms(int c, const float (&d)[4],
                                              const float (&g)[4][4],
                                              const float* hp_row,
                                              const float* r_rows,
                                              float* terms) {
  constexpr int kWc = kCols / 4;
  const float4 hp = *reinterpret_cast<const float4*>(hp_row);
  const float hpv[4] = {hp.x, hp.y, hp.z, hp.w};
  // Every row of R before the first store: the stores may alias the runs as
  // far as the compiler knows, so a load after one would wait for it.
  float4 r[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    r[i] = *reinterpret_cast<const float4*>(r_rows + i * 4);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float rv[4] = {r[i].x, r[i].y, r[i].z, r[i].w};
    float acc[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc[e] = hpv[i] * d[e];
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[e] = fmaf(rv[q], g[q][e], acc[e]);
    }
    *reinterpret_cast<float4*>(terms + kWc * i + c) =
        make_float4(acc[0], acc[1], acc[2], acc[3]);
  }
}

// SumTokenTerms of staged token `row` from the stage's tiles (dxns, dys)
// and runs (hps, rs). Each dx_next element is read once here, where the
// epilogue read it once per stream.
template <typename T, bool kSwizzled, int kRowStride, int kDyRow>
__device__ __forceinline__ void SumStageTerms(int row, int c, const T* dxns,
                                              const T* dys, const float* hps,
                                              const float* rs, float* terms) {
  constexpr int kWc = kCols / 4;
  float d[4], g[4][4];
  LoadFour(dys + row * kDyRow + c, d);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    LoadFour(dxns + TileOffset<kSwizzled, kRowStride>(row, kWc * q + c), g[q]);
  }
  SumTokenTerms(c, d, g, hps + row * 4, rs + row * 16, terms);
}

}  // namespace mhc::cuda::dx_mma

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MMA_TILES_CUH_
