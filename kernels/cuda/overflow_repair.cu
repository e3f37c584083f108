// The fused backward's pass for tokens the mixing kernel repaired
// (RepairColumn, overflow_repair.cuh) where no dphi reduction runs for it to
// ride on (no phi / gamma gradient asked for): a thread per k. With no
// repaired token (the count the mixing kernel kept) every thread returns at
// once.
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

}  // namespace

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
                           LaunchShape(spec, tokens, a.dtype));
  MHC_CUDA_CHECK_LAUNCH("overflow repair backward",
                        LaunchShape(spec, tokens, a.dtype));
  return absl::OkStatus();
}

}  // namespace mhc::cuda
