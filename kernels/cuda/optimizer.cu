// The optimizer step on the device (mhc/ops/optimizer.h). With a norm: one
// launch per block writes a float64 partial per kNormChunk chunk (one CTA
// each, elements in a fixed thread order), then one CTA sums the partials in
// (block, chunk) order and writes the norm and the clip scale. The update
// launches read the scale from device memory, so the host never waits.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common.cuh"
#include "common/optimizer_update.h"
#include "launch.h"
#include "optimizer.cuh"

namespace mhc::cuda {
namespace {

// Grid-stride update launches use at most this many CTAs.
constexpr int64_t kMaxUpdateBlocks = int64_t{1} << 16;

__global__ void __launch_bounds__(kOptimizerThreads)
    SquaredNormPartials(const float* __restrict__ grads, int64_t count,
                        double* __restrict__ partials) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kNormChunk;
  const int64_t elements = min(kNormChunk, count - first);
  double sum = 0.0;
  for (int64_t e = threadIdx.x; e < elements; e += kOptimizerThreads) {
    const double g = grads[first + e];
    sum += g * g;
  }
  sum = BlockSumF64(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

__global__ void __launch_bounds__(kOptimizerThreads)
    FinishNorm(const double* __restrict__ partials, int64_t count,
               float max_grad_norm, double* grad_norm, float* clip_scale) {
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kOptimizerThreads) {
    sum += partials[i];
  }
  sum = BlockSumF64(sum);
  if (threadIdx.x == 0) {
    const double norm = sqrt(sum);
    if (grad_norm != nullptr) *grad_norm = norm;
    *clip_scale = ClipScale(norm, max_grad_norm);
  }
}

// `clip_scale` null: no clipping.
template <bool kAdamW>
__global__ void __launch_bounds__(kOptimizerThreads)
    UpdateBlock(OptimizerCoefficients c, const float* clip_scale,
                float* __restrict__ values, float* __restrict__ grads,
                float* __restrict__ slots, int64_t count, bool zero_grads) {
  const float scale = clip_scale != nullptr ? *clip_scale : 1.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kOptimizerThreads;
  for (int64_t e =
           static_cast<int64_t>(blockIdx.x) * kOptimizerThreads + threadIdx.x;
       e < count; e += stride) {
    const float g = grads[e];
    if constexpr (kAdamW) {
      AdamWElement(c, scale, g, &values[e], &slots[e], &slots[count + e]);
    } else {
      SgdElement(c, scale, g, &values[e], &slots[e]);
    }
    if (zero_grads) grads[e] = 0.0f;
  }
}

}  // namespace

absl::Status LaunchOptimizerStep(const OptimizerStepParams& p, Workspace ws,
                                 cudaStream_t stream) {
  const float* clip_scale = nullptr;
  if (NeedsGradNorm(p)) {
    float* scale = static_cast<float*>(ws.data);
    double* partials = reinterpret_cast<double*>(static_cast<char*>(ws.data) +
                                                 kOptimizerScalarBytes);
    int64_t written = 0;
    for (int64_t i = 0; i < p.num_tensors; ++i) {
      const OptimizerTensor& t = p.tensors[i];
      const int64_t chunks = (t.count + kNormChunk - 1) / kNormChunk;
      if (chunks == 0) continue;
      SquaredNormPartials<<<static_cast<unsigned>(chunks), kOptimizerThreads, 0,
                            stream>>>(t.grads, t.count, partials + written);
      MHC_CUDA_CHECK_LAUNCH(
          "optimizer norm",
          absl::StrCat("block ", i, ", ", t.count, " elements"));
      written += chunks;
    }
    FinishNorm<<<1, kOptimizerThreads, 0, stream>>>(
        partials, written, p.hyper.max_grad_norm, p.grad_norm, scale);
    MHC_CUDA_CHECK_LAUNCH("optimizer norm", absl::StrCat(written, " partials"));
    if (p.hyper.max_grad_norm > 0.0f) clip_scale = scale;
  }
  const bool adamw = p.hyper.algorithm == OptimizerAlgorithm::kAdamW;
  for (int64_t i = 0; i < p.num_tensors; ++i) {
    const OptimizerTensor& t = p.tensors[i];
    if (t.count == 0) continue;
    const OptimizerCoefficients c = MakeOptimizerCoefficients(p.hyper, t.step);
    const int64_t blocks =
        std::min(kMaxUpdateBlocks,
                 (t.count + kOptimizerThreads - 1) / kOptimizerThreads);
    auto kernel = adamw ? &UpdateBlock<true> : &UpdateBlock<false>;
    kernel<<<static_cast<unsigned>(blocks), kOptimizerThreads, 0, stream>>>(
        c, clip_scale, t.values, t.grads, t.slots, t.count, p.zero_grads);
    MHC_CUDA_CHECK_LAUNCH(
        absl::StrCat("optimizer ", OptimizerAlgorithmName(p.hyper.algorithm)),
        absl::StrCat("block ", i, ", ", t.count, " elements"));
  }
  return absl::OkStatus();
}

}  // namespace mhc::cuda
