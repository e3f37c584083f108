// The fused backward's pass for tokens the mixing kernel repaired
// (RepairColumn, overflow_repair.cuh) where no dphi reduction runs for it to
// ride on (no phi / gamma gradient asked for): a thread per k. With no
// repaired token (the count the mixing kernel kept) every thread returns at
// once.
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
  WaitForPrerequisiteGrid();  // the repair count and rows
  if (*a.count == 0) return;
  const int64_t k =
      static_cast<int64_t>(blockIdx.x) * kRepairThreads + threadIdx.x;
  if (k < s.K) RepairColumn<T>(s, tokens, k, a);
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
                                  const RepairBackwardArgs& a,
                                  cudaStream_t stream) {
  if (tokens == 0 || !spec.dynamic) return absl::OkStatus();
  const DevSpec s = MakeDevSpec(spec);
  const unsigned grid = GridSize((s.K + kRepairThreads - 1) / kRepairThreads);
  auto launch = [&](auto kernel) {
    return LaunchAfterPrevious(kernel, dim3(grid), dim3(kRepairThreads), 0,
                               stream, s, tokens, a);
  };
  const cudaError_t err =
      a.dtype == DType::kBF16  ? launch(repair_backward_kernel<__nv_bfloat16>)
      : a.dtype == DType::kF16 ? launch(repair_backward_kernel<__half>)
                               : launch(repair_backward_kernel<float>);
  MHC_CUDA_RETURN_IF_ERROR(err, "overflow repair backward",
                           ShapeString(spec, tokens, a.dtype));
  MHC_CUDA_CHECK_LAUNCH("overflow repair backward",
                        ShapeString(spec, tokens, a.dtype));
  return absl::OkStatus();
}

}  // namespace mhc::cuda
