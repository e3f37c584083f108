// Overflow repair of the projection on the device (docs/SPEC.md section 7,
// docs/kernels.md "Overflow repair"): a token whose fp32 mean square
// exceeds kRepairMeanSquare or is not finite, or whose h is not finite, is
// recomputed from its x row in float64 by the thread that owns the token in
// the mixing kernels (the scale op kernels on SplitMix layers; the projection
// op rounds it back to fp32), and kept scaled: h = h_s 2^e, ms = ms_s 2^(2e),
// eps_rms scaled alike, so the scale math and its reverse mode stay in fp32
// range. Tokens with a non-finite x keep the fp32 values and come out
// non-finite.
//
// Determinism and batch invariance: whether a token is repaired and its
// repaired values depend on that token's x and the layer alone; the float64
// sums run in k order on one thread.
#ifndef MHC_KERNELS_CUDA_OVERFLOW_REPAIR_CUH_
#define MHC_KERNELS_CUDA_OVERFLOW_REPAIR_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "mhc/dtype.h"
#include "overflow_repair.h"

namespace mhc::cuda {

// Up to here the fp32 path, dms (about r^3) included, stays accurate.
inline constexpr float kRepairMeanSquare = 0x1p64f;
// A repaired token's flag is its exponent plus this bias (0: not repaired).
inline constexpr int kRepairFlagBias = 1024;

// Whether a token is repaired: its mean square above kRepairMeanSquare or
// NaN, or an h[g] infinite or NaN. It runs on every token of the mixing
// kernels, so it is branch-free over the values: the N loads are
// independent (a chain `finite && isfinite(h[g])` made each load wait on
// the compare and branch of the one before) and one compare decides. The
// same tokens as that chain: with the sign bit cleared, a float's bits are
// at least 0x7f800000 exactly when it is infinite (0x7f800000) or NaN
// (above), and unsigned order is the order of those bits, so the largest
// of them reaches 0x7f800000 exactly when some h[g] is not finite; the mean
// square takes the chain's own compare, `!(ms <= 2^64)`, true for NaN.
__device__ __forceinline__ bool NeedsRepair(const DevSpec& s, const float* h,
                                            float ms) {
  unsigned worst = 0;  // the largest |h[g]| as bits
#pragma unroll 8
  for (int g = 0; g < s.N; ++g) {
    worst = max(worst, __float_as_uint(h[g]) & 0x7fffffffu);
  }
  return !(ms <= kRepairMeanSquare) | (worst >= 0x7f800000u);
}

__device__ __forceinline__ float LoadX(const RepairSource& src, int64_t i) {
  switch (src.dtype) {
    case DType::kBF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(src.x)[i]);
    case DType::kF16:
      return __half2float(static_cast<const __half*>(src.x)[i]);
    default:
      return static_cast<const float*>(src.x)[i];
  }
}

// The spec a repaired token's scale math runs with.
__device__ __forceinline__ DevSpec ScaledSpec(const DevSpec& s, int exponent) {
  DevSpec scaled = s;
  scaled.eps_rms = ldexpf(s.eps_rms, s.outside ? -exponent : -2 * exponent);
  return scaled;
}

// Recomputes token m's projection in float64 into h_s [N] and *ms_s,
// scaled; returns its flag, or 0 (nothing written) when x is not finite.
static __device__ __noinline__ int RepairProjection(const DevSpec& s,
                                                    const RepairSource& src,
                                                    int64_t m, float* h_s,
                                                    float* ms_s) {
  const float* gamma = s.has_gamma ? src.gamma : nullptr;
  double squares = 0.0;
  for (int64_t k = 0; k < s.K; ++k) {
    const double v = LoadX(src, m * s.K + k);
    squares += v * v;
  }
  const double ms = squares / static_cast<double>(s.K);
  if (!isfinite(ms)) return 0;
  int e2 = 0;
  frexp(ms, &e2);
  const int e = e2 > 0 ? e2 / 2 : 0;
  for (int g = 0; g < s.N; ++g) {
    const float* row = src.phi + g * s.K;
    double sum = 0.0;
    for (int64_t k = 0; k < s.K; ++k) {
      // phi' = phi gamma rounded once (docs/SPEC.md section 2).
      const float folded = gamma != nullptr ? row[k] * gamma[k] : row[k];
      sum += static_cast<double>(folded) * LoadX(src, m * s.K + k);
    }
    h_s[g] = static_cast<float>(ldexp(sum, -e));
  }
  *ms_s = static_cast<float>(ldexp(ms, -2 * e));
  return e + kRepairFlagBias;
}

// The kept (unscaled fp32) projection of a repaired token: h_s 2^e and
// ms_s 2^(2e), infinite where the true value exceeds fp32.
__device__ __forceinline__ void StoreUnscaled(const DevSpec& s, int exponent,
                                              const float* h_s, float ms_s,
                                              float* h, float* ms) {
  for (int g = 0; g < s.N; ++g) h[g] = ldexpf(h_s[g], exponent);
  *ms = ldexpf(ms_s, 2 * exponent);
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_OVERFLOW_REPAIR_CUH_
