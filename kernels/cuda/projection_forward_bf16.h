// The projection forward of bf16 layers on warpgroup mmas, for x rows that
// take 16-, 8- or 4-byte copies (MmaCopyBytes; any C at n = 2, 4 and 8):
// one logit group (N <= 24: n <= 4 mHC layers and heads;
// projection_forward_bf16.cu) or 49-80 logits (n = 7, 8;
// projection_forward_bf16_wide.cu). LaunchProjectionPartials hands such
// launches to them.
// Same units' chunks and partial layout as proj_mma.cuh.
#ifndef MHC_KERNELS_CUDA_PROJECTION_FORWARD_BF16_H_
#define MHC_KERNELS_CUDA_PROJECTION_FORWARD_BF16_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "mhc/types.h"

namespace mhc::cuda {

// Whether the launch takes this kernel: a function of the layer, the dtype
// and x's alignment, never of the token count.
bool UseBf16WgmmaProjection(const LayerSpec& spec, DType dtype, const void* x);

// planes: workspace to split phi' into once for the launch (the bytes the
// mma.sync units' split takes: 6 KB per 64 k, 9 KB under IEEE), or null:
// every unit splits its stages itself (small batches, where the split would
// cost more than the x it serves). Both give the same bits.
// partial: PartialOffset's layout; next_unit: the launch's unit counter.
absl::Status LaunchBf16WgmmaProjectionPartials(
    const LayerSpec& spec, int64_t tokens, const void* x, const float* phi,
    const float* gamma, void* planes, float* partial,
    unsigned long long* next_unit, cudaStream_t stream);

// Whether the launch takes the 80-logit kernel: a function of the layer, the
// dtype and the alignment of x, phi and gamma (null: none), never of the
// token count.
bool UseBf16WideProjection(const LayerSpec& spec, DType dtype, const void* x,
                           const float* phi, const float* gamma);

// It splits phi' itself, from phi and gamma staged with x.
absl::Status LaunchBf16WideProjectionPartials(
    const LayerSpec& spec, int64_t tokens, const void* x, const float* phi,
    const float* gamma, float* partial, unsigned long long* next_unit,
    cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_FORWARD_BF16_H_
