// The per-token mixing values of the post kernels (post.cu, post_mma.cu).
#ifndef MHC_KERNELS_CUDA_POST_MIXING_CUH_
#define MHC_KERNELS_CUDA_POST_MIXING_CUH_

#include <cstdint>

#include "common.cuh"
#include "primitives/row_access.cuh"

namespace mhc::cuda {

// R (source-rows form, R[i][j] at slot i*NT + j) and H_post (slot NT*NT + j)
// of token m.
template <int NT>
inline constexpr int kMixingSlots = NT* NT + NT;
template <int NT, int kThreads>
using PostMixing = CtaValues<kMixingSlots<NT>, kThreads>;
template <int NT, int kThreads>
__device__ __forceinline__ void FetchMixing(PostMixing<NT, kThreads>& mix,
                                            const DevSpec& s, int n,
                                            const float* h_post,
                                            const float* h_res, int64_t m) {
  mix.Fetch([&](int slot) {
    if (slot >= NT * NT) {
      const int j = slot - NT * NT;
      return j < n ? h_post[m * n + j] : 0.0f;
    }
    const int i = slot / NT;
    const int j = slot % NT;
    if (i >= n || j >= n) return 0.0f;
    return h_res[m * n * n + (s.dest_rows ? j * n + i : i * n + j)];
  });
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_POST_MIXING_CUH_
