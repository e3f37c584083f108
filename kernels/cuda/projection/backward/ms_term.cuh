// The mean square's term of the projection backward's dx, dms 2 v / K,
// shared by every dx kernel (fma, mma, wgmma_n4, wgmma_n8, wide).
//
// dms 2 / K is rounded first and the term added in one fma, as it always
// was, unless that product is subnormal: the dms of a token whose x is huge
// (about 1 / ms) would lose bits or vanish there while its product with v
// need not. Then dms 2 / K is taken scaled by 2^64 and v by 2^-64. Both
// are exact but for a v 2^-64 below FLT_MIN, whose term (under 2^-188) is
// far below any float anyway. A token's choice depends on its own dms
// alone; other tokens keep their bits.
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MS_TERM_CUH_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MS_TERM_CUH_

#include <cfloat>

namespace mhc::cuda {

struct MsTerm {
  float dm;       // dms 2 / K, or dms 2^64 2 / K when scaled
  float v_scale;  // 1, or 2^-64 when scaled

  // acc + dms 2 v / K without a branch: v * 1 is v, so an unscaled token
  // gets fmaf(dm, v, acc), the same operands as before the scaled form.
  // For kernels at their register cap, where a branch per token costs more
  // than the multiply.
  __device__ __forceinline__ float Add(float v, float acc) const {
    return fmaf(dm, v * v_scale, acc);
  }

  // Runs body(add) once, with add(v, acc) the same sum as Add. The choice
  // is made once per token, outside the body's loop over its elements, so
  // the common path is the one fmaf per element.
  template <typename Body>
  __device__ __forceinline__ void With(Body&& body) const {
    const float m = dm;
    if (__builtin_expect(v_scale != 1.0f, false)) {
      body([m](float v, float acc) { return fmaf(m, v * 0x1p-64f, acc); });
    } else {
      body([m](float v, float acc) { return fmaf(m, v, acc); });
    }
  }
};

// Whether a token's term takes the scaled form.
__device__ __forceinline__ bool MsTermScaled(float dms, float ms_scale) {
  return dms != 0.0f && fabsf(dms * ms_scale) < FLT_MIN;
}

__device__ __forceinline__ MsTerm MsTermOf(float dms, float ms_scale) {
  if (MsTermScaled(dms, ms_scale)) {
    return {dms * 0x1p64f * ms_scale, 0x1p-64f};
  }
  return {dms * ms_scale, 1.0f};
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MS_TERM_CUH_
