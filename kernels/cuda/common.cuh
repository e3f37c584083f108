// Device helpers shared by every CUDA kernel of the backend: the device view
// of a LayerSpec, activation loads and stores (fp32 accumulate, one
// round-to-nearest-even at the end), 16-byte vector access, deterministic
// block reductions and the status macros that name the failing op. The row
// kernels' stream and channel accesses are in primitives/row_access.cuh.
#ifndef MHC_KERNELS_CUDA_COMMON_CUH_
#define MHC_KERNELS_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

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
// A row kernel may name a minimum of resident CTAs per SM in its
// __launch_bounds__ (a register cap) where one was measured faster; 0
// leaves the compiler's own choice.
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

// Programmatic dependent launch. A kernel launched by LaunchAfterPrevious
// may start while the stream's previous kernel still runs (once that
// kernel's CTAs have all called AllowDependentLaunch or exited), which
// hides the launch and the previous kernel's last wave. Such a kernel calls
// WaitForPrerequisiteGrid() before it touches memory: it returns once the
// previous kernel has finished and its writes are visible (at once for an
// ordinary launch), so every kernel before it has finished too.
__device__ __forceinline__ void WaitForPrerequisiteGrid() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void AllowDependentLaunch() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
// A cudaLaunchKernelEx launch, programmatic when after_previous is set, in
// clusters of `cluster` CTAs when that is more than one.
template <typename... Exp, typename... Act>
cudaError_t LaunchClusterKernelEx(void (*kernel)(Exp...), dim3 grid, dim3 block,
                                  dim3 cluster, size_t smem,
                                  cudaStream_t stream, bool after_previous,
                                  Act&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2];
  unsigned count = 0;
  if (after_previous) {
    attrs[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attrs[count].id = cudaLaunchAttributeClusterDimension;
    attrs[count].val.clusterDim.x = cluster.x;
    attrs[count].val.clusterDim.y = cluster.y;
    attrs[count].val.clusterDim.z = cluster.z;
    ++count;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = count;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Act>(args)...);
}
template <typename... Exp, typename... Act>
cudaError_t LaunchKernelEx(void (*kernel)(Exp...), dim3 grid, dim3 block,
                           size_t smem, cudaStream_t stream,
                           bool after_previous, Act&&... args) {
  return LaunchClusterKernelEx(kernel, grid, block, dim3(1, 1, 1), smem, stream,
                               after_previous, std::forward<Act>(args)...);
}
template <typename... Exp, typename... Act>
cudaError_t LaunchAfterPrevious(void (*kernel)(Exp...), dim3 grid, dim3 block,
                                size_t smem, cudaStream_t stream,
                                Act&&... args) {
  return LaunchKernelEx(kernel, grid, block, smem, stream,
                        /*after_previous=*/true, std::forward<Act>(args)...);
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

// Zeroes a register array of floats of any rank (mma accumulators), fully
// unrolled.
template <typename E, int kN>
__device__ __forceinline__ void ZeroFill(E (&a)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    if constexpr (std::is_array<E>::value) {
      ZeroFill(a[i]);
    } else {
      a[i] = 0.0f;
    }
  }
}

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

// ----------------------------------------------------------- reductions --

// sum + first[u * step] for u in [0, min(count, kGroup)), added in order u =
// 0, 1, ... with every load issued before the first add: the values are
// partial sums sitting in L2, and one load per add would wait out its
// latency each time. kThroughL2: loads that skip L1, for a kernel that reads
// values written after it started (its SM's L1 may hold older lines).
template <int kGroup, bool kThroughL2 = false>
__device__ __forceinline__ float AddGroup(const float* first, int64_t step,
                                          int count, float sum) {
  float part[kGroup];
#pragma unroll
  for (int u = 0; u < kGroup; ++u) {
    const float* at = first + u * step;
    part[u] = u >= count ? 0.0f : kThroughL2 ? __ldcg(at) : *at;
  }
#pragma unroll
  for (int u = 0; u < kGroup; ++u) {
    if (u < count) sum += part[u];
  }
  return sum;
}

// The sum of first[q * step] for q in [0, count) in order q = 0, 1, ..., a
// group of kGroup loads at a time.
template <int kGroup, bool kThroughL2 = false>
__device__ __forceinline__ float OrderedSum(const float* first, int64_t step,
                                            int64_t count) {
  float sum = 0.0f;
  for (int64_t q = 0; q < count; q += kGroup) {
    const int left = static_cast<int>(min(count - q, int64_t{kGroup}));
    sum = AddGroup<kGroup, kThroughL2>(first + q * step, step, left, sum);
  }
  return sum;
}

// Sums W values over each group of group_threads consecutive threads (a
// multiple of 32) in a fixed order (xor tree inside each warp, then the
// group's warps in index order) and leaves group g's totals in
// out[g * W .. g * W + W) in shared memory. red holds W * (blockDim.x / 32)
// floats. The order depends only on the group size, never on the token
// count, so results are batch invariant.
template <int W>
__device__ __forceinline__ void GroupSum(float (&v)[W], int group_threads,
                                         float* red, float* out) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int group = threadIdx.x / group_threads;
  const int warps = group_threads >> 5;
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
  const float* group_red = red + group * warps * W;
  for (int w = threadIdx.x % group_threads; w < W; w += group_threads) {
    float total = 0.0f;
    for (int q = 0; q < warps; ++q) total += group_red[q * W + w];
    out[group * W + w] = total;
  }
  __syncthreads();
}

// GroupSum over the whole block: the totals in out[0..W).
template <int W>
__device__ __forceinline__ void BlockSum(float (&v)[W], float* red,
                                         float* out) {
  GroupSum<W>(v, blockDim.x, red, out);
}

// A launch's layer shape, named in its error messages. Launchers keep one
// for every call, so it holds the arguments and formats them only when a
// message is made: no allocation on the launch path.
struct LaunchShape {
  LaunchShape(const LayerSpec& spec, int64_t tokens, DType dtype)
      : spec(&spec), tokens(tokens), dtype(dtype) {}
  const LayerSpec* spec;
  int64_t tokens;
  DType dtype;
};

inline std::string ShapeText(const LaunchShape& shape) {
  return absl::StrCat("[M=", shape.tokens, " n=", shape.spec->n,
                      " C=", shape.spec->hidden, " ", DTypeName(shape.dtype),
                      " ", LayoutName(shape.spec->layout), "]");
}
// Launches that are not a layer's name what they run on in words.
inline absl::string_view ShapeText(absl::string_view what) { return what; }

}  // namespace mhc::cuda

// Returns an INTERNAL status naming the op, its shape and the CUDA error.
// `shape` is a LaunchShape or words; it is evaluated only on an error.
#define MHC_CUDA_RETURN_IF_ERROR(expr, op, shape)                         \
  do {                                                                    \
    const cudaError_t mhc_cuda_error_ = (expr);                           \
    if (mhc_cuda_error_ != cudaSuccess) {                                 \
      return ::absl::InternalError(::absl::StrCat(                        \
          "cuda ", (op), " ", ::mhc::cuda::ShapeText(shape), ": ", #expr, \
          " failed: ", cudaGetErrorName(mhc_cuda_error_), " (",           \
          cudaGetErrorString(mhc_cuda_error_), ")"));                     \
    }                                                                     \
  } while (0)

// Checks the launch just issued.
#define MHC_CUDA_CHECK_LAUNCH(op, shape) \
  MHC_CUDA_RETURN_IF_ERROR(cudaGetLastError(), op, shape)

#endif  // MHC_KERNELS_CUDA_COMMON_CUH_
