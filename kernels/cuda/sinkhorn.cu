// Sinkhorn-Knopp forward and exact reverse mode (LINEAR and LOG), fp32.
// Determinism / batch invariance: one thread per token, the n x n matrix in
// registers (n = 4) or thread-local arrays, a fixed operation order; the
// reverse mode recomputes the forward iterations from in-thread checkpoints,
// so nothing per token beyond the outputs reaches global memory.
#include "common.cuh"
#include "dispatch.cuh"
#include "launch.h"
#include "mix.cuh"

namespace mhc::cuda {
namespace {

constexpr int kTokenThreads = 64;

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
  const unsigned grid =
      GridSize((p.tokens + kTokenThreads - 1) / kTokenThreads);
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
  const unsigned grid =
      GridSize((p.tokens + kTokenThreads - 1) / kTokenThreads);
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
