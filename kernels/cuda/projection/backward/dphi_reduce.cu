// The dphi chunk partials of every projection backward variant added in
// chunk order into the phi and gamma gradients.
#include "common.cuh"
#include "dispatch.cuh"
#include "launch.h"
#include "projection/plan.h"

namespace mhc::cuda {
namespace {

// A block per kReduceCols consecutive k: lane group j (of kReduceRows) takes
// rows g = j, j + kReduceRows, ... for its column, adds the chunk partials
// in chunk order, and dgamma adds the groups' row sums in group order (an
// order fixed by N alone). Spreading g over the block keeps enough loads in
// flight: a thread per k alone was latency bound (docs/decisions.md).
constexpr int kReduceCols = 32;
constexpr int kReduceRows = 8;
constexpr int kReduceGroup = 8;
__global__ void __launch_bounds__(kReduceCols* kReduceRows)
    phi_grad_reduce_kernel(DevSpec s, int64_t chunks, const float* partial,
                           const float* phi, const float* gamma,
                           float* grads_phi, float* grads_gamma) {
  __shared__ float dgamma_rows[kReduceRows][kReduceCols];
  const int col = threadIdx.x % kReduceCols;
  const int row = threadIdx.x / kReduceCols;
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kReduceCols + col;
  const int64_t plane = static_cast<int64_t>(s.N) * s.K;
  float dgamma = 0.0f;
  if (k < s.K) {
    for (int g = row; g < s.N; g += kReduceRows) {
      // phi and the gradient load beside the chunk partials, not after.
      const float phi_gk = phi[g * s.K + k];
      const float grad_gk =
          grads_phi != nullptr ? grads_phi[g * s.K + k] : 0.0f;
      const float sum =
          OrderedSum<kReduceGroup>(partial + g * s.K + k, plane, chunks);
      if (grads_phi != nullptr) {
        grads_phi[g * s.K + k] = grad_gk + (s.has_gamma ? sum * gamma[k] : sum);
      }
      dgamma = fmaf(sum, phi_gk, dgamma);
    }
  }
  dgamma_rows[row][col] = dgamma;
  __syncthreads();
  if (row != 0 || k >= s.K || grads_gamma == nullptr) return;
  float total = 0.0f;
  for (int j = 0; j < kReduceRows; ++j) total += dgamma_rows[j][col];
  grads_gamma[k] += total;
}

}  // namespace

absl::Status LaunchPhiGradReduce(const LayerSpec& spec, int64_t tokens,
                                 const float* partial, const float* phi,
                                 const float* gamma, float* grads_phi,
                                 float* grads_gamma, cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(spec);
  if (!s.has_gamma) grads_gamma = nullptr;
  if (grads_phi == nullptr && grads_gamma == nullptr) return absl::OkStatus();
  phi_grad_reduce_kernel<<<GridSize((s.K + kReduceCols - 1) / kReduceCols),
                           kReduceCols * kReduceRows, 0, stream>>>(
      s, NumPhiChunks(spec, tokens), partial, phi,
      s.has_gamma ? gamma : nullptr, grads_phi, grads_gamma);
  MHC_CUDA_CHECK_LAUNCH("phi gradient reduce",
                        ShapeString(spec, tokens, DType::kF32));
  return absl::OkStatus();
}

}  // namespace mhc::cuda
