// Fused pre forward (projection + sum of squares + scale + Sinkhorn +
// aggregate) and the fused pre backward; the head ops (head.cu) run the same
// kernels with the kHead kind. Dynamic layers run the tensor-core projection
// units (projection/forward/mma.cuh: the K split depends on K and N only, chunk
// partials are added in order), then a thread per token for the mixing math
// (a quad of lanes in small n = 4 batches), beside the aggregate kernel;
// static layers (no projection) one kernel per kTileTokens tokens.
// Determinism / batch invariance: a token's h and mean square come from the
// projection units, its mixing values from one thread's operations (a quad
// runs the same ones: sinkhorn4_quad.cuh), its y / dx from
// elementwise code with fixed-order sums, and dh_pre from a fixed xor tree
// (a warp per token); nothing depends on M. The backward: projection
// recompute (skipped when the forward kept h and the mean square: they are
// the recompute's bits), dh_pre, the per-token reverse mode, then the dx /
// dphi kernel (projection/backward/mma*.cu where it applies); the per-token
// reverse mode is in fused_pre_backward_mix.cu. Parameter
// gradients go through per-token rows and per-chunk partials in workspace,
// summed in a fixed order (launch.h), never with atomics.
#include <algorithm>

#include "common.cuh"
#include "dispatch.cuh"
#include "fused_pre_backward_mix.h"
#include "fused_pre_workspace.cuh"
#include "launch.h"
#include "mix.cuh"
#include "overflow_repair.cuh"
#include "overflow_repair.h"
#include "plans/fused.h"
#include "primitives/row_access.cuh"
#include "primitives/staged_windows.cuh"
#include "projection/backward/wide.h"
#include "projection/forward/mma.cuh"
#include "sinkhorn4.cuh"
#include "sinkhorn4_quad.cuh"

namespace mhc::cuda {
namespace {

using fused_pre::BackwardSlices;
using fused_pre::ForwardSlices;
using fused_pre::ForwardSlicesOf;
using fused_pre::kBackwardArrivals;
using fused_pre::Slices;

struct ForwardDev {
  const float* alpha;
  const float* beta;
  float* h_pre;
  float* h_post;
  float* h_res;
};

// H_res of one token: sinkhorn4.cuh's single-thread form where it applies
// (n = 4 LINEAR), the generic per-token form otherwise.
template <int NT>
__device__ __forceinline__ void PreSinkhorn(const DevSpec& s,
                                            const float (&logits)[NT * NT],
                                            float (&p)[NT * NT]) {
  if constexpr (NT == 4) {
    if (sk4::Applies(s, /*backward=*/false)) {
      float p0[16];
      sk4::Forward(s.iterations, s.eps_sk, logits, p0, p, sk4::NoKeep{});
      return;
    }
  }
  SinkhornForwardToken<NT>(s, logits, p);
}

// The forward mixing values of token m from its logits h (ignored by static
// layers) and mean square: H_pre into hp and h_pre (when given), and for
// mHC layers H_post and H_res.
template <int NT>
__device__ __forceinline__ void ForwardMixToken(const DevSpec& s, int64_t m,
                                                const float* h, float ms,
                                                const ForwardDev& a,
                                                float* h_pre, float (&hp)[NT]) {
  const int n = StreamCount<NT>(s);
  float hq[NT], logits[NT * NT];
  ScaleForwardToken<NT>(s, h, ms, a.alpha, a.beta, hp, hq, logits);
  if (h_pre != nullptr) {
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      if (i >= n) break;
      h_pre[m * n + i] = hp[i];
    }
  }
  if (s.head) return;
  float p[NT * NT];
  PreSinkhorn<NT>(s, logits, p);
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    if (i >= n) break;
    a.h_post[m * n + i] = hq[i];
  }
#pragma unroll
  for (int e = 0; e < NT * NT; ++e) {
    if (e >= n * n) break;
    a.h_res[m * n * n + e] = p[e];
  }
}

// A static layer (z = beta for every token, no projection): the mixing
// values of kTileTokens tokens, then their aggregate.
template <typename T, int NT, int V, bool kStrided, bool kStaged>
__global__ void __launch_bounds__(kTileThreads)
    static_forward_kernel(DevSpec s, int64_t tokens, const T* x, T* y,
                          ForwardDev a) {
  __shared__ float hp_s[kTileTokens][NT];
  const int n = StreamCount<NT>(s);
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kTileTokens;
  if (threadIdx.x < kTileTokens) {
    const int t = threadIdx.x;
    const int64_t m = m0 + t;
    float hp[NT];
#pragma unroll
    for (int i = 0; i < NT; ++i) hp[i] = 0.0f;
    if (m < tokens) ForwardMixToken<NT>(s, m, nullptr, 0.0f, a, a.h_pre, hp);
#pragma unroll
    for (int i = 0; i < NT; ++i) hp_s[t][i] = i < n ? hp[i] : 0.0f;
  }
  __syncthreads();
  for (int t = 0; t < kTileTokens; ++t) {
    const int64_t m = m0 + t;
    if (m >= tokens) break;
    T* out = y + m * s.C;
    ForEachStreamsStep<T, NT, V, kStrided, kStaged, kTileThreads,
                       kTileThreads / 32>(
        s, n, x + m * s.K, x + tokens * s.K, threadIdx.x,
        [&](int64_t c, const float(&xv)[NT][V]) {
          float acc[V];
#pragma unroll
          for (int v = 0; v < V; ++v) acc[v] = 0.0f;
#pragma unroll
          for (int i = 0; i < NT; ++i) {
            if (i >= n) break;
#pragma unroll
            for (int v = 0; v < V; ++v) {
              acc[v] = fmaf(hp_s[t][i], xv[i][v], acc[v]);
            }
          }
          StoreChannels<T, V, kStrided>(out, c, s.C, acc);
        });
  }
}

// The mixing math of the tensor-core path, a thread per token: h and the
// mean square from the chunk partials, then scale and Sinkhorn; H_pre goes
// to h_pre (the caller's, or workspace for the aggregate kernel).
// Its h row (N + 1 floats) lives in shared memory: 18-21 KB per block.
template <int NT>
constexpr int PreMixThreads() {
  return NT > 8 ? 16 : 64;
}
// Threads per block that add the chunk partials (the first PreMixThreads
// then run the mixing math).
template <int NT>
constexpr int PreMixBlock() {
  return 4 * PreMixThreads<NT>();
}
// Small batches: blocks of kPreMixFewTokens tokens, PreMixBlock threads
// still adding their partials, so that the loads spread over more SMs,
// where blocks of PreMixThreads tokens would fill under a quarter of them.
inline constexpr int kPreMixFewTokens = 16;
inline bool PreMixFewTokens(int64_t tokens, int tokens_per_block) {
  return 4 * ((tokens + tokens_per_block - 1) / tokens_per_block) <=
         proj::kTunedSms;
}

// The projection kept for the backward (null: not kept).
struct KeptOut {
  float* h;            // [M, N]
  float* mean_square;  // [M]
};

// A token whose projection overflowed fp32 (overflow_repair.cuh): the mixing
// values from its float64 recompute, and its kept h / mean square unscaled.
// Out of line, so the common path keeps its registers, and taking the
// kernel's parameters by value, so that no address of them is taken: that
// put them in local memory, where the common path then read them too.
template <int NT>
__device__ __noinline__ void RepairedForwardMix(DevSpec s, int64_t m,
                                                RepairSource src,
                                                const float* h, float ms,
                                                ForwardDev a, float* h_pre,
                                                KeptOut kept) {
  float h_s[NT * NT + 2 * NT];
  float ms_s = 0.0f;
  const int flag = RepairProjection(s, src, m, h_s, &ms_s);
  float hp[NT];
  if (flag == 0) {  // x is not finite: the fp32 values carry it
    ForwardMixToken<NT>(s, m, h, ms, a, h_pre, hp);
    return;
  }
  const int e = flag - kRepairFlagBias;
  ForwardMixToken<NT>(ScaledSpec(s, e), m, h_s, ms_s, a, h_pre, hp);
  if (kept.h == nullptr) return;
  StoreUnscaled(s, e, h_s, ms_s, kept.h + m * s.N, kept.mean_square + m);
}

// The mixing of a small-batch block's n = 4 tokens on quads of lanes (the
// block's first 2 warps, sinkhorn4_quad.cuh): ForwardMixToken's values with
// the Sinkhorn steps split over the quad, the same bits. The quads' shuffles
// take the whole warp, so quads past the block's tokens run its last one
// and repaired tokens run the steps too, storing nothing; a repaired token's
// first lane then runs the one-thread repair.
__device__ __forceinline__ void QuadForwardMix(
    const DevSpec& s, int64_t m0, int live,
    const float (&h_s)[kPreMixFewTokens][4 * 4 + 2 * 4 + 1],
    const ForwardDev& a, float* h_pre, KeptOut kept, const RepairSource& src) {
  const int token = static_cast<int>(threadIdx.x) / 4;
  if (token >= kPreMixFewTokens) return;  // whole warps
  const bool in_block = token < live;
  const int t = in_block ? token : live - 1;
  const int64_t m = m0 + t;
  const float* h = h_s[t];
  const float ms = h[s.N] / static_cast<float>(s.K);
  const bool repair = NeedsRepair(s, h, ms);
  const sk4::Quad quad = sk4::Quad::OfLane();
  float hp[4], hq[4], logits[16], p0[16], p_row[4];
  ScaleForwardToken<4>(s, h, ms, a.alpha, a.beta, hp, hq, logits);
  sk4::QuadForward(s.iterations, s.eps_sk, logits, p0, p_row, sk4::QuadNoKeep{},
                   quad);
  if (in_block && !repair) {
    if (quad.q == 0) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (h_pre != nullptr) h_pre[m * 4 + i] = hp[i];
        a.h_post[m * 4 + i] = hq[i];
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) a.h_res[m * 16 + quad.q * 4 + j] = p_row[j];
  }
  if (in_block && repair && quad.q == 0) {
    RepairedForwardMix<4>(s, m, src, h, ms, a, h_pre, kept);
  }
}

// Elements of the chunk sum each thread loads before it stores any: a store
// may alias the next loads as far as the compiler knows, so one element per
// pass waited out a load's latency per element. n = 16 keeps one: its
// registers doubled with four.
template <int NT>
constexpr int PreMixSumBatch() {
  return NT <= 8 ? 4 : 1;
}

// kChunkLoads: SumChunks' loads, no fewer than the layer's chunks
// (WithChunkLoads). kTokens: PreMixThreads or kPreMixFewTokens.
template <int NT, int kChunkLoads, int kTokens>
__global__ void __launch_bounds__(PreMixBlock<NT>())
    pre_mix_forward_kernel(DevSpec s, int64_t tokens, const float* partial,
                           ForwardDev a, float* h_pre, KeptOut kept,
                           RepairSource src) {
  WaitForPrerequisiteGrid();  // the units' partials
  AllowDependentLaunch();     // the aggregate waits for this kernel's end
  constexpr int kBlock = PreMixBlock<NT>();
  constexpr int kBatch = PreMixSumBatch<NT>();
  static_assert(kMmaTokens % kTokens == 0, "a block's tokens share a tile");
  __shared__ float h_s[kTokens][NT * NT + 2 * NT + 1];
  // alpha, then beta: loaded beside the partials rather than after them.
  __shared__ float params_s[3 + NT * NT + 2 * NT];
  for (int i = threadIdx.x; i < s.num_alpha + s.N; i += kBlock) {
    params_s[i] = i < s.num_alpha ? a.alpha[i] : a.beta[i - s.num_alpha];
  }
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kTokens;
  const int live = static_cast<int>(min(int64_t{kTokens}, tokens - m0));
  const int chunks = PlanChunks(s.K, s.N).chunks;
  const int width = s.N + 1;
  // The block's rows are consecutive in each chunk's partials of their tile:
  // the whole block adds them element by element, coalesced.
  const TokenChunks rows = ChunksOf(partial, tokens, chunks, width, m0);
  for (int e0 = threadIdx.x; e0 < live * width; e0 += kBatch * kBlock) {
    float sum[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int e = e0 + b * kBlock;
      sum[b] =
          e < live * width ? SumChunks<kChunkLoads>(rows, chunks, e) : 0.0f;
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int e = e0 + b * kBlock;
      if (e >= live * width) break;
      const int t = e / width, col = e % width;
      h_s[t][col] = sum[b];
      // As projection_finish_kernel writes them: the backward's recompute
      // and this copy are the same bits.
      if (kept.h == nullptr) continue;
      if (col < s.N) {
        kept.h[(m0 + t) * s.N + col] = sum[b];
      } else {
        kept.mean_square[m0 + t] = sum[b] / static_cast<float>(s.K);
      }
    }
  }
  __syncthreads();
  a.alpha = params_s;
  a.beta = params_s + s.num_alpha;
  if constexpr (NT == 4 && kTokens == kPreMixFewTokens) {
    if (!s.head && sk4::Applies(s, /*backward=*/false)) {
      QuadForwardMix(s, m0, live, h_s, a, h_pre, kept, src);
      return;
    }
  }
  if (static_cast<int>(threadIdx.x) >= live) return;
  const float* h = h_s[threadIdx.x];
  const float ms = h[s.N] / static_cast<float>(s.K);
  if (NeedsRepair(s, h, ms)) {
    RepairedForwardMix<NT>(s, m0 + threadIdx.x, src, h, ms, a, h_pre, kept);
    return;
  }
  float hp[NT];
  ForwardMixToken<NT>(s, m0 + threadIdx.x, h, ms, a, h_pre, hp);
}

// dh_pre[m][i] = sum_c dy[m][c] x[m][i][c] with one warp per token: lanes
// stride the channels, then a fixed xor tree (order set by C alone).
constexpr int kDhPreWarps = 4;
// Odd C at n = 4 (strided rows): uncapped, too few CTAs per SM for the
// loads in flight; capped for eight the whole pre backward measured faster
// (docs/decisions.md).
template <int NT, bool kStrided>
inline constexpr int kDhPreBlocks = NT == 4 && kStrided ? 8 : 0;
template <typename T, int NT, int V, bool kStrided, bool kStaged>
__global__ void __launch_bounds__(kDhPreWarps * 32, kDhPreBlocks<NT, kStrided>)
    dh_pre_kernel(DevSpec s, int64_t tokens, const T* x, const T* dy,
                  float* dh_pre, int* repair_count, unsigned* arrivals) {
  WaitForPrerequisiteGrid();  // dy, and the workspace's earlier readers
  // The mixing kernel, next in the stream, counts its repaired tokens; the
  // dx kernel's split chunks and the column sums, last, their finished CTAs.
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0 && repair_count != nullptr) *repair_count = 0;
    for (int i = threadIdx.x; i < kBackwardArrivals; i += blockDim.x) {
      arrivals[i] = 0;
    }
  }
  const int lane = threadIdx.x & 31;
  const int64_t m =
      static_cast<int64_t>(blockIdx.x) * kDhPreWarps + (threadIdx.x >> 5);
  if (m >= tokens) return;
  const int n = StreamCount<NT>(s);
  const T* row = x + m * s.K;
  const T* dy_row = dy + m * s.C;
  float acc[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) acc[i] = 0.0f;
  struct Loaded {
    float x[NT][V];
    float dy[V];
  };
  auto step = [&](int64_t, const Loaded& l) {
#pragma unroll
    for (int i = 0; i < NT; ++i) {
#pragma unroll
      for (int v = 0; v < V; ++v) acc[i] = fmaf(l.dy[v], l.x[i][v], acc[i]);
    }
  };
  auto rows = [&](Loaded& l, auto&& visit) {
#pragma unroll
    for (int i = 0; i < NT; ++i) visit(row + i * s.C, x + tokens * s.K, l.x[i]);
    visit(dy_row, dy + tokens * s.C, l.dy);
  };
  if (!ForEachStagedStep<Loaded, T, V, kStaged, 32, kDhPreWarps, NT + 1>(
          s.C, lane, rows, [] {}, step)) {
#pragma unroll 2
    for (int64_t c = FirstChannel<V, kStrided>(lane); c < s.C; c += 32 * V) {
      Loaded l;
      LoadStreams<T, NT, V, kStrided>(s, n, row, c, l.x);
      LoadChannels<T, V, kStrided>(dy_row, c, s.C, l.dy);
      step(c, l);
    }
  }
#pragma unroll
  for (int i = 0; i < NT; ++i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], o);
    }
    if (lane == 0 && i < n) dh_pre[m * n + i] = acc[i];
  }
}

// The scale forward op of a SplitMix layer from h and the mean square (null
// for static layers), with the overflow repair for dynamic layers.
absl::Status LaunchScaleOf(const LayerSpec* spec, int64_t tokens,
                           const float* h, const float* mean_square,
                           const LayerWeights& weights, float* h_pre,
                           float* h_post, float* logits,
                           const ScaleRepair& repair, cudaStream_t stream) {
  ScaleForwardParams scale;
  scale.spec = spec;
  scale.tokens = tokens;
  scale.h = h;
  scale.mean_square = mean_square;
  scale.weights = weights;
  scale.h_pre = h_pre;
  scale.h_post = h_post;
  scale.logits = logits;
  return LaunchScaleForward(scale, stream, spec->dynamic ? &repair : nullptr);
}

// The backward mixing of a SplitMix layer after dh_pre: the scale forward
// again (H_pre for dx, the logits), the lane kernels' Sinkhorn reverse mode
// (dlogits, and R for dx's residual term), then the scale backward, which
// accumulates dalpha and dbeta through the contrib / col_partial slices.
// The overflow repair (dynamic layers): the scale forward recomputes a
// flagged token, flags every token and keeps the repaired one's scaled
// projection in `rows`, where the scale backward reads it and leaves the
// scaled dh / dms for the repair pass, as the fused mixing kernel does.
absl::Status SplitBackwardMix(const FusedBackwardArgs& a,
                              const BackwardSlices& b, char* base,
                              const BackwardMixDev& d,
                              const ScaleRepair& repair, unsigned* arrivals,
                              cudaStream_t stream) {
  auto at = [&](size_t offset) {
    return reinterpret_cast<float*>(base + offset);
  };
  MHC_RETURN_IF_ERROR(LaunchScaleOf(a.spec, a.tokens, d.h_in, d.ms_in,
                                    a.weights, at(b.h_pre), at(b.h_post),
                                    at(b.logits), repair, stream));
  MHC_RETURN_IF_ERROR(LaunchSinkhornLanesBackward(
      *a.spec, a.tokens, at(b.logits), a.dh_res, at(b.dlogits), d.r, stream));
  ScaleBackwardParams back;
  back.spec = a.spec;
  back.tokens = a.tokens;
  back.h = d.h_in;
  back.mean_square = d.ms_in;
  back.weights = a.weights;
  back.dh_pre = at(b.dh_pre);
  back.dh_post = a.dh_post;
  back.dlogits = at(b.dlogits);
  back.dh = a.spec->dynamic ? d.dh : nullptr;
  back.dmean_square = a.spec->dynamic ? d.dms : nullptr;
  back.grads.alpha = a.grads.alpha;
  back.grads.beta = a.grads.beta;
  const Workspace ws{base + b.contrib, b.dphi - b.contrib};
  return LaunchScaleBackward(back, ws, arrivals, stream,
                             a.spec->dynamic ? &repair : nullptr);
}

}  // namespace

// Static layers need none (no projection).
size_t FusedForwardWorkspace(const LayerSpec& spec, int64_t tokens,
                             DType dtype) {
  if (MmaProjectionWorkspace(spec, tokens, dtype) == 0) return 0;
  return ForwardSlicesOf(spec, tokens, dtype).total;
}

size_t FusedBackwardWorkspace(const LayerSpec& spec, int64_t tokens,
                              DType dtype) {
  return Slices(spec, tokens, dtype).total;
}

absl::Status LaunchFusedForward(const FusedForwardArgs& a, Workspace ws,
                                cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*a.spec);
  const char* op = s.head ? "head forward" : "pre forward";
  const LaunchShape shape(*a.spec, a.tokens, a.act_dtype);
  const float* gamma = s.has_gamma ? a.weights.gamma : nullptr;
  ForwardDev d{a.weights.alpha, a.weights.beta, a.h_pre, a.h_post, a.h_res};
  const FusedVariant variant = PlanFusedForward(*a.spec).variant;
  if (variant != FusedVariant::kStatic) {
    if (ws.bytes < FusedForwardWorkspace(*a.spec, a.tokens, a.act_dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda ", op, " ", ShapeText(shape), ": workspace too small"));
    }
    char* base = static_cast<char*>(ws.data);
    const float* partial = reinterpret_cast<const float*>(base);
    const ForwardSlices f = ForwardSlicesOf(*a.spec, a.tokens, a.act_dtype);
    auto at = [&](size_t offset) {
      return reinterpret_cast<float*>(base + offset);
    };
    float* h_pre = a.h_pre != nullptr ? a.h_pre : at(f.h_pre);
    if (variant == FusedVariant::kSplitMix) {
      // h and the mean square, then the scale and Sinkhorn op kernels.
      float* h = a.h != nullptr ? a.h : at(f.h);
      float* ms = a.h != nullptr ? a.mean_square : at(f.ms);
      float* logits = at(f.logits);
      MHC_RETURN_IF_ERROR(LaunchMmaProjection(*a.spec, a.tokens, a.act_dtype,
                                              a.x, a.weights.phi, gamma, base,
                                              h, ms, stream));
      // A repaired token's kept projection is its float64 value, as the
      // fused mixing kernel keeps it.
      ScaleRepair repair;
      repair.src = RepairSource{a.x, a.act_dtype, a.weights.phi, gamma};
      repair.kept_h = a.h;
      repair.kept_ms = a.h != nullptr ? a.mean_square : nullptr;
      MHC_RETURN_IF_ERROR(LaunchScaleOf(a.spec, a.tokens, h, ms, a.weights,
                                        h_pre, a.h_post, logits, repair,
                                        stream));
      SinkhornForwardParams sinkhorn;
      sinkhorn.spec = a.spec;
      sinkhorn.tokens = a.tokens;
      sinkhorn.logits = logits;
      sinkhorn.h_res = a.h_res;
      MHC_RETURN_IF_ERROR(LaunchSinkhornForward(sinkhorn, stream));
    } else {
      MHC_RETURN_IF_ERROR(
          LaunchProjectionPartials(*a.spec, a.tokens, a.act_dtype, a.x,
                                   a.weights.phi, gamma, ws.data, stream));
      const int chunks = PlanChunks(s.K, s.N).chunks;
      auto mix = [&](auto nt) {
        constexpr int kNT = decltype(nt)::value;
        constexpr int kTokens = PreMixThreads<kNT>();
        constexpr int kFew = std::min(kTokens, kPreMixFewTokens);
        const bool few_tokens = PreMixFewTokens(a.tokens, kTokens);
        const int tokens_per_block = few_tokens ? kFew : kTokens;
        return WithChunkLoads(chunks, [&](auto loads) {
          constexpr int kLoads = decltype(loads)::value;
          return LaunchAfterPrevious(
              few_tokens ? pre_mix_forward_kernel<kNT, kLoads, kFew>
                         : pre_mix_forward_kernel<kNT, kLoads, kTokens>,
              dim3(GridSize((a.tokens + tokens_per_block - 1) /
                            tokens_per_block)),
              dim3(PreMixBlock<kNT>()), 0, stream, s, a.tokens, partial, d,
              h_pre, KeptOut{a.h, a.mean_square},
              RepairSource{a.x, a.act_dtype, a.weights.phi, gamma});
        });
      };
      // Per-thread arrays sized to n (mixing state lives in registers).
      const cudaError_t err = s.n == 4   ? mix(IntTag<4>{})
                              : s.n <= 2 ? mix(IntTag<2>{})
                              : s.n <= 8 ? mix(IntTag<8>{})
                                         : mix(IntTag<kMaxStreams>{});
      MHC_CUDA_RETURN_IF_ERROR(err, op, shape);
      MHC_CUDA_CHECK_LAUNCH(op, shape);
    }
    AggregateForwardParams agg;
    agg.spec = a.spec;
    agg.tokens = a.tokens;
    agg.act_dtype = a.act_dtype;
    agg.x = a.x;
    agg.h_pre = h_pre;
    agg.y = a.y;
    if (variant == FusedVariant::kSplitMix) {
      return LaunchAggregateForward(agg, stream);
    }
    const PreGateSource gates{partial, PlanChunks(s.K, s.N).chunks,
                              a.weights.alpha, a.weights.beta};
    return LaunchAggregateForward(agg, stream, &gates);
  }
  const RowAccessPlan access =
      RowAccessOf<RowKernel::kPre>(*a.spec, a.act_dtype, a.x, a.y);
  const unsigned grid = GridSize((a.tokens + kTileTokens - 1) / kTileTokens);
  DispatchRows<RowKernel::kPre>(
      a.act_dtype, access, [&](auto tt, auto nt, auto vt, auto rt, auto st) {
        using T = typename decltype(tt)::type;
        static_forward_kernel<T, decltype(nt)::value, decltype(vt)::value,
                              decltype(rt)::value, decltype(st)::value>
            <<<grid, kTileThreads, 0, stream>>>(s, a.tokens,
                                                static_cast<const T*>(a.x),
                                                static_cast<T*>(a.y), d);
      });
  MHC_CUDA_CHECK_LAUNCH(op, shape);
  return absl::OkStatus();
}

absl::Status LaunchFusedBackward(const FusedBackwardArgs& a, Workspace ws,
                                 cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*a.spec);
  const char* op = s.head ? "head backward" : "pre backward";
  const LaunchShape shape(*a.spec, a.tokens, a.act_dtype);
  const BackwardSlices b = Slices(*a.spec, a.tokens, a.act_dtype);
  if (ws.bytes < b.total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda ", op, " ", ShapeText(shape), ": workspace too small"));
  }
  char* base = static_cast<char*>(ws.data);
  auto at = [&](size_t offset) {
    return reinterpret_cast<float*>(base + offset);
  };
  auto* arrivals = reinterpret_cast<unsigned*>(base + b.arrivals);
  const float* gamma = s.has_gamma ? a.weights.gamma : nullptr;
  const bool residual = !s.head && a.dx_next != nullptr;
  BackwardMixDev d{a.weights.alpha, a.weights.beta,
                   a.dh_post,       a.dh_res,
                   at(b.dh),        at(b.dms),
                   at(b.h_pre),     residual ? at(b.r) : nullptr,
                   at(b.contrib),   nullptr,
                   nullptr};
  if (s.dynamic && a.h != nullptr) {
    d.h_in = a.h;
    d.ms_in = a.mean_square;
  } else if (s.dynamic) {
    MHC_RETURN_IF_ERROR(LaunchMmaProjection(
        *a.spec, a.tokens, a.act_dtype, a.x, a.weights.phi, gamma,
        base + b.proj_partial, at(b.h_fwd), at(b.ms_fwd), stream));
    d.h_in = at(b.h_fwd);
    d.ms_in = at(b.ms_fwd);
  }
  const bool split =
      PlanFusedBackward(*a.spec).variant == FusedVariant::kSplitMix;
  // Overflow repair (overflow_repair.cuh): the fused mixing kernel, or on
  // SplitMix layers the scale op kernels, flag and count the tokens.
  const bool repair = s.dynamic;
  const RepairSource src{a.x, a.act_dtype, a.weights.phi, gamma};
  const RepairRows rows{at(b.repair_scaled),
                        reinterpret_cast<int*>(at(b.repair_flag)),
                        reinterpret_cast<int*>(at(b.repair_count))};
  const RowAccessPlan access =
      RowAccessOf<RowKernel::kPre>(*a.spec, a.act_dtype, a.x, a.dy);
  const unsigned grid = GridSize((a.tokens + kDhPreWarps - 1) / kDhPreWarps);
  cudaError_t err = cudaSuccess;
  DispatchRows<RowKernel::kPre>(
      a.act_dtype, access, [&](auto tt, auto nt, auto vt, auto rt, auto st) {
        using T = typename decltype(tt)::type;
        err = LaunchAfterPrevious(
            dh_pre_kernel<T, decltype(nt)::value, decltype(vt)::value,
                          decltype(rt)::value, decltype(st)::value>,
            dim3(grid), dim3(kDhPreWarps * 32), 0, stream, s, a.tokens,
            static_cast<const T*>(a.x), static_cast<const T*>(a.dy),
            at(b.dh_pre), repair ? rows.count : nullptr, arrivals);
      });
  MHC_CUDA_RETURN_IF_ERROR(err, op, shape);
  MHC_CUDA_CHECK_LAUNCH(op, shape);
  if (split) {
    ScaleRepair fix;
    fix.src = src;
    fix.rows = rows;
    MHC_RETURN_IF_ERROR(SplitBackwardMix(a, b, base, d, fix, arrivals, stream));
  } else {
    MHC_RETURN_IF_ERROR(LaunchBackwardMix(*a.spec, a.tokens, a.act_dtype,
                                          at(b.dh_pre), d, src, rows, stream));
  }

  const bool want_phi =
      s.dynamic &&
      (a.grads.phi != nullptr || (s.has_gamma && a.grads.gamma != nullptr));
  DxArgs dx;
  dx.spec = a.spec;
  dx.tokens = a.tokens;
  dx.act_dtype = a.act_dtype;
  dx.x = a.x;
  dx.phi = s.dynamic ? a.weights.phi : nullptr;
  dx.gamma = gamma;
  dx.dh = s.dynamic ? at(b.dh) : nullptr;
  dx.dms = at(b.dms);
  dx.h_pre = at(b.h_pre);
  dx.dy = a.dy;
  dx.r = residual ? at(b.r) : nullptr;
  dx.dx_next = residual ? a.dx_next : nullptr;
  dx.dx = a.dx;
  dx.dphi_partial = want_phi ? at(b.dphi) : nullptr;
  dx.split_partials = at(b.split_dphi);
  dx.split_arrivals = arrivals + 1;
  dx.wide_scratch = at(b.wide);
  // The repair pass for the tokens the mixing kernel repaired rides on the
  // phi / gamma gradients' launch, which runs after dx anyway: no launch of
  // its own unless no phi / gamma gradient is asked for.
  RepairBackwardArgs fix;
  fix.dtype = a.act_dtype;
  fix.x = a.x;
  fix.dy = a.dy;
  fix.dx_next = residual ? a.dx_next : nullptr;
  fix.dx = a.dx;
  fix.phi = a.weights.phi;
  fix.gamma = gamma;
  fix.h_pre = at(b.h_pre);
  fix.r = residual ? at(b.r) : nullptr;
  fix.grad_phi = want_phi ? a.grads.phi : nullptr;
  fix.grad_gamma = want_phi && s.has_gamma ? a.grads.gamma : nullptr;
  fix.scaled = rows.scaled;
  fix.flag = rows.flag;
  fix.count = rows.count;
  PhiGradArgs grads;
  grads.phi = a.weights.phi;
  grads.gamma = gamma;
  grads.grads_phi = a.grads.phi;
  grads.grads_gamma = a.grads.gamma;
  grads.repair = repair ? &fix : nullptr;
  // The mixing kernel wrote the rows of dalpha / dbeta before the dx
  // launches passed their waits, so their sums may run beside dx (unless
  // the scale backward summed them).
  ColumnSumArgs sums;
  sums.rows = at(b.contrib);
  sums.tokens = a.tokens;
  sums.width = s.N + s.num_alpha;
  sums.split = s.N;
  sums.partial = at(b.col_partial);
  sums.arrivals = arrivals;
  sums.out_a = a.grads.beta;
  sums.out_b = s.dynamic ? a.grads.alpha : nullptr;
  return LaunchDxAndPhiGrads(dx, grads, stream, split ? nullptr : &sums);
}

absl::Status LaunchPreForward(const PreForwardParams& p, Workspace ws,
                              cudaStream_t stream) {
  FusedForwardArgs a;
  a.spec = p.spec;
  a.tokens = p.tokens;
  a.act_dtype = p.act_dtype;
  a.x = p.x;
  a.weights = p.weights;
  a.y = p.y;
  a.h_pre = p.h_pre;
  a.h_post = p.h_post;
  a.h_res = p.h_res;
  a.h = p.h;
  a.mean_square = p.mean_square;
  return LaunchFusedForward(a, ws, stream);
}

absl::Status LaunchPreBackward(const PreBackwardParams& p, Workspace ws,
                               cudaStream_t stream) {
  FusedBackwardArgs a;
  a.spec = p.spec;
  a.tokens = p.tokens;
  a.act_dtype = p.act_dtype;
  a.x = p.x;
  a.weights = p.weights;
  a.dy = p.dy;
  a.dh_post = p.dh_post;
  a.dh_res = p.dh_res;
  a.dx_next = p.dx_next;
  a.dx = p.dx;
  a.grads = p.grads;
  a.h = p.h;
  a.mean_square = p.mean_square;
  return LaunchFusedBackward(a, ws, stream);
}

}  // namespace mhc::cuda
