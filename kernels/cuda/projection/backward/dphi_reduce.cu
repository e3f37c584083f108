// The dphi chunk partials of every projection backward variant added in
// chunk order into the phi and gamma gradients (but for the one-chunk
// launches of the n = 4 warpgroup kernels, which add theirs themselves); in
// the fused backward also the overflow repair's pass for the repaired
// tokens.
#include <type_traits>

#include "common.cuh"
#include "dispatch.cuh"
#include "launch.h"
#include "overflow_repair.cuh"
#include "overflow_repair.h"
#include "projection/backward/dphi_grads.cuh"
#include "projection/plan.h"

namespace mhc::cuda {
namespace {

// A block per kReduceCols consecutive k: lane group j (of kReduceRows) takes
// rows g = j, j + kReduceRows, ... for its column, adds the chunk partials
// in chunk order, and dgamma adds the groups' row sums in group order (an
// order fixed by N alone). Spreading g over the block keeps enough loads in
// flight: a thread per k alone was latency bound (docs/decisions.md).
// T (the activation type; void: none) adds the fused backward's overflow
// repair pass (RepairColumn, overflow_repair.cuh): once the block's barrier
// has the column's sums written, the group-0 thread of column k adds the
// repaired tokens' terms in token order, as a kernel of its own after this
// one did, so a backward pays no launch for it; with no repaired token (the
// mixing kernel's count) it costs that count's load.
// With the pass the kernel is capped at the registers it has without it
// (40: six CTAs per SM, whose loads in flight the reduction needs); uncapped
// it took 48, and the pass out of line spilled.
// dependents_beside: the column sums that follow (rows written before this
// kernel, outputs it does not touch) start once every CTA is past its wait
// and overlap the reduction instead of following it.
constexpr int kReduceCols = 32;
constexpr int kReduceRows = kPhiGradRows;
constexpr int kReduceGroup = 8;
template <typename T>
inline constexpr int kReduceBlocks = std::is_void_v<T> ? 0 : 6;
template <typename T>
__global__ void __launch_bounds__(kReduceCols* kReduceRows, kReduceBlocks<T>)
    phi_grad_reduce_kernel(DevSpec s, int64_t chunks, const float* partial,
                           const float* phi, const float* gamma,
                           float* grads_phi, float* grads_gamma, int64_t tokens,
                           RepairBackwardArgs repair, bool dependents_beside) {
  WaitForPrerequisiteGrid();  // the dphi partials
  if (dependents_beside) AllowDependentLaunch();
  constexpr bool kRepair = !std::is_void_v<T>;
  __shared__ float dgamma_rows[kReduceRows][kReduceCols];
  const int col = threadIdx.x % kReduceCols;
  const int row = threadIdx.x / kReduceCols;
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kReduceCols + col;
  const int64_t plane = static_cast<int64_t>(s.N) * s.K;
  // Loaded first, so its latency hides under the sums.
  const int repaired = kRepair && row == 0 ? *repair.count : 0;
  float dgamma = 0.0f;
  if (k < s.K) {
    const float gamma_k = s.has_gamma ? gamma[k] : 1.0f;
    for (int g = row; g < s.N; g += kReduceRows) {
      // phi and the gradient load beside the chunk partials, not after.
      const float phi_gk = phi[g * s.K + k];
      const float grad_gk =
          grads_phi != nullptr ? grads_phi[g * s.K + k] : 0.0f;
      const float sum =
          OrderedSum<kReduceGroup>(partial + g * s.K + k, plane, chunks);
      if (grads_phi != nullptr) {
        grads_phi[g * s.K + k] = PhiGradAfter(grad_gk, sum, gamma_k);
      }
      dgamma = fmaf(sum, phi_gk, dgamma);
    }
  }
  dgamma_rows[row][col] = dgamma;
  __syncthreads();  // also makes the column's grads_phi visible to row 0
  if (row != 0 || k >= s.K) return;
  if (grads_gamma != nullptr) {
    float total = 0.0f;
    for (int j = 0; j < kReduceRows; ++j) total += dgamma_rows[j][col];
    grads_gamma[k] += total;
  }
  if constexpr (kRepair) {
    if (repaired != 0) RepairColumn<T>(s, tokens, k, repair);
  }
}

}  // namespace

absl::Status LaunchPhiGradReduce(const LayerSpec& spec, int64_t tokens,
                                 const float* partial, const float* phi,
                                 const float* gamma, float* grads_phi,
                                 float* grads_gamma, cudaStream_t stream,
                                 const RepairBackwardArgs* repair,
                                 bool dependents_beside) {
  const DevSpec s = MakeDevSpec(spec);
  if (!s.has_gamma) grads_gamma = nullptr;
  if (grads_phi == nullptr && grads_gamma == nullptr) {
    // Nothing to reduce: the repair pass runs as a kernel of its own.
    if (repair == nullptr) return absl::OkStatus();
    return LaunchRepairBackward(spec, tokens, *repair, stream);
  }
  const unsigned grid = GridSize((s.K + kReduceCols - 1) / kReduceCols);
  const int64_t chunks = NumPhiChunks(spec, tokens);
  gamma = s.has_gamma ? gamma : nullptr;
  cudaError_t err = cudaSuccess;
  auto launch = [&](auto kernel) {
    err = LaunchAfterPrevious(
        kernel, dim3(grid), dim3(kReduceCols * kReduceRows), 0, stream, s,
        chunks, partial, phi, gamma, grads_phi, grads_gamma, tokens,
        repair != nullptr ? *repair : RepairBackwardArgs{}, dependents_beside);
  };
  if (repair == nullptr || tokens == 0 || !s.dynamic) {
    launch(phi_grad_reduce_kernel<void>);
  } else {
    switch (repair->dtype) {
      case DType::kBF16:
        launch(phi_grad_reduce_kernel<__nv_bfloat16>);
        break;
      case DType::kF16:
        launch(phi_grad_reduce_kernel<__half>);
        break;
      default:
        launch(phi_grad_reduce_kernel<float>);
        break;
    }
  }
  MHC_CUDA_RETURN_IF_ERROR(err, "phi gradient reduce",
                           LaunchShape(spec, tokens, DType::kF32));
  MHC_CUDA_CHECK_LAUNCH("phi gradient reduce",
                        LaunchShape(spec, tokens, DType::kF32));
  return absl::OkStatus();
}

}  // namespace mhc::cuda
