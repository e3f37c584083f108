// Expand x[i][c] = e[c] and its backward de[c] = sum_i dx[i][c].
// Determinism / batch invariance: one CTA per token, purely elementwise, the
// stream sum in order i = 0..n-1; nothing depends on M or on the grid.
#include "common.cuh"
#include "dispatch.cuh"
#include "launch.h"
#include "primitives/row_access.cuh"
#include "primitives/staged_windows.cuh"

namespace mhc::cuda {
namespace {

template <typename T, int NT, int V, bool kStrided>
__global__ void __launch_bounds__(kRowThreads)
    expand_forward_kernel(DevSpec s, const T* e, T* x) {
  const int n = NT == 4 ? 4 : s.n;
  const int64_t m = blockIdx.x;
  const T* in = e + m * s.C;
  T* row = x + m * s.K;
  for (int64_t c = FirstChannel<V, kStrided>(threadIdx.x); c < s.C;
       c += kRowThreads * V) {
    float ev[V];
    LoadChannels<T, V, kStrided>(in, c, s.C, ev);
    float out[NT][V];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
#pragma unroll
      for (int v = 0; v < V; ++v) out[i][v] = ev[v];
    }
    StoreStreams<T, NT, V, kStrided>(s, n, row, c, out);
  }
}

template <typename T, int NT, int V, bool kStrided, bool kStaged>
__global__ void __launch_bounds__(kRowThreads)
    expand_backward_kernel(DevSpec s, const T* dx, T* de) {
  const int n = NT == 4 ? 4 : s.n;
  const int64_t m = blockIdx.x;
  const T* row = dx + m * s.K;
  T* out = de + m * s.C;
  const T* dx_end = dx + int64_t{gridDim.x} * s.K;  // a CTA per token
  ForEachStreamsStep<T, NT, V, kStrided, kStaged, kRowThreads,
                     kRowThreads / 32>(
      s, n, row, dx_end, threadIdx.x, [&](int64_t c, const float(&xv)[NT][V]) {
        float acc[V];
#pragma unroll
        for (int v = 0; v < V; ++v) acc[v] = xv[0][v];
#pragma unroll
        for (int i = 1; i < NT; ++i) {
          if (i >= n) break;
#pragma unroll
          for (int v = 0; v < V; ++v) acc[v] += xv[i][v];
        }
        StoreChannels<T, V, kStrided>(out, c, s.C, acc);
      });
}

}  // namespace

RowAccessPlan PlanOf(const ExpandForwardParams& p) {
  return RowAccessOf<RowKernel::kExpandForward>(*p.spec, p.act_dtype, p.e, p.x);
}

RowAccessPlan PlanOf(const ExpandBackwardParams& p) {
  return RowAccessOf<RowKernel::kExpandBackward>(*p.spec, p.act_dtype, p.dx,
                                                 p.de);
}

absl::Status LaunchExpandForward(const ExpandForwardParams& p,
                                 cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*p.spec);
  const RowAccessPlan plan = PlanOf(p);
  const LaunchShape shape(*p.spec, p.tokens, p.act_dtype);
  const bool built = DispatchRows<RowKernel::kExpandForward>(
      p.act_dtype, plan, [&](auto tt, auto nt, auto vt, auto rt, auto) {
        using T = typename decltype(tt)::type;
        // Never staged (StagesRows).
        expand_forward_kernel<T, decltype(nt)::value, decltype(vt)::value,
                              decltype(rt)::value>
            <<<GridSize(p.tokens), kRowThreads, 0, stream>>>(
                s, static_cast<const T*>(p.e), static_cast<T*>(p.x));
      });
  if (!built) return NoRowKernel("expand forward", shape, plan);
  MHC_CUDA_CHECK_LAUNCH("expand forward", shape);
  return absl::OkStatus();
}

absl::Status LaunchExpandBackward(const ExpandBackwardParams& p,
                                  cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*p.spec);
  const RowAccessPlan plan = PlanOf(p);
  const LaunchShape shape(*p.spec, p.tokens, p.act_dtype);
  const bool built = DispatchRows<RowKernel::kExpandBackward>(
      p.act_dtype, plan, [&](auto tt, auto nt, auto vt, auto rt, auto st) {
        using T = typename decltype(tt)::type;
        expand_backward_kernel<T, decltype(nt)::value, decltype(vt)::value,
                               decltype(rt)::value, decltype(st)::value>
            <<<GridSize(p.tokens), kRowThreads, 0, stream>>>(
                s, static_cast<const T*>(p.dx), static_cast<T*>(p.de));
      });
  if (!built) return NoRowKernel("expand backward", shape, plan);
  MHC_CUDA_CHECK_LAUNCH("expand backward", shape);
  return absl::OkStatus();
}

}  // namespace mhc::cuda
