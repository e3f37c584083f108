// sinkhorn4.cuh's forward and reverse mode on a quad: four consecutive lanes
// per token, lane q owning row q and column q of the 4 x 4 steps, for
// batches too small to fill the GPU with one thread per token. There a
// token's chain of 2T - 1 steps runs on one thread with few warps per
// scheduler to hide its latency; a quad gives each lane a quarter of a
// step's arithmetic for a few shuffles.
//
// Same bits as the one-thread form: every value is computed by the same
// operations in the same order. A row (column) step's dot product is the
// owning lane's, from the other lanes' column (row) scales fetched by
// shuffles; the reverse column sums (a + b) + (c + d) pair lanes q ^ 1 and
// then q ^ 2, and IEEE addition is commutative. The softmax runs whole on
// every lane, as does what the caller does outside the steps.
//
// Shuffles name the whole warp, so every lane of a warp must run the steps
// together: a caller runs its tokens past M and its repaired tokens through
// them as well and drops their results. (With the quad's own lanes as the
// mask, a run-time value, the compiler checked the warp's convergence
// before every step's shuffles, and the token's chain waited on that check.)
#ifndef MHC_KERNELS_CUDA_SINKHORN4_QUAD_CUH_
#define MHC_KERNELS_CUDA_SINKHORN4_QUAD_CUH_

#include "sinkhorn4.cuh"

namespace mhc::cuda::sk4 {

struct Quad {
  static constexpr unsigned kWarp = 0xffffffffu;
  int q;  // this lane's row / column

  __device__ static Quad OfLane() {
    return Quad{static_cast<int>(threadIdx.x & 3)};
  }
  // v of quad lane `src`.
  __device__ float From(float v, int src) const {
    return __shfl_sync(kWarp, v, src, 4);
  }
  // v of quad lane q ^ `xor_mask`.
  __device__ float Across(float v, int xor_mask) const {
    return __shfl_xor_sync(kWarp, v, xor_mask, 4);
  }
  // e_q, picked without indexing registers by a runtime value.
  __device__ float Pick(float e0, float e1, float e2, float e3) const {
    return q == 0 ? e0 : q == 1 ? e1 : q == 2 ? e2 : e3;
  }
};

// The kept denominators of a block's kTokens quads in shared memory, laid
// out as SharedKeep<kTokens>'s float4s: lane q writes component q of its
// token's slot; the reverse column steps read the whole slot.
template <int kTokens>
struct QuadKeep {
  float4* base;
  int token;  // the quad's token within the block

  __device__ void Put(int t, int which, int q, float d) const {
    reinterpret_cast<float*>(base + (2 * t + which) * kTokens + token)[q] = d;
  }
  __device__ float4 Get(int t, int which) const {
    return base[(2 * t + which) * kTokens + token];
  }
};

// The forward alone keeps nothing.
struct QuadNoKeep {
  __device__ __forceinline__ void Put(int, int, int, float) const {}
};

// Forward (sinkhorn4.cuh) with lane q returning row q of p in p_row; p0 (the
// softmax) whole on every lane. Keep: QuadKeep or QuadNoKeep.
template <typename Keep>
__device__ __forceinline__ void QuadForward(int iterations, float eps,
                                            const float (&a)[16],
                                            float (&p0)[16], float (&p_row)[4],
                                            const Keep& keep,
                                            const Quad& quad) {
  Softmax(a, p0);
  float k_row[4], k_col[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    k_row[j] = KEntry(quad.Pick(p0[j], p0[4 + j], p0[8 + j], p0[12 + j]), eps);
    k_col[j] = KEntry(
        quad.Pick(p0[4 * j], p0[4 * j + 1], p0[4 * j + 2], p0[4 * j + 3]), eps);
  }
  float u = 1.0f, w = 1.0f;
  float z = Sum4(k_col[0], k_col[1], k_col[2], k_col[3]) + eps;
  float v = Rcp(z);
  keep.Put(0, 1, quad.q, z);
  float v_all[4];
#pragma unroll 2
  for (int t = 1; t < iterations; ++t) {
#pragma unroll
    for (int j = 0; j < 4; ++j) v_all[j] = quad.From(v, j);
    float old = u;
    float acc = eps * w;
#pragma unroll
    for (int j = 0; j < 4; ++j) acc = fmaf(k_row[j], v_all[j], acc);
    w = acc;
    u = Rcp(acc);
    keep.Put(t, 0, quad.q, old * w);
    float u_all[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) u_all[i] = quad.From(u, i);
    old = v;
    acc = eps * z;
#pragma unroll
    for (int i = 0; i < 4; ++i) acc = fmaf(u_all[i], k_col[i], acc);
    z = acc;
    v = Rcp(acc);
    keep.Put(t, 1, quad.q, old * z);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) v_all[j] = quad.From(v, j);
#pragma unroll
  for (int j = 0; j < 4; ++j) p_row[j] = u * k_row[j] * v_all[j];
}

// ColumnStepBack on row q: each column's sum pairs the lanes.
__device__ __forceinline__ void QuadColumnStepBack(float (&w)[4], float (&y)[4],
                                                   float4 d, const Quad& quad) {
  const float dj[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float pair = w[j] + quad.Across(w[j], 1);
    const float dot = pair + quad.Across(pair, 2);
    w[j] = fmaf(-dot, y[j], w[j]);
    y[j] *= dj[j];
  }
}

// Backward (sinkhorn4.cuh) on row q: y_row is row q of the forward's output
// (overwritten), g_row row q of dL/dy; da_row gets row q of dL/dA.
template <int kTokens>
__device__ __forceinline__ void QuadBackward(
    int iterations, const float (&p0)[16], float (&y_row)[4],
    const float (&g_row)[4], const QuadKeep<kTokens>& keep, const Quad& quad,
    float (&da_row)[4]) {
  // The column steps read the slots the quad's other lanes filled.
  __syncwarp();
  float w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = g_row[j] * y_row[j];
#pragma unroll 1
  for (int t = iterations - 1; t >= 1; --t) {
    QuadColumnStepBack(w, y_row, keep.Get(t, 1), quad);
    const float4 rows = keep.Get(t, 0);
    const float d = quad.Pick(rows.x, rows.y, rows.z, rows.w);
    const float dot = Sum4(w[0], w[1], w[2], w[3]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[j] = fmaf(-dot, y_row[j], w[j]);
      y_row[j] *= d;
    }
  }
  QuadColumnStepBack(w, y_row, keep.Get(0, 1), quad);
  float p0_row[4], dp[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    p0_row[j] = quad.Pick(p0[j], p0[4 + j], p0[8 + j], p0[12 + j]);
    dp[j] = w[j] * Rcp(y_row[j]) * p0_row[j];
  }
  const float dot = Sum4(dp[0], dp[1], dp[2], dp[3]);
#pragma unroll
  for (int j = 0; j < 4; ++j) da_row[j] = fmaf(-dot, p0_row[j], dp[j]);
}

// The whole 4 x 4 matrix on every lane from the rows the quad's lanes hold.
__device__ __forceinline__ void QuadGather(const float (&row)[4],
                                           const Quad& quad, float (&m)[16]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) m[4 * i + j] = quad.From(row[j], i);
  }
}

}  // namespace mhc::cuda::sk4

#endif  // MHC_KERNELS_CUDA_SINKHORN4_QUAD_CUH_
