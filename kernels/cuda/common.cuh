// Device helpers shared by every CUDA kernel of the backend: the device view
// of a LayerSpec, activation loads and stores (fp32 accumulate, one
// round-to-nearest-even at the end), 16-byte vector access, deterministic
// block reductions and the status macros that name the failing op.
#ifndef MHC_KERNELS_CUDA_COMMON_CUH_
#define MHC_KERNELS_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "mhc/status.h"
#include "mhc/types.h"

namespace mhc::cuda {

// Tokens per parameter-gradient partial. A constant (never derived from M or
// the SM count) so that parameter gradients are summed in the same order
// whatever the batch looks like.
inline constexpr int kTokenChunk = 1024;
// Threads of the row kernels; fixed so the reduction tree never changes.
inline constexpr int kRowThreads = 128;
// Tokens per CTA of the static-layer forward.
inline constexpr int kTileTokens = 4;
inline constexpr int kTileThreads = 256;
// Rows of phi handled per pass of the FFMA dx kernel.
inline constexpr int kRowsPerPass = 24;

// What the kernels need of a LayerSpec, as plain values.
struct DevSpec {
  int n;
  int N;  // logits per token
  int num_alpha;
  int64_t C;
  int64_t K;
  bool head;
  bool minor;      // STREAM_MINOR layout
  bool dest_rows;  // R = H_res^T
  bool log_mode;
  int iterations;
  float eps_sk;
  float eps_rms;
  bool outside;
  float eps_pre;
  float post_mult;
  bool dynamic;
  bool has_gamma;
  bool has_bias;
};

inline DevSpec MakeDevSpec(const LayerSpec& spec) {
  DevSpec s;
  s.n = spec.n;
  s.N = static_cast<int>(spec.NumLogits());
  s.num_alpha = spec.NumAlpha();
  s.C = spec.hidden;
  s.K = spec.K();
  s.head = spec.kind == LayerKind::kHead;
  s.minor = spec.layout == Layout::kStreamMinor;
  s.dest_rows = spec.orientation == Orientation::kDestRows;
  s.log_mode = spec.sinkhorn_mode == SinkhornMode::kLog;
  s.iterations = spec.sinkhorn_iterations;
  s.eps_sk = spec.eps_sk;
  s.eps_rms = spec.eps_rms;
  s.outside = spec.eps_placement == EpsPlacement::kOutside;
  s.eps_pre = spec.eps_pre;
  s.post_mult = spec.post_mult;
  s.dynamic = spec.dynamic;
  s.has_gamma = spec.has_gamma;
  s.has_bias = spec.has_post_bias;
  return s;
}

inline int64_t NumChunks(int64_t tokens) {
  return (tokens + kTokenChunk - 1) / kTokenChunk;
}

inline bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Offset of (stream i, channel c) inside one token.
__host__ __device__ __forceinline__ int64_t XIndex(const DevSpec& s, int i,
                                                   int64_t c) {
  return s.minor ? c * s.n + i : i * s.C + c;
}

// --------------------------------------------------------------- dtypes --

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}

template <int B>
struct VecWord;
template <>
struct VecWord<4> {
  using type = unsigned int;
};
template <>
struct VecWord<8> {
  using type = uint2;
};
template <>
struct VecWord<16> {
  using type = uint4;
};

// V consecutive elements with one access of V * sizeof(T) bytes when that is
// 4, 8 or 16 (the caller guarantees alignment), element accesses otherwise.
template <typename T, int V>
__device__ __forceinline__ void LoadVec(const T* p, float (&out)[V]) {
  constexpr int kBytes = V * static_cast<int>(sizeof(T));
  if constexpr (V > 1 && (kBytes == 4 || kBytes == 8 || kBytes == 16)) {
    using Word = typename VecWord<kBytes>::type;
    const Word u = *reinterpret_cast<const Word*>(p);
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int v = 0; v < V; ++v) out[v] = ToFloat(e[v]);
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) out[v] = ToFloat(p[v]);
  }
}

template <typename T, int V>
__device__ __forceinline__ void StoreVec(T* p, const float (&in)[V]) {
  constexpr int kBytes = V * static_cast<int>(sizeof(T));
  if constexpr (V > 1 && (kBytes == 4 || kBytes == 8 || kBytes == 16)) {
    using Word = typename VecWord<kBytes>::type;
    Word u;
    T* e = reinterpret_cast<T*>(&u);
#pragma unroll
    for (int v = 0; v < V; ++v) e[v] = FromFloat<T>(in[v]);
    *reinterpret_cast<Word*>(p) = u;
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) p[v] = FromFloat<T>(in[v]);
  }
}

// Streams 0..n-1 of channels [c0, c0 + V) of one token row. NT is the
// stream capacity; the vector path (V > 1) requires n == NT, C % V == 0 and
// 16-byte aligned rows, which the launchers check.
template <typename T, int NT, int V>
__device__ __forceinline__ void LoadStreams(const DevSpec& s, int n,
                                            const T* row, int64_t c0,
                                            float (&out)[NT][V]) {
  if constexpr (V > 1) {
    if (s.minor) {
      // The block (c0..c0+V) x (all streams) is contiguous: NT*V elements.
      constexpr int kPer = 16 / sizeof(T);
      constexpr int kVecs = NT * V / kPer;
      const T* base = row + c0 * NT;
#pragma unroll
      for (int q = 0; q < kVecs; ++q) {
        float tmp[kPer];
        LoadVec<T, kPer>(base + q * kPer, tmp);
#pragma unroll
        for (int e = 0; e < kPer; ++e) {
          const int flat = q * kPer + e;
          out[flat % NT][flat / NT] = tmp[e];
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < NT; ++i) LoadVec<T, V>(row + i * s.C + c0, out[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      out[i][0] = i < n ? ToFloat(row[XIndex(s, i, c0)]) : 0.0f;
    }
  }
}

template <typename T, int NT, int V>
__device__ __forceinline__ void StoreStreams(const DevSpec& s, int n, T* row,
                                             int64_t c0,
                                             const float (&in)[NT][V]) {
  if constexpr (V > 1) {
    if (s.minor) {
      constexpr int kPer = 16 / sizeof(T);
      constexpr int kVecs = NT * V / kPer;
      T* base = row + c0 * NT;
#pragma unroll
      for (int q = 0; q < kVecs; ++q) {
        float tmp[kPer];
#pragma unroll
        for (int e = 0; e < kPer; ++e) {
          const int flat = q * kPer + e;
          tmp[e] = in[flat % NT][flat / NT];
        }
        StoreVec<T, kPer>(base + q * kPer, tmp);
      }
    } else {
#pragma unroll
      for (int i = 0; i < NT; ++i) StoreVec<T, V>(row + i * s.C + c0, in[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      if (i < n) row[XIndex(s, i, c0)] = FromFloat<T>(in[i][0]);
    }
  }
}

// Channels [c0, c0 + V) of a [C] row.
template <typename T, int V>
__device__ __forceinline__ void LoadChannels(const T* row, int64_t c0,
                                             float (&out)[V]) {
  LoadVec<T, V>(row + c0, out);
}

// ----------------------------------------------------------- reductions --

// Sums W values over the whole block in a fixed order (xor tree inside each
// warp, then warps in index order) and leaves the totals in out[0..W) in
// shared memory. red holds W * (blockDim.x / 32) floats. The order depends
// only on blockDim, never on the token count, so results are batch invariant.
template <int W>
__device__ __forceinline__ void BlockSum(float (&v)[W], float* red,
                                         float* out) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
#pragma unroll
  for (int w = 0; w < W; ++w) {
    float x = v[w];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    v[w] = x;
  }
  if (lane == 0) {
#pragma unroll
    for (int w = 0; w < W; ++w) red[warp * W + w] = v[w];
  }
  __syncthreads();
  for (int w = threadIdx.x; w < W; w += blockDim.x) {
    float total = 0.0f;
    for (int q = 0; q < warps; ++q) total += red[q * W + w];
    out[w] = total;
  }
  __syncthreads();
}

}  // namespace mhc::cuda

// Returns an INTERNAL status naming the op, its shape and the CUDA error.
#define MHC_CUDA_RETURN_IF_ERROR(expr, op, shape)                              \
  do {                                                                         \
    const cudaError_t mhc_cuda_error_ = (expr);                                \
    if (mhc_cuda_error_ != cudaSuccess) {                                      \
      return ::absl::InternalError(                                            \
          ::absl::StrCat("cuda ", (op), " ", (shape), ": ", #expr,             \
                         " failed: ", cudaGetErrorName(mhc_cuda_error_), " (", \
                         cudaGetErrorString(mhc_cuda_error_), ")"));           \
    }                                                                          \
  } while (0)

// Checks the launch just issued.
#define MHC_CUDA_CHECK_LAUNCH(op, shape) \
  MHC_CUDA_RETURN_IF_ERROR(cudaGetLastError(), op, shape)

#endif  // MHC_KERNELS_CUDA_COMMON_CUH_
