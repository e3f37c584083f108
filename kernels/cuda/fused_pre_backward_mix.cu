// The fused backward's mixing kernels (fused_pre_backward_mix.h).
// Determinism / batch invariance: a token's rows come from its own values in
// a fixed order, on one thread or on a quad of lanes that computes every
// value with the same operations in the same order (sinkhorn4_quad.cuh).
#include "common.cuh"
#include "dispatch.cuh"
#include "fused_pre_backward_mix.h"
#include "mix.cuh"
#include "overflow_repair.cuh"
#include "plans/fused.h"
#include "sinkhorn4.cuh"
#include "sinkhorn4_quad.cuh"

namespace mhc::cuda {
namespace {

// The per-token reverse mode of the fused backward, from the token's logits
// h_row [N] (dynamic layers), mean square and dh_pre [NT]: scale forward,
// Sinkhorn forward (R for the dx kernel) and backward, scale backward.
// Writes the per-token rows the dx kernel and the parameter reductions read.
constexpr int kMixThreads = 64;  // 40 KB of kept Sinkhorn denominators

// With `keep` (n = 4, sk4::Applies) the Sinkhorn runs as sinkhorn4.cuh's
// single-pass forward and reverse with the denominators kept there.
using MixKeep = sk4::SharedKeep<kMixThreads>;
template <int NT, typename Keep = MixKeep>
__device__ __forceinline__ void BackwardMixToken(const DevSpec& s, int64_t m,
                                                 const float* h_row, float ms,
                                                 const float (&dhp)[NT],
                                                 const BackwardMixDev& a,
                                                 const Keep* keep) {
  const int n = StreamCount<NT>(s);
  float hp[NT], hq[NT], logits[NT * NT], da[NT * NT];
  // With `keep`, dH_res and dH_post are read before the first store: a store
  // may alias them as far as the compiler knows, and a load after it would
  // wait out its latency on the token's chain.
  [[maybe_unused]] float dp4[16], dq4[4];
  [[maybe_unused]] bool preloaded = false;
  if constexpr (NT == 4) {
    if (!s.head && keep != nullptr) {
#pragma unroll
      for (int e = 0; e < 16; ++e) dp4[e] = a.dh_res[m * 16 + e];
#pragma unroll
      for (int i = 0; i < 4; ++i) dq4[i] = i < n ? a.dh_post[m * n + i] : 0.0f;
      preloaded = true;
    }
  }
  ScaleForwardToken<NT>(s, h_row, ms, a.alpha, a.beta, hp, hq, logits);
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    if (i >= n) break;
    a.h_pre[m * n + i] = hp[i];
  }
#pragma unroll
  for (int e = 0; e < NT * NT; ++e) da[e] = 0.0f;
  if (!s.head && keep != nullptr) {
    if constexpr (NT == 4) {
      // One forward keeping its denominators, then the reverse from them.
      float p0[16], p[16];
      sk4::Forward(s.iterations, s.eps_sk, logits, p0, p, *keep);
      if (a.r != nullptr) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            a.r[(m * 4 + i) * 4 + j] =
                s.dest_rows ? p[j * 4 + i] : p[i * 4 + j];
          }
        }
      }
      sk4::Backward(s.iterations, p0, p, dp4, *keep, da);
    }
  } else if (!s.head) {
    if (a.r != nullptr) {
      float p[NT * NT];
      SinkhornForwardToken<NT>(s, logits, p);
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        if (i >= n) break;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          if (j >= n) break;
          a.r[(m * n + i) * n + j] = s.dest_rows ? p[j * n + i] : p[i * n + j];
        }
      }
    }
    float dp[NT * NT];
#pragma unroll
    for (int e = 0; e < NT * NT; ++e) {
      dp[e] = e < n * n ? a.dh_res[m * n * n + e] : 0.0f;
    }
    SinkhornBackwardToken<NT>(s, logits, dp, da);
  }
  const float* dh_post = s.head ? nullptr : a.dh_post + m * n;
  if constexpr (NT == 4) {
    if (preloaded) dh_post = dq4;
  }
  ScaleBackwardToken<NT>(s, h_row, ms, a.alpha, a.beta, dhp, dh_post, da,
                         s.dynamic ? a.dh + m * s.N : nullptr,
                         s.dynamic ? a.dms + m : nullptr,
                         a.contrib + m * (s.N + s.num_alpha));
}

// The reverse mode with one thread per token (logits recomputed by the
// projection, or none for static layers), so every token's Sinkhorn runs at
// once instead of a few per block.
// A token whose projection overflowed fp32 (overflow_repair.cuh): the reverse
// mode from its scaled float64 recompute. Its scaled dh and dms go to `rows`
// for the repair pass, and zeros to the dx kernel's rows, so that kernel
// adds no projection terms for it (x is finite: 0 x = 0 in dphi). A token
// whose x is not finite runs the fp32 reverse mode here instead. Writes the
// token's flag (0: not repaired). Out of line and the whole of the token's
// work, so the common path keeps nothing live across the call; it reads
// dh_pre again rather than take the caller's copy, which would put that
// copy in local memory.
template <int NT, typename Keep = MixKeep>
__device__ __noinline__ void RepairedBackwardMix(
    const DevSpec& s, int64_t m, const RepairSource& src, const float* h_row,
    float ms, const float* dh_pre, const BackwardMixDev& a, const Keep* keep,
    const RepairRows& rows) {
  const int n = StreamCount<NT>(s);
  float dhp[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) dhp[i] = i < n ? dh_pre[m * n + i] : 0.0f;
  float h_s[NT * NT + 2 * NT];
  float ms_s = 0.0f;
  const int flag = RepairProjection(s, src, m, h_s, &ms_s);
  rows.flag[m] = flag;
  if (flag == 0) {
    BackwardMixToken<NT>(s, m, h_row, ms, dhp, a, keep);
    return;
  }
  BackwardMixToken<NT>(ScaledSpec(s, flag - kRepairFlagBias), m, h_s, ms_s, dhp,
                       a, keep);
  float* scaled = rows.scaled + m * (s.N + 1);
  for (int g = 0; g < s.N; ++g) {
    scaled[g] = a.dh[m * s.N + g];
    a.dh[m * s.N + g] = 0.0f;
  }
  scaled[s.N] = a.dms[m];
  a.dms[m] = 0.0f;
  atomicAdd(rows.count, 1);  // an integer count: order does not matter
}

template <int NT>
__global__ void __launch_bounds__(kMixThreads)
    fused_backward_mix_kernel(DevSpec s, int64_t tokens, const float* dh_pre,
                              BackwardMixDev a, bool sinkhorn4,
                              RepairSource src, RepairRows rows) {
  WaitForPrerequisiteGrid();  // dh_pre and the zeroed repair count
  const int64_t m =
      static_cast<int64_t>(blockIdx.x) * kMixThreads + threadIdx.x;
  if (m >= tokens) return;
  const int n = StreamCount<NT>(s);
  float dhp[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) dhp[i] = i < n ? dh_pre[m * n + i] : 0.0f;
  const float* h_row = s.dynamic ? a.h_in + m * s.N : nullptr;
  const float ms = s.dynamic ? a.ms_in[m] : 0.0f;
  const bool repair = s.dynamic && NeedsRepair(s, h_row, ms);
  const MixKeep* k4 = nullptr;
  if constexpr (NT == 4) {
    __shared__ float4 kept[2 * kLaneMaxIterations * kMixThreads];
    const MixKeep keep{kept, static_cast<int>(threadIdx.x)};
    if (sinkhorn4) k4 = &keep;
    if (repair) {
      RepairedBackwardMix<NT>(s, m, src, h_row, ms, dh_pre, a, k4, rows);
      return;
    }
    BackwardMixToken<NT>(s, m, h_row, ms, dhp, a, k4);
  } else {
    if (repair) {
      RepairedBackwardMix<NT>(s, m, src, h_row, ms, dh_pre, a, k4, rows);
      return;
    }
    BackwardMixToken<NT>(s, m, h_row, ms, dhp, a, k4);
  }
  if (s.dynamic) rows.flag[m] = 0;
}

// The same reverse mode on a quad of lanes per token (BackwardMixLanes): the
// Sinkhorn steps split over the quad (sinkhorn4_quad.cuh), everything else
// on every lane of it, lane 0 writing. The same operations in the same
// order as BackwardMixToken's n = 4 path: the same bits. Small CTAs spread
// a small batch over more SMs (64 tokens a CTA measured slower,
// docs/decisions.md).
constexpr int kQuadMixTokens = 16;
constexpr int kQuadMixLogits = 4 * 4 + 2 * 4;  // N of an n = 4 mHC layer
using QuadMixKeep = sk4::QuadKeep<kQuadMixTokens>;

// h: the token's kept projection (dynamic layers); g_row: row q of its
// dH_res; dq4: its dH_post. Without `store` (a token past M or one the
// repair pass owns) nothing is written.
__device__ __forceinline__ void QuadBackwardMixToken(
    const DevSpec& s, int64_t m, const float (&h)[kQuadMixLogits], float ms,
    const float (&dhp)[4], const float (&g_row)[4], const float (&dq4)[4],
    const BackwardMixDev& a, const QuadMixKeep& keep, const sk4::Quad& quad,
    bool store) {
  float hp[4], hq[4], logits[16];
  ScaleForwardToken<4>(s, h, ms, a.alpha, a.beta, hp, hq, logits);
  const bool writer = store && quad.q == 0;
  if (writer) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a.h_pre[m * 4 + i] = hp[i];
  }
  float p0[16], p_row[4];
  sk4::QuadForward(s.iterations, s.eps_sk, logits, p0, p_row, keep, quad);
  if (store && a.r != nullptr) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      a.r[s.dest_rows ? (m * 4 + j) * 4 + quad.q : (m * 4 + quad.q) * 4 + j] =
          p_row[j];
    }
  }
  float da_row[4], da[16];
  sk4::QuadBackward(s.iterations, p0, p_row, g_row, keep, quad, da_row);
  sk4::QuadGather(da_row, quad, da);
  ScaleBackwardToken<4>(s, h, ms, a.alpha, a.beta, dhp, dq4, da,
                        s.dynamic && writer ? a.dh + m * s.N : nullptr,
                        s.dynamic && writer ? a.dms + m : nullptr,
                        writer ? a.contrib + m * (s.N + s.num_alpha) : nullptr);
}

__global__ void __launch_bounds__(4 * kQuadMixTokens)
    fused_backward_mix_quad_kernel(DevSpec s, int64_t tokens,
                                   const float* dh_pre, BackwardMixDev a,
                                   RepairSource src, RepairRows rows) {
  WaitForPrerequisiteGrid();  // dh_pre and the zeroed repair count
  // The dx / dphi kernel may start meanwhile: the warpgroup one fills its
  // phi'^T tile from the weights, no output of this kernel, before it waits.
  AllowDependentLaunch();
  __shared__ float4 kept[2 * kLaneMaxIterations * kQuadMixTokens];
  const int token = static_cast<int>(threadIdx.x) / 4;
  const int64_t token_m =
      static_cast<int64_t>(blockIdx.x) * kQuadMixTokens + token;
  // The quad's shuffles take the whole warp (sinkhorn4_quad.cuh), so a
  // quad past M runs the last token again and stores nothing.
  const bool live = token_m < tokens;
  const int64_t m = live ? token_m : tokens - 1;
  const sk4::Quad quad = sk4::Quad::OfLane();
  const QuadMixKeep keep{kept, token};
  // Every upstream row and the kept projection's row are asked for at
  // once, before the repair test, so that the token's chain waits out one
  // load latency; the test and both scale steps read the row from
  // registers.
  float dhp[4], g_row[4], dq4[4], h[kQuadMixLogits];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    dhp[i] = dh_pre[m * 4 + i];
    g_row[i] = a.dh_res[m * 16 + 4 * quad.q + i];
    dq4[i] = a.dh_post[m * 4 + i];
  }
  const float* h_row = s.dynamic ? a.h_in + m * kQuadMixLogits : nullptr;
#pragma unroll
  for (int g = 0; g < kQuadMixLogits; ++g) h[g] = s.dynamic ? h_row[g] : 0.0f;
  const float ms = s.dynamic ? a.ms_in[m] : 0.0f;
  const bool repair = s.dynamic && NeedsRepair(h, ms);
  QuadBackwardMixToken(s, m, h, ms, dhp, g_row, dq4, a, keep, quad,
                       live && !repair);
  __syncwarp();  // the quad's lanes are done with its slots
  if (!live || quad.q != 0) return;
  if (repair) {
    // Rare: the one-thread form (the same bits) on the quad's first lane,
    // which keeps its denominators in the quad's slots.
    const sk4::SharedKeep<kQuadMixTokens> keep4{kept, token};
    RepairedBackwardMix<4>(s, m, src, h_row, ms, dh_pre, a, &keep4, rows);
  } else if (s.dynamic) {
    rows.flag[m] = 0;
  }
}

}  // namespace

absl::Status LaunchBackwardMix(const LayerSpec& spec, int64_t tokens,
                               DType act_dtype, const float* dh_pre,
                               const BackwardMixDev& d, const RepairSource& src,
                               const RepairRows& rows, cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(spec);
  cudaError_t err = cudaSuccess;
  if (BackwardMixLanes(spec, tokens) == 4) {
    const unsigned grid =
        GridSize((tokens + kQuadMixTokens - 1) / kQuadMixTokens);
    err = LaunchAfterPrevious(fused_backward_mix_quad_kernel, dim3(grid),
                              dim3(4 * kQuadMixTokens), 0, stream, s, tokens,
                              dh_pre, d, src, rows);
  } else {
    const unsigned grid = GridSize((tokens + kMixThreads - 1) / kMixThreads);
    DispatchMix(s.n, [&](auto nt) {
      err = LaunchAfterPrevious(fused_backward_mix_kernel<decltype(nt)::value>,
                                dim3(grid), dim3(kMixThreads), 0, stream, s,
                                tokens, dh_pre, d,
                                sk4::Applies(s, /*backward=*/true), src, rows);
    });
  }
  const char* op = s.head ? "head backward" : "pre backward";
  const LaunchShape shape(spec, tokens, act_dtype);
  MHC_CUDA_RETURN_IF_ERROR(err, op, shape);
  MHC_CUDA_CHECK_LAUNCH(op, shape);
  return absl::OkStatus();
}

}  // namespace mhc::cuda
