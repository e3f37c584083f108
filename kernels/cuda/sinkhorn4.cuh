// LINEAR Sinkhorn-Knopp for n = 4 (the production case) with one thread per
// token and the 4 x 4 matrix in 16 registers, and its exact reverse mode.
//
// Why this shape: the op moves 64 B in and 64 B out per token, so its time
// is the issue slots of the 2T - 1 normalisations. One thread per token needs
// no shuffles and computes every row / column denominator once (lanes that
// split a token each recompute all column reciprocals); every sum is a
// two-level tree (a + b) + (c + d) so the chain per step is short. What is
// inverted is a denominator (>= eps_sk >= FLT_MIN on this path: the plan
// checks) or an inverse scale (a denominator over the previous scale, see
// Forward), a positive normal either way, so one rcp.approx.ftz (<= 1 ulp, a
// single MUFU op) replaces the division: the subnormal fix-up of the non-ftz
// form and a Newton step cost 8 more instructions per reciprocal, 64 per
// iteration, for half an ulp.
//
// Reverse mode: the forward keeps every step's denominators d (Keep::Put,
// shared memory in the kernel); the backward walks the steps in reverse from
// the final matrix y, rebuilding each step's input as y * d. It tracks
// w = dY (.) Y instead of dY: for Y = X / d along a line,
//   dX = (dY - sum(dY Y)) / d   and   X = Y d   give
//   dX (.) X = (dY - sum(dY Y)) (.) Y = w - sum(w) Y,
// so a step costs one FFMA per element and one sum per line, with no
// reciprocal. dY is recovered once at the end as w / y (y = P0 + eps there).
// Deterministic and batch invariant: a token's bits depend on its own values
// and the fixed operation order alone.
#ifndef MHC_KERNELS_CUDA_SINKHORN4_CUH_
#define MHC_KERNELS_CUDA_SINKHORN4_CUH_

#include <cfloat>
#include <cmath>

#include "common.cuh"
#include "plans/sinkhorn.h"
#include "sinkhorn_lanes.cuh"

namespace mhc::cuda::sk4 {

// The Sinkhorn plan's n4 row (plans/sinkhorn.h), which the fused mixing
// kernels test on the device.
__host__ __device__ inline bool Applies(const DevSpec& s, bool backward) {
  return SinkhornN4Applies(s, backward);
}

// The denominators of every step of a thread's token in shared memory,
// [T][row / column] x kThreads float4s: consecutive threads hit consecutive
// 16 bytes.
template <int kThreads>
struct SharedKeep {
  float4* base;
  int tid;
  __device__ __forceinline__ void Put(int t, int which, float d0, float d1,
                                      float d2, float d3) const {
    base[(2 * t + which) * kThreads + tid] = make_float4(d0, d1, d2, d3);
  }
  __device__ __forceinline__ void Get(int t, int which, float (&d)[4]) const {
    const float4 v = base[(2 * t + which) * kThreads + tid];
    d[0] = v.x;
    d[1] = v.y;
    d[2] = v.z;
    d[3] = v.w;
  }
};

// 1 / d for a normal d: one MUFU op, <= 1 ulp.
__device__ __forceinline__ float Rcp(float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return r;
}

__device__ __forceinline__ float Sum4(float a, float b, float c, float d) {
  return (a + b) + (c + d);
}

// Row softmax of a into p0 (row major 4 x 4). fmaxf never returns a NaN
// operand, so a NaN logit stays out of the max and poisons its row through
// exp / the sum, as the reference's "NaN never wins" max does.
__device__ __forceinline__ void Softmax(const float (&a)[16], float (&p0)[16]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float* r = a + 4 * i;
    const float best = fmaxf(fmaxf(r[0], r[1]), fmaxf(r[2], r[3]));
    float e[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) e[j] = expf(r[j] - best);
    const float inv = Rcp(Sum4(e[0], e[1], e[2], e[3]));  // sum in [1, 4]
#pragma unroll
    for (int j = 0; j < 4; ++j) p0[4 * i + j] = e[j] * inv;
  }
}

// Keep slots: which = 0 for a row step, 1 for a column step.
struct NoKeep {
  __device__ __forceinline__ void Put(int, int, float, float, float,
                                      float) const {}
};

// K = P0 + eps entry by entry with __fadd_rn: as a plain add the compiler
// may fuse it with the softmax's product into one FMA where p0 is not kept,
// and not where a lane picks the entry out first (sinkhorn4_quad.cuh), which
// left the two forms 1-2 ulp apart.
__device__ __forceinline__ float KEntry(float p0, float eps) {
  return __fadd_rn(p0, eps);
}

// p = Sinkhorn(a) with T = iterations >= 1; p0 = the softmax (kept for the
// reverse mode). Step t >= 1 is a row step then a column step.
//
// The iterate is carried as P = diag(u) K diag(v) with K = P0 + eps fixed, so
// a step only rescales u (rows) or v (columns). It tracks the inverse scales
// w = 1 / u and z = 1 / v: a row step's u_i / (u_i sum_j K_ij v_j + eps) is
// 1 / (sum_j K_ij v_j + eps w_i), so the new w_i is a 4-FMA dot started from
// eps w_i (known a step early, off the dependent chain) and the new u_i one
// reciprocal: 24 instructions per step and a chain of four FMAs and a
// reciprocal, where dividing u by its denominator took 28 and two more
// dependent operations. The reverse mode's denominator u_i sum_j K_ij v_j +
// eps is the old u_i times the new w_i (formed only when kept). P is formed
// once at the end.
template <typename Keep>
__device__ __forceinline__ void Forward(int iterations, float eps,
                                        const float (&a)[16], float (&p0)[16],
                                        float (&p)[16], const Keep& keep) {
  Softmax(a, p0);
  float k[16];
#pragma unroll
  for (int e = 0; e < 16; ++e) k[e] = KEntry(p0[e], eps);
  float u[4] = {1.0f, 1.0f, 1.0f, 1.0f}, w[4] = {1.0f, 1.0f, 1.0f, 1.0f};
  float v[4], z[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    z[j] = Sum4(k[j], k[4 + j], k[8 + j], k[12 + j]) + eps;
    v[j] = Rcp(z[j]);
  }
  keep.Put(0, 1, z[0], z[1], z[2], z[3]);
#pragma unroll 2
  for (int t = 1; t < iterations; ++t) {
    float old[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      old[i] = u[i];
      float acc = eps * w[i];
#pragma unroll
      for (int j = 0; j < 4; ++j) acc = fmaf(k[4 * i + j], v[j], acc);
      w[i] = acc;
      u[i] = Rcp(acc);
    }
    keep.Put(t, 0, old[0] * w[0], old[1] * w[1], old[2] * w[2], old[3] * w[3]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      old[j] = v[j];
      float acc = eps * z[j];
#pragma unroll
      for (int i = 0; i < 4; ++i) acc = fmaf(u[i], k[4 * i + j], acc);
      z[j] = acc;
      v[j] = Rcp(acc);
    }
    keep.Put(t, 1, old[0] * z[0], old[1] * z[1], old[2] * z[2], old[3] * z[3]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) p[4 * i + j] = u[i] * k[4 * i + j] * v[j];
  }
}

// Reverse of one column step given its denominators d: w <- w - sum_i(w) y,
// then y <- y d (the step's input).
__device__ __forceinline__ void ColumnStepBack(float (&w)[16], float (&y)[16],
                                               float d0, float d1, float d2,
                                               float d3) {
  const float d[4] = {d0, d1, d2, d3};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float dot = Sum4(w[j], w[4 + j], w[8 + j], w[12 + j]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[4 * i + j] = fmaf(-dot, y[4 * i + j], w[4 * i + j]);
      y[4 * i + j] *= d[j];
    }
  }
}

__device__ __forceinline__ void RowStepBack(float (&w)[16], float (&y)[16],
                                            float d0, float d1, float d2,
                                            float d3) {
  const float d[4] = {d0, d1, d2, d3};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float dot = Sum4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[4 * i + j] = fmaf(-dot, y[4 * i + j], w[4 * i + j]);
      y[4 * i + j] *= d[i];
    }
  }
}

// da = dL/dA given y = the forward's output (overwritten), g = dL/dy, p0 =
// the forward's softmax and the kept denominators (keep.Get(t, which, d)).
template <typename Keep>
__device__ __forceinline__ void Backward(int iterations, const float (&p0)[16],
                                         float (&y)[16], const float (&g)[16],
                                         const Keep& keep, float (&da)[16]) {
  float w[16];
#pragma unroll
  for (int e = 0; e < 16; ++e) w[e] = g[e] * y[e];
  float d[4];
#pragma unroll 1
  for (int t = iterations - 1; t >= 1; --t) {
    keep.Get(t, 1, d);
    ColumnStepBack(w, y, d[0], d[1], d[2], d[3]);
    keep.Get(t, 0, d);
    RowStepBack(w, y, d[0], d[1], d[2], d[3]);
  }
  keep.Get(0, 1, d);
  ColumnStepBack(w, y, d[0], d[1], d[2], d[3]);
  // y is now P0 + eps (>= eps, normal), w = dP0 (.) y; the + eps has unit
  // derivative, then the softmax: dA = (dP0 - sum_j dP0 P0) P0 per row.
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float q[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int e = 4 * i + j;
      q[j] = w[e] * Rcp(y[e]) * p0[e];  // dP0 P0
    }
    const float dot = Sum4(q[0], q[1], q[2], q[3]);
#pragma unroll
    for (int j = 0; j < 4; ++j) da[4 * i + j] = fmaf(-dot, p0[4 * i + j], q[j]);
  }
}

}  // namespace mhc::cuda::sk4

#endif  // MHC_KERNELS_CUDA_SINKHORN4_CUH_
