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
// The bits that order |v|, and whether they make v infinite or NaN.
__device__ __forceinline__ unsigned MagnitudeBits(float v) {
  return __float_as_uint(v) & 0x7fffffffu;
}
__device__ __forceinline__ bool NotFiniteBits(unsigned magnitude) {
  return magnitude >= 0x7f800000u;
}
// The mean square's part of the test.
__device__ __forceinline__ bool MeanSquareNeedsRepair(float ms) {
  return !(ms <= kRepairMeanSquare);
}

__device__ __forceinline__ bool NeedsRepair(const DevSpec& s, const float* h,
                                            float ms) {
  unsigned worst = 0;  // the largest |h[g]| as bits
#pragma unroll 8
  for (int g = 0; g < s.N; ++g) worst = max(worst, MagnitudeBits(h[g]));
  return MeanSquareNeedsRepair(ms) | NotFiniteBits(worst);
}
// The same test on a row already in registers.
template <int kN>
__device__ __forceinline__ bool NeedsRepair(const float (&h)[kN], float ms) {
  unsigned worst = 0;
#pragma unroll
  for (int g = 0; g < kN; ++g) worst = max(worst, MagnitudeBits(h[g]));
  return MeanSquareNeedsRepair(ms) | NotFiniteBits(worst);
}

// The power of two a repaired token is scaled by: e with ms 2^(-2e) in
// [0.5, 2) (0 while ms < 2), from the float64 mean square (RepairProjection)
// or an fp32 one (the scale op's, converted exactly).
__device__ __forceinline__ int RepairExponent(double ms) {
  int e2 = 0;
  frexp(ms, &e2);
  return e2 > 0 ? e2 / 2 : 0;
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
  const int e = RepairExponent(ms);
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

// The fused backward's pass for the repaired tokens (overflow_repair.h),
// column k: their dh and dms rows reached the dx kernel as zeros, so it
// wrote dx = H_pre dy (+ R dx_next) for them and added nothing to dphi.
// This rewrites their dx[m][k] with the projection terms, from the scaled
// dh_s, dms_s and x 2^-e (dx = 2^-e (sum_g dh_s phi' + dms_s 2 x_s / K) +
// the rest, fp32, rounded once), and adds dh_s x_s, which is dh v, to
// dphi'[.][k] and dgamma[k], tokens in order. Stream ordered after the dx
// kernel, and after the dphi reduction has written column k. One thread per
// k: the reduction's tail (projection/backward/dphi_reduce.cu) or, without a
// reduction, repair_backward_kernel (overflow_repair.cu).
template <typename T>
__device__ __forceinline__ void RepairColumn(const DevSpec& s, int64_t tokens,
                                             int64_t k,
                                             const RepairBackwardArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  const T* dx_next = static_cast<const T*>(a.dx_next);
  T* dx = static_cast<T*>(a.dx);
  const float ms_scale = 2.0f / static_cast<float>(s.K);
  const int i = static_cast<int>(s.minor ? k % s.n : k / s.C);
  const int64_t c = s.minor ? k / s.n : k % s.C;
  const float gamma_k = a.gamma != nullptr ? a.gamma[k] : 1.0f;
  for (int64_t m = 0; m < tokens; ++m) {
    const int flag = a.flag[m];
    if (flag == 0) continue;
    const int e = flag - kRepairFlagBias;
    const float* scaled = a.scaled + m * (s.N + 1);
    const float xs = ldexpf(ToFloat(x[m * s.K + k]), -e);
    float proj = 0.0f;
    for (int g = 0; g < s.N; ++g) {
      proj = fmaf(scaled[g], a.phi[g * s.K + k] * gamma_k, proj);
    }
    proj = fmaf(scaled[s.N] * ms_scale, xs, proj);
    float out = ldexpf(proj, -e);
    out = fmaf(a.h_pre[m * s.n + i], ToFloat(dy[m * s.C + c]), out);
    if (a.r != nullptr) {
      for (int j = 0; j < s.n; ++j) {
        out = fmaf(a.r[(m * s.n + i) * s.n + j],
                   ToFloat(dx_next[m * s.K + XIndex(s, j, c)]), out);
      }
    }
    dx[m * s.K + k] = FromFloat<T>(out);
    if (a.grad_phi == nullptr && a.grad_gamma == nullptr) continue;
    float dgamma = 0.0f;
    for (int g = 0; g < s.N; ++g) {
      const float dfolded = scaled[g] * xs;  // this token's dphi'[g][k]
      if (a.grad_phi != nullptr) a.grad_phi[g * s.K + k] += dfolded * gamma_k;
      dgamma = fmaf(dfolded, a.phi[g * s.K + k], dgamma);
    }
    if (a.grad_gamma != nullptr) a.grad_gamma[k] += dgamma;
  }
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_OVERFLOW_REPAIR_CUH_
