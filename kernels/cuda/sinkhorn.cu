// Sinkhorn-Knopp forward and exact reverse mode (LINEAR and LOG), fp32.
// Determinism / batch invariance: LINEAR with n in {2, 4, 8, 16} and
// T <= 20 runs n / 2 lanes per token (sinkhorn_lanes.cuh: shuffles stay
// inside the token's lanes, fixed orders); everything else runs one thread
// per token with the matrix in registers (n = 4) or thread-local arrays and
// recomputes the forward from in-thread checkpoints. Either way a token's
// bits depend on that token alone and nothing per token beyond the outputs
// reaches global memory.
#include "common.cuh"
#include "dispatch.cuh"
#include "launch.h"
#include "mix.cuh"
#include "sinkhorn_lanes.cuh"

namespace mhc::cuda {
namespace {

constexpr int kTokenThreads = 64;
constexpr int kLaneThreads = 128;

// Lane kernels: token m = global thread / L; a lane past the last token
// computes on zeros (it still takes part in its warp's shuffles) and stores
// nothing.
template <int N, int L>
__device__ __forceinline__ void LoadRows(const float* src, int64_t m, int lane,
                                         bool live, float (&v)[N / L][N]) {
  const float* row = src + m * N * N + lane * (N / L) * N;
#pragma unroll
  for (int r = 0; r < N / L; ++r) {
#pragma unroll
    for (int j = 0; j < N; ++j) v[r][j] = live ? row[r * N + j] : 0.0f;
  }
}

template <int N, int L>
__device__ __forceinline__ void StoreRows(float* dst, int64_t m, int lane,
                                          bool live,
                                          const float (&v)[N / L][N]) {
  if (!live) return;
  float* row = dst + m * N * N + lane * (N / L) * N;
#pragma unroll
  for (int r = 0; r < N / L; ++r) {
#pragma unroll
    for (int j = 0; j < N; ++j) row[r * N + j] = v[r][j];
  }
}

template <int N, int L>
__global__ void __launch_bounds__(kLaneThreads)
    sinkhorn_lanes_forward_kernel(int iterations, float eps, int64_t tokens,
                                  const float* logits, float* h_res) {
  using S = SinkhornLanes<N, L>;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t m = g / L;
  const int lane = static_cast<int>(g % L);
  const bool live = m < tokens;
  float a[S::kRows][N], p[S::kRows][N];
  LoadRows<N, L>(logits, live ? m : 0, lane, live, a);
  S::template Forward<false>(iterations, eps, a, p, typename S::Keep{});
  StoreRows<N, L>(h_res, m, lane, live, p);
}

template <int N, int L>
__global__ void __launch_bounds__(kLaneThreads)
    sinkhorn_lanes_backward_kernel(int iterations, float eps, int64_t tokens,
                                   const float* logits, const float* dh_res,
                                   float* dlogits) {
  using S = SinkhornLanes<N, L>;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t m = g / L;
  const int lane = static_cast<int>(g % L);
  const bool live = m < tokens;
  float a[S::kRows][N], y[S::kRows][N], dy[S::kRows][N];
  LoadRows<N, L>(logits, live ? m : 0, lane, live, a);
  __shared__ float kept[kLaneMaxIterations * S::kSlots * kLaneThreads];
  const typename S::Keep keep{kept, kLaneThreads, static_cast<int>(threadIdx.x),
                              lane};
  S::template Forward<true>(iterations, eps, a, y, keep);
  LoadRows<N, L>(dh_res, live ? m : 0, lane, live, dy);
  S::Backward(iterations, eps, a, y, dy, keep, a);
  StoreRows<N, L>(dlogits, m, lane, live, a);
}

// Runs f with IntTag<n> and the lane count when the lane kernels cover the
// spec; false otherwise.
template <typename F>
bool DispatchLanes(const DevSpec& s, F&& f) {
  if (s.log_mode || s.iterations > kLaneMaxIterations || s.iterations < 1) {
    return false;
  }
  switch (s.n) {
    case 2:
      f(IntTag<2>{}, IntTag<1>{});
      return true;
    case 4:
      f(IntTag<4>{}, IntTag<2>{});
      return true;
    case 8:
      f(IntTag<8>{}, IntTag<4>{});
      return true;
    case 16:
      f(IntTag<16>{}, IntTag<8>{});
      return true;
    default:
      return false;
  }
}

unsigned LaneGrid(int64_t tokens, int lanes) {
  return GridSize((tokens * lanes + kLaneThreads - 1) / kLaneThreads);
}

template <int NT>
__global__ void __launch_bounds__(kTokenThreads)
    sinkhorn_forward_kernel(DevSpec s, int64_t tokens, const float* logits,
                            float* h_res) {
  const int64_t m = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (m >= tokens) return;
  const int nn = StreamCount<NT>(s) * StreamCount<NT>(s);
  float a[NT * NT], p[NT * NT];
#pragma unroll
  for (int e = 0; e < NT * NT; ++e) a[e] = e < nn ? logits[m * nn + e] : 0.0f;
  SinkhornForwardToken<NT>(s, a, p);
#pragma unroll
  for (int e = 0; e < NT * NT; ++e) {
    if (e >= nn) break;
    h_res[m * nn + e] = p[e];
  }
}

template <int NT>
__global__ void __launch_bounds__(kTokenThreads)
    sinkhorn_backward_kernel(DevSpec s, int64_t tokens, const float* logits,
                             const float* dh_res, float* dlogits) {
  const int64_t m = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (m >= tokens) return;
  const int nn = StreamCount<NT>(s) * StreamCount<NT>(s);
  float a[NT * NT], dp[NT * NT], da[NT * NT];
#pragma unroll
  for (int e = 0; e < NT * NT; ++e) {
    a[e] = e < nn ? logits[m * nn + e] : 0.0f;
    dp[e] = e < nn ? dh_res[m * nn + e] : 0.0f;
  }
  SinkhornBackwardToken<NT>(s, a, dp, da);
#pragma unroll
  for (int e = 0; e < NT * NT; ++e) {
    if (e >= nn) break;
    dlogits[m * nn + e] = da[e];
  }
}

}  // namespace

absl::Status LaunchSinkhornForward(const SinkhornForwardParams& p,
                                   cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*p.spec);
  if (p.tokens == 0) return absl::OkStatus();
  const bool lanes = DispatchLanes(s, [&](auto nt, auto lt) {
    constexpr int kN = decltype(nt)::value, kL = decltype(lt)::value;
    sinkhorn_lanes_forward_kernel<kN, kL>
        <<<LaneGrid(p.tokens, kL), kLaneThreads, 0, stream>>>(
            s.iterations, s.eps_sk, p.tokens, p.logits, p.h_res);
  });
  const unsigned grid =
      GridSize((p.tokens + kTokenThreads - 1) / kTokenThreads);
  if (!lanes)
    DispatchMix(s.n, [&](auto nt) {
      sinkhorn_forward_kernel<decltype(nt)::value>
          <<<grid, kTokenThreads, 0, stream>>>(s, p.tokens, p.logits, p.h_res);
    });
  MHC_CUDA_CHECK_LAUNCH("sinkhorn forward",
                        ShapeString(*p.spec, p.tokens, DType::kF32));
  return absl::OkStatus();
}

absl::Status LaunchSinkhornBackward(const SinkhornBackwardParams& p,
                                    cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*p.spec);
  if (p.tokens == 0) return absl::OkStatus();
  const bool lanes = DispatchLanes(s, [&](auto nt, auto lt) {
    constexpr int kN = decltype(nt)::value, kL = decltype(lt)::value;
    sinkhorn_lanes_backward_kernel<kN, kL>
        <<<LaneGrid(p.tokens, kL), kLaneThreads, 0, stream>>>(
            s.iterations, s.eps_sk, p.tokens, p.logits, p.dh_res, p.dlogits);
  });
  const unsigned grid =
      GridSize((p.tokens + kTokenThreads - 1) / kTokenThreads);
  if (!lanes)
    DispatchMix(s.n, [&](auto nt) {
      sinkhorn_backward_kernel<decltype(nt)::value>
          <<<grid, kTokenThreads, 0, stream>>>(s, p.tokens, p.logits, p.dh_res,
                                               p.dlogits);
    });
  MHC_CUDA_CHECK_LAUNCH("sinkhorn backward",
                        ShapeString(*p.spec, p.tokens, DType::kF32));
  return absl::OkStatus();
}

}  // namespace mhc::cuda
