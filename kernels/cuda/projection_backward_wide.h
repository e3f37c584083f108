// The two-kernel tensor-core projection backward
// (projection_backward_wide.cu), for the dynamic layers that UseMmaDx turns
// down (n not a power of two, n = 16, and the largest fp32 tiles);
// LaunchDxAndPhiPartials picks it when UseWideDx holds.
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WIDE_H_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WIDE_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "launch.h"

namespace mhc::cuda {

bool UseWideDx(const DxArgs& a);

// Tokens per dphi partial of a layer's projection backward (a function of
// the layer alone, so the order of the sum over tokens never depends on M):
// kTokenChunk, or for the layers only this backward takes (n not a power of
// two, n = 16) up to kTokenChunk times N / 24, which keeps their partials
// near n = 4's share of the x bytes (n = 16, C = 4096: one partial at M =
// 8192, not eight).
int64_t PhiChunkTokens(const LayerSpec& spec);
inline int64_t NumPhiChunks(const LayerSpec& spec, int64_t tokens) {
  const int64_t chunk = PhiChunkTokens(spec);
  return (tokens + chunk - 1) / chunk;
}
// Scratch of the rounded operands and, for the fused pre backward (terms),
// of one channel chunk's terms (dx_terms.cuh); 0 where UseWideDx does not
// hold.
size_t WideDxScratchBytes(const LayerSpec& spec, int64_t tokens, DType dtype,
                          bool terms);
absl::Status LaunchWideDxAndPhiPartials(const DxArgs& a, cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_WIDE_H_
