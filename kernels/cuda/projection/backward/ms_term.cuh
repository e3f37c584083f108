// The mean square's term of the projection backward's dx, dms 2 v / K,
// shared by every dx kernel (fma, mma, wgmma_n4, wgmma_n8, wide).
//
// dms 2 / K is rounded first and the term added in one fma, as it always
// was, unless that product is subnormal: the dms of a token whose x is huge
// (about 1 / ms) would lose bits or vanish there while its product with v
// need not. Then it is taken scaled by 2^64 and the product with v scaled
// back inside the fma, exact unless the term itself is subnormal. A token's
// choice depends on its own dms alone; other tokens keep their bits.
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MS_TERM_CUH_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MS_TERM_CUH_

#include <cfloat>

namespace mhc::cuda {

struct MsTerm {
  float dm;     // dms 2 / K, or dms 2^64 2 / K when scaled
  bool scaled;  // the product with v is scaled back by 2^-64

  // Runs body(add) once, where add(v, acc) = acc + dms 2 v / K. The choice
  // is made once per token, outside the body's loop over its elements, so
  // the common path stays the one fmaf(dm, v, acc) per element. Scaled,
  // |dm v| < 2^66: the product cannot overflow.
  template <typename Body>
  __device__ __forceinline__ void With(Body&& body) const {
    const float m = dm;
    if (__builtin_expect(scaled, false)) {
      body([m](float v, float acc) { return fmaf(m * v, 0x1p-64f, acc); });
    } else {
      body([m](float v, float acc) { return fmaf(m, v, acc); });
    }
  }
};

__device__ __forceinline__ MsTerm MsTermOf(float dms, float ms_scale) {
  const float dm = dms * ms_scale;
  if (dms != 0.0f && fabsf(dm) < FLT_MIN) {
    return {dms * 0x1p64f * ms_scale, true};
  }
  return {dm, false};
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MS_TERM_CUH_
