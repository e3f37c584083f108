// LINEAR Sinkhorn-Knopp and its exact reverse mode with L lanes per token:
// lane l of a token owns rows l*R .. l*R+R-1 (R = N / L) of the N x N matrix
// in registers. Row sums stay inside the lane; column sums add the lane's R
// rows in order and then combine the L lanes with an xor butterfly, which
// gives every lane the same bits (fp32 addition is commutative) in a fixed
// order. Determinism / batch invariance: shuffles never leave the token's L
// lanes, so a token's bits do not depend on its neighbours in the warp, on M
// or on the launch shape.
//
// Reverse mode without per-token global memory: the forward keeps only the
// denominators (sum + eps) of every step in the block's shared memory (a
// column step's N column denominators spread over the L lanes, N / L each),
// so the iteration loops stay rolled and the code small. The backward runs
// the steps in reverse from the final matrix: step k's input is rebuilt as
// output * denominator, its gradient is (g - sum(g * y)) / denominator. The
// rebuilt states differ from the forward ones by a few fp32 ulps per step,
// far inside the 1e-4 backward bound; the softmax at the start is recomputed
// from the logits exactly.
//
// kPadded: the token's matrix is n x n with n < N, in the top-left corner of
// the block (n = 3 in 4 x 4, 5-7 in 8 x 8, 9-15 in 16 x 16). The padding
// rows and columns stay exactly zero: they get no eps and their
// denominators are 1 (kept as such for the reverse mode, where their
// gradients stay finite and never reach the n x n entries, every coupling
// going through y, which is zero there). Adding those zeros to a sum is
// exact, so the n x n result is the unpadded algorithm's in the same order.
#ifndef MHC_KERNELS_CUDA_SINKHORN_LANES_CUH_
#define MHC_KERNELS_CUDA_SINKHORN_LANES_CUH_

#include "common.cuh"
#include "mix.cuh"
#include "plans/sinkhorn.h"

namespace mhc::cuda {

// kLaneMaxIterations (plans/sinkhorn.h): the iterations whose denominators
// the lane kernels keep; the plan sends longer runs to the one-thread path.

template <int N, int L, bool kPadded = false>
struct SinkhornLanes {
  static_assert(N % L == 0 && 32 % L == 0, "lanes must tile the matrix");
  static constexpr int kRows = N / L;  // rows per lane
  static constexpr int kCols = N / L;  // column denominators kept per lane
  static constexpr int kSlots = kCols + kRows;  // kept floats per step
  using Block = float[kRows][N];

  // Which of a lane's entries are the token's (all of them unless kPadded).
  struct Extent {
    int n;     // the token's matrix is n x n
    int row0;  // the lane's first row
    __device__ __forceinline__ bool Row(int r) const {
      return !kPadded || row0 + r < n;
    }
    __device__ __forceinline__ bool Col(int j) const {
      return !kPadded || j < n;
    }
    // Whether entry (r, j) of the lane's rows belongs to the matrix, and
    // the row length of the matrix as stored (n x n, rows contiguous).
    __device__ __forceinline__ bool Holds(int r, int j) const {
      return Row(r) && Col(j);
    }
    __device__ __forceinline__ int Stride() const { return kPadded ? n : N; }
  };

  // Per-lane slots of the kept denominators: slot k of step t of the thread
  // tid lives at ((t * kSlots + k) * threads + tid), conflict free.
  struct Keep {
    float* base;
    int threads, tid, lane;
    __device__ __forceinline__ float& at(int t, int k) const {
      return base[(t * kSlots + k) * threads + tid];
    }
    // Slot k of lane q of the same token (same warp).
    __device__ __forceinline__ float peer(int t, int k, int q) const {
      return base[(t * kSlots + k) * threads + tid - lane + q];
    }
  };

  // Sum over the token's L lanes (identical bits on all of them).
  static __device__ __forceinline__ float LaneSum(float v) {
#pragma unroll
    for (int off = 1; off < L; off <<= 1) {
      v += __shfl_xor_sync(0xffffffffu, v, off);
    }
    return v;
  }

  // Row softmax (NaN never wins the max, so it poisons its row).
  static __device__ __forceinline__ void Softmax(const Block& a, Block& p,
                                                 const Extent& ext) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (!ext.Row(r)) {
#pragma unroll
        for (int j = 0; j < N; ++j) p[r][j] = 0.0f;
        continue;
      }
      float best = a[r][0];
#pragma unroll
      for (int j = 1; j < N; ++j) {
        if (ext.Col(j) && a[r][j] > best) best = a[r][j];
      }
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        p[r][j] = ext.Col(j) ? expf(a[r][j] - best) : 0.0f;
        sum += p[r][j];
      }
      const float inv = Reciprocal(sum);
#pragma unroll
      for (int j = 0; j < N; ++j) p[r][j] *= inv;
    }
  }

  static __device__ __forceinline__ void ColumnDenominators(const Block& p,
                                                            float eps,
                                                            const Extent& ext,
                                                            float (&d)[N]) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float sum = p[0][j];
#pragma unroll
      for (int r = 1; r < kRows; ++r) sum += p[r][j];
      sum = LaneSum(sum) + eps;
      d[j] = ext.Col(j) ? sum : 1.0f;
    }
  }

  static __device__ __forceinline__ float RowDenominator(const float (&row)[N],
                                                         float eps,
                                                         bool token_row) {
    float sum = row[0];
#pragma unroll
    for (int j = 1; j < N; ++j) sum += row[j];
    return token_row ? sum + eps : 1.0f;
  }

  // Forward; with kKeep the denominators of every step are kept for the
  // reverse mode (dc: column steps, dr: row steps 1 .. T-1).
  template <bool kKeep>
  static __device__ __forceinline__ void Forward(int iterations, float eps,
                                                 const Extent& ext,
                                                 const Block& a, Block& p,
                                                 const Keep& keep) {
    Softmax(a, p, ext);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int j = 0; j < N; ++j) {
        if (ext.Row(r) && ext.Col(j)) p[r][j] += eps;
      }
    }
#pragma unroll 1
    for (int t = 0; t < iterations; ++t) {
      if (t > 0) {  // row step
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float d = RowDenominator(p[r], eps, ext.Row(r));
          if (kKeep) keep.at(t, kCols + r) = d;
          const float inv = Reciprocal(d);
#pragma unroll
          for (int j = 0; j < N; ++j) p[r][j] *= inv;
        }
      }
      float d[N];
      ColumnDenominators(p, eps, ext, d);
      if (kKeep) {
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          float v = d[c];
#pragma unroll
          for (int q = 1; q < L; ++q) {
            if (keep.lane == q) v = d[q * kCols + c];
          }
          keep.at(t, c) = v;
        }
      }
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float inv = Reciprocal(d[j]);
#pragma unroll
        for (int r = 0; r < kRows; ++r) p[r][j] *= inv;
      }
    }
  }

  // Reverse mode: y is the forward's final matrix (overwritten), g the
  // incoming gradient (overwritten), a the logits; writes da.
  static __device__ __forceinline__ void Backward(int iterations, float eps,
                                                  const Extent& ext,
                                                  const Block& a, Block& y,
                                                  Block& g, const Keep& keep,
                                                  Block& da) {
    __syncwarp();  // the token's lanes read each other's column slots
#pragma unroll 1
    for (int t = iterations - 1; t >= 0; --t) {
      float d[N];
#pragma unroll
      for (int q = 0; q < L; ++q) {
#pragma unroll
        for (int c = 0; c < kCols; ++c) d[q * kCols + c] = keep.peer(t, c, q);
      }
#pragma unroll
      for (int j = 0; j < N; ++j) {
        float dot = g[0][j] * y[0][j];
#pragma unroll
        for (int r = 1; r < kRows; ++r) dot = fmaf(g[r][j], y[r][j], dot);
        dot = LaneSum(dot);
        const float inv = Reciprocal(d[j]);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          g[r][j] = (g[r][j] - dot) * inv;
          y[r][j] *= d[j];
        }
      }
      if (t > 0) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          float dot = g[r][0] * y[r][0];
#pragma unroll
          for (int j = 1; j < N; ++j) dot = fmaf(g[r][j], y[r][j], dot);
          const float dr = keep.at(t, kCols + r);
          const float inv = Reciprocal(dr);
#pragma unroll
          for (int j = 0; j < N; ++j) {
            g[r][j] = (g[r][j] - dot) * inv;
            y[r][j] *= dr;
          }
        }
      }
    }
    // The + eps after the softmax has unit derivative; then the softmax.
    Softmax(a, y, ext);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float dot = g[r][0] * y[r][0];
#pragma unroll
      for (int j = 1; j < N; ++j) dot = fmaf(g[r][j], y[r][j], dot);
#pragma unroll
      for (int j = 0; j < N; ++j) da[r][j] = (g[r][j] - dot) * y[r][j];
    }
  }
};

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_SINKHORN_LANES_CUH_
