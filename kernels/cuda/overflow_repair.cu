// The fused backward's pass for tokens the mixing kernel repaired
// (overflow_repair.cuh): their dh and dms rows reached the dx kernel as
// zeros, so it wrote dx = H_pre dy (+ R dx_next) for them and added nothing
// to dphi. This kernel rewrites their dx with the projection terms, from the
// scaled dh_s, dms_s and x 2^-e (dx = 2^-e (sum_g dh_s phi' + dms_s 2 x_s /
// K) + the rest, fp32, rounded once), and adds dh_s x_s, which is dh v, to
// dphi' in token order. With no repaired token (the count the mixing kernel
// kept) every thread returns at once.
//
// Also the projection op's repair (LaunchProjectionRepair).
//
// Determinism: each dx element and each dphi / dgamma element is written by
// one thread, tokens in order.
#include "dispatch.cuh"
#include "launch.h"
#include "overflow_repair.cuh"
#include "overflow_repair.h"

namespace mhc::cuda {
namespace {

constexpr int kRepairThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kRepairThreads)
    repair_backward_kernel(DevSpec s, int64_t tokens, RepairBackwardArgs a) {
  if (*a.count == 0) return;
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  const T* dx_next = static_cast<const T*>(a.dx_next);
  T* dx = static_cast<T*>(a.dx);
  const float ms_scale = 2.0f / static_cast<float>(s.K);
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       k < s.K; k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(s.minor ? k % s.n : k / s.C);
    const int64_t c = s.minor ? k / s.n : k % s.C;
    const float gamma_k = a.gamma != nullptr ? a.gamma[k] : 1.0f;
    for (int64_t m = 0; m < tokens; ++m) {
      const int flag = a.flag[m];
      if (flag == 0) continue;
      const int e = flag - kRepairFlagBias;
      const float* scaled = a.scaled + m * (s.N + 1);
      const float xs = ldexpf(ToFloat(x[m * s.K + k]), -e);
      float proj = 0.0f;
      for (int g = 0; g < s.N; ++g) {
        proj = fmaf(scaled[g], a.phi[g * s.K + k] * gamma_k, proj);
      }
      proj = fmaf(scaled[s.N] * ms_scale, xs, proj);
      float out = ldexpf(proj, -e);
      out = fmaf(a.h_pre[m * s.n + i], ToFloat(dy[m * s.C + c]), out);
      if (a.r != nullptr) {
        for (int j = 0; j < s.n; ++j) {
          out = fmaf(a.r[(m * s.n + i) * s.n + j],
                     ToFloat(dx_next[m * s.K + XIndex(s, j, c)]), out);
        }
      }
      dx[m * s.K + k] = FromFloat<T>(out);
      if (a.grad_phi == nullptr && a.grad_gamma == nullptr) continue;
      float dgamma = 0.0f;
      for (int g = 0; g < s.N; ++g) {
        const float dfolded = scaled[g] * xs;  // this token's dphi'[g][k]
        if (a.grad_phi != nullptr) a.grad_phi[g * s.K + k] += dfolded * gamma_k;
        dgamma = fmaf(dfolded, a.phi[g * s.K + k], dgamma);
      }
      if (a.grad_gamma != nullptr) a.grad_gamma[k] += dgamma;
    }
  }
}

// The projection op's overflow repair: a token whose mean square exceeds
// kRepairMeanSquare or is not finite, or whose h is not finite, gets its
// float64 values rounded to fp32, as the fused ops keep them; the fp32 sum
// of squares overflows before the division by K where the mean square
// itself still fits. A thread per token; the others return after the check.
// Only the single op runs it: the fused ops repair in their mixing kernels.
constexpr int kRepairCheckThreads = 128;
__global__ void __launch_bounds__(kRepairCheckThreads)
    projection_repair_kernel(DevSpec s, int64_t tokens, RepairSource src,
                             float* h, float* mean_square) {
  const int64_t m =
      static_cast<int64_t>(blockIdx.x) * kRepairCheckThreads + threadIdx.x;
  if (m >= tokens) return;
  float* row = h + m * s.N;
  if (!NeedsRepair(s, row, mean_square[m])) return;
  float ms_s = 0.0f;
  // In place: the scaled values, then unscaled element by element.
  const int flag = RepairProjection(s, src, m, row, &ms_s);
  if (flag == 0) return;  // x is not finite: the fp32 values carry it
  StoreUnscaled(s, flag - kRepairFlagBias, row, ms_s, row, mean_square + m);
}

}  // namespace

absl::Status LaunchProjectionRepair(const LayerSpec& spec, int64_t tokens,
                                    const RepairSource& src, float* h,
                                    float* mean_square, cudaStream_t stream) {
  if (tokens == 0) return absl::OkStatus();
  const DevSpec s = MakeDevSpec(spec);
  projection_repair_kernel<<<GridSize((tokens + kRepairCheckThreads - 1) /
                                      kRepairCheckThreads),
                             kRepairCheckThreads, 0, stream>>>(s, tokens, src,
                                                               h, mean_square);
  MHC_CUDA_CHECK_LAUNCH("projection forward (overflow repair)",
                        ShapeString(spec, tokens, src.dtype));
  return absl::OkStatus();
}

absl::Status LaunchRepairBackward(const LayerSpec& spec, int64_t tokens,
                                  DType dtype, const RepairBackwardArgs& a,
                                  cudaStream_t stream) {
  if (tokens == 0 || !spec.dynamic) return absl::OkStatus();
  const DevSpec s = MakeDevSpec(spec);
  const unsigned grid = GridSize((s.K + kRepairThreads - 1) / kRepairThreads);
  switch (dtype) {
    case DType::kBF16:
      repair_backward_kernel<__nv_bfloat16>
          <<<grid, kRepairThreads, 0, stream>>>(s, tokens, a);
      break;
    case DType::kF16:
      repair_backward_kernel<__half>
          <<<grid, kRepairThreads, 0, stream>>>(s, tokens, a);
      break;
    default:
      repair_backward_kernel<float>
          <<<grid, kRepairThreads, 0, stream>>>(s, tokens, a);
      break;
  }
  MHC_CUDA_CHECK_LAUNCH("overflow repair backward",
                        ShapeString(spec, tokens, dtype));
  return absl::OkStatus();
}

}  // namespace mhc::cuda
