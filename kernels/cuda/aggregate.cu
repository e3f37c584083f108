// Aggregate y[c] = sum_i H_pre[i] x[i][c] and its backward.
// Determinism / batch invariance: one CTA per token; y and dx are
// elementwise with the stream sum in order i = 0..n-1; dh_pre is reduced over
// channels by a fixed-shape block reduction (BlockSum), so a token's results
// never depend on M or on the grid.
#include "common.cuh"
#include "dispatch.cuh"
#include "launch.h"
#include "mix.cuh"
#include "overflow_repair.cuh"
#include "primitives/row_access.cuh"
#include "primitives/staged_windows.cuh"
#include "projection/forward/mma.cuh"

namespace mhc::cuda {
namespace {

// H_pre of token m, slot i < NT (zero past n).
template <int NT>
__device__ __forceinline__ void FetchHPre(CtaValues<NT>& hp, int n,
                                          const float* h_pre, int64_t m) {
  hp.Fetch([&](int i) { return i < n ? h_pre[m * n + i] : 0.0f; });
}

// y of the CTA's token (m = blockIdx.x) from its H_pre in shared memory.
template <typename T, int NT, int V, bool kStrided, bool kStaged>
__device__ __forceinline__ void AggregateToken(const DevSpec& s, int n,
                                               const T* x, const float* hp,
                                               T* y) {
  const int64_t m = blockIdx.x;
  const T* row = x + m * s.K;
  T* out = y + m * s.C;
  const T* x_end = x + int64_t{gridDim.x} * s.K;  // a CTA per token
  ForEachStreamsStep<T, NT, V, kStrided, kStaged, kRowThreads,
                     kRowThreads / 32>(
      s, n, row, x_end, threadIdx.x, [&](int64_t c, const float(&xv)[NT][V]) {
        float acc[V];
#pragma unroll
        for (int v = 0; v < V; ++v) acc[v] = 0.0f;
#pragma unroll
        for (int i = 0; i < NT; ++i) {
          if (i >= n) break;
#pragma unroll
          for (int v = 0; v < V; ++v) acc[v] = fmaf(hp[i], xv[i][v], acc[v]);
        }
        StoreChannels<T, V, kStrided>(out, c, s.C, acc);
      });
}

template <typename T, int NT, int V, bool kStrided, bool kStaged>
__global__ void __launch_bounds__(kRowThreads)
    aggregate_forward_kernel(DevSpec s, const T* x, const float* h_pre, T* y) {
  WaitForPrerequisiteGrid();  // h_pre
  const int n = NT == 4 ? 4 : s.n;
  __shared__ float hp[NT];
  CtaValues<NT> mixing;
  FetchHPre(mixing, n, h_pre, blockIdx.x);
  mixing.Publish(hp);
  AggregateToken<T, NT, V, kStrided, kStaged>(s, n, x, hp, y);
}

// LaunchAggregateForward beside the mixing kernel. Started once the mixing
// kernel is past its wait, so the partials are complete; they and the
// parameters are read through L2, as the early column sums read their rows
// (scale.cu). Nothing here is read by the mixing kernel. Each of the token's
// logits on a thread of its own: the mixing kernel's chunk sums, repair test
// (NeedsRepair over the row) and gates.
template <typename T, int NT, int V, bool kStrided, bool kStaged>
__global__ void __launch_bounds__(kRowThreads)
    aggregate_beside_mixing_kernel(DevSpec s, int64_t tokens, const T* x,
                                   PreGateSource g, const float* h_pre, T* y) {
  const int n = NT == 4 ? 4 : s.n;
  const int64_t m = blockIdx.x;
  __shared__ float h_s[NT * NT + 2 * NT + 1];  // logits, then sum of squares
  __shared__ float hp[NT];
  const int width = s.N + 1;
  const TokenChunks rows = ChunksOf(g.partial, tokens, g.chunks, width, m);
  bool needs_repair = false;
  for (int e = threadIdx.x; e < width; e += kRowThreads) {
    // SumChunks' adds, through L2; four loads at a time hold fewer
    // registers.
    const float sum =
        OrderedSum<4, /*kThroughL2=*/true>(rows.first + e, rows.step, g.chunks);
    h_s[e] = sum;
    needs_repair |= e < s.N
                        ? NotFiniteBits(MagnitudeBits(sum))
                        : MeanSquareNeedsRepair(sum / static_cast<float>(s.K));
  }
  if (__syncthreads_or(needs_repair)) {
    WaitForPrerequisiteGrid();  // the mixing kernel's float64 recompute
    if (static_cast<int>(threadIdx.x) < n) {
      hp[threadIdx.x] = h_pre[m * n + threadIdx.x];
    }
  } else if (static_cast<int>(threadIdx.x) < n) {
    const float ms = h_s[s.N] / static_cast<float>(s.K);
    hp[threadIdx.x] =
        PreGate<true>(s, h_s[threadIdx.x], RmsFactor(s, ms), __ldcg(g.alpha),
                      __ldcg(g.beta + threadIdx.x));
  }
  __syncthreads();
  AggregateToken<T, NT, V, kStrided, kStaged>(s, n, x, hp, y);
  WaitForPrerequisiteGrid();  // the next kernel reads H_post and H_res
}

// Odd C at n = 4 (strided rows): the compiler's choice fits four CTAs per
// SM, too few loads in flight; five measured much faster
// (docs/decisions.md). The other modes already fit more CTAs.
template <int NT, bool kStrided>
inline constexpr int kAggregateBackwardBlocks = NT == 4 && kStrided ? 5 : 0;

template <typename T, int NT, int V, bool kStrided, bool kStaged>
__global__ void __launch_bounds__(kRowThreads,
                                  kAggregateBackwardBlocks<NT, kStrided>)
    aggregate_backward_kernel(DevSpec s, const T* x, const float* h_pre,
                              const T* dy, T* dx, float* dh_pre) {
  WaitForPrerequisiteGrid();  // dy and h_pre
  const int n = NT == 4 ? 4 : s.n;
  const int64_t m = blockIdx.x;
  __shared__ float hp[NT];
  __shared__ float red[NT * (kRowThreads / 32)];
  __shared__ float total[NT];
  CtaValues<NT> mixing;
  FetchHPre(mixing, n, h_pre, m);
  const T* row = x + m * s.K;
  const T* dy_row = dy + m * s.C;
  T* dx_row = dx + m * s.K;
  float acc[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) acc[i] = 0.0f;
  struct Loaded {
    float x[NT][V];
    float dy[V];
  };
  auto publish = [&] { mixing.Publish(hp); };
  auto step = [&](int64_t c, const Loaded& l) {
    float out[NT][V];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
#pragma unroll
      for (int v = 0; v < V; ++v) {
        acc[i] = fmaf(l.dy[v], l.x[i][v], acc[i]);
        out[i][v] = hp[i] * l.dy[v];
      }
    }
    StoreStreams<T, NT, V, kStrided>(s, n, dx_row, c, out);
  };
  const int64_t tokens = gridDim.x;  // a CTA per token
  auto rows = [&](Loaded& l, auto&& visit) {
#pragma unroll
    for (int i = 0; i < NT; ++i) visit(row + i * s.C, x + tokens * s.K, l.x[i]);
    visit(dy_row, dy + tokens * s.C, l.dy);
  };
  if (!ForEachStagedStep<Loaded, T, V, kStaged, kRowThreads, kRowThreads / 32,
                         NT + 1>(s.C, threadIdx.x, rows, publish, step)) {
    ForEachChannelStep<Loaded, V, kStrided, !kStrided>(
        s.C, threadIdx.x,
        [&](int64_t c, Loaded& l) {
          LoadStreams<T, NT, V, kStrided>(s, n, row, c, l.x);
          LoadChannels<T, V, kStrided>(dy_row, c, s.C, l.dy);
        },
        publish, step);
  }
  BlockSum<NT>(acc, red, total);
  if (threadIdx.x < n) dh_pre[m * n + threadIdx.x] = total[threadIdx.x];
}

}  // namespace

RowAccessPlan PlanOf(const AggregateForwardParams& p) {
  return RowAccessOf<RowKernel::kAggregateForward>(*p.spec, p.act_dtype, p.x,
                                                   p.y);
}

RowAccessPlan PlanOf(const AggregateBackwardParams& p) {
  return RowAccessOf<RowKernel::kAggregateBackward>(*p.spec, p.act_dtype, p.x,
                                                    p.dy, p.dx);
}

absl::Status LaunchAggregateForward(const AggregateForwardParams& p,
                                    cudaStream_t stream,
                                    const PreGateSource* beside_mixing) {
  const DevSpec s = MakeDevSpec(*p.spec);
  const RowAccessPlan plan = PlanOf(p);
  const LaunchShape shape(*p.spec, p.tokens, p.act_dtype);
  cudaError_t err = cudaSuccess;
  const bool built = DispatchRows<RowKernel::kAggregateForward>(
      p.act_dtype, plan, [&](auto tt, auto nt, auto vt, auto rt, auto st) {
        using T = typename decltype(tt)::type;
        constexpr int kNT = decltype(nt)::value, kV = decltype(vt)::value;
        constexpr bool kStrided = decltype(rt)::value;
        constexpr bool kStaged = decltype(st)::value;
        const auto* x = static_cast<const T*>(p.x);
        auto* y = static_cast<T*>(p.y);
        err = beside_mixing == nullptr
                  ? LaunchAfterPrevious(
                        aggregate_forward_kernel<T, kNT, kV, kStrided, kStaged>,
                        dim3(GridSize(p.tokens)), dim3(kRowThreads), 0, stream,
                        s, x, p.h_pre, y)
                  : LaunchAfterPrevious(
                        aggregate_beside_mixing_kernel<T, kNT, kV, kStrided,
                                                       kStaged>,
                        dim3(GridSize(p.tokens)), dim3(kRowThreads), 0, stream,
                        s, p.tokens, x, *beside_mixing, p.h_pre, y);
      });
  if (!built) return NoRowKernel("aggregate forward", shape, plan);
  MHC_CUDA_RETURN_IF_ERROR(err, "aggregate forward", shape);
  MHC_CUDA_CHECK_LAUNCH("aggregate forward", shape);
  return absl::OkStatus();
}

absl::Status LaunchAggregateBackward(const AggregateBackwardParams& p,
                                     cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*p.spec);
  const RowAccessPlan plan = PlanOf(p);
  const LaunchShape shape(*p.spec, p.tokens, p.act_dtype);
  cudaError_t err = cudaSuccess;
  const bool built = DispatchRows<RowKernel::kAggregateBackward>(
      p.act_dtype, plan, [&](auto tt, auto nt, auto vt, auto rt, auto st) {
        using T = typename decltype(tt)::type;
        err = LaunchAfterPrevious(
            aggregate_backward_kernel<T, decltype(nt)::value,
                                      decltype(vt)::value, decltype(rt)::value,
                                      decltype(st)::value>,
            dim3(GridSize(p.tokens)), dim3(kRowThreads), 0, stream, s,
            static_cast<const T*>(p.x), p.h_pre, static_cast<const T*>(p.dy),
            static_cast<T*>(p.dx), p.dh_pre);
      });
  if (!built) return NoRowKernel("aggregate backward", shape, plan);
  MHC_CUDA_RETURN_IF_ERROR(err, "aggregate backward", shape);
  MHC_CUDA_CHECK_LAUNCH("aggregate backward", shape);
  return absl::OkStatus();
}

}  // namespace mhc::cuda
