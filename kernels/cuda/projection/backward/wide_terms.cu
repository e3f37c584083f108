// The terms kernel of projection/backward/wide_terms.cuh. A CTA takes one token
// and kTermsThreads x V channels of the chunk; a thread reads its channels of
// every stream of dx_next once and writes every stream's terms. R and H_pre of
// the token sit in shared memory. Each output sums H_pre dy, then R's products
// over the source streams in order: deterministic and batch invariant.
#include "dispatch.cuh"
#include "projection/backward/wide_terms.cuh"

namespace mhc::cuda {
namespace {

constexpr int kTermsThreads = 128;
constexpr int kMaxStreams = 16;

// V = 2: two channels per thread (4-byte loads of 16-bit rows, 8-byte
// stores of the terms), stream major only.
template <typename T, int V>
__global__ void __launch_bounds__(kTermsThreads)
    dx_terms_kernel(DevSpec s, ChannelChunk chunk, const float* h_pre,
                    const T* dy, const float* r, const T* dx_next,
                    float* terms) {
  WaitForPrerequisiteGrid();  // r and h_pre; the previous dx reads terms
  __shared__ float r_s[kMaxStreams * kMaxStreams];
  __shared__ float h_s[kMaxStreams];
  const int64_t m = blockIdx.x;
  const int n = s.n;
  for (int e = threadIdx.x; e < n * n; e += kTermsThreads) {
    r_s[e] = r != nullptr ? r[m * n * n + e] : 0.0f;
  }
  if (threadIdx.x < n) {
    h_s[threadIdx.x] = h_pre != nullptr ? h_pre[m * n + threadIdx.x] : 0.0f;
  }
  __syncthreads();
  const int64_t rel =
      (static_cast<int64_t>(blockIdx.y) * kTermsThreads + threadIdx.x) * V;
  if (rel >= chunk.width) return;
  const int64_t c = chunk.begin + rel;
  float d[V] = {};
  if (h_pre != nullptr) LoadVec<T, V>(dy + m * s.C + c, d);
  float g[kMaxStreams][V];
#pragma unroll
  for (int l = 0; l < kMaxStreams; ++l) {
    if (l < n && dx_next != nullptr) {
      LoadVec<T, V>(dx_next + m * s.K + XIndex(s, l, c), g[l]);
    }
  }
  float* out = terms + m * n * chunk.width;
#pragma unroll
  for (int i = 0; i < kMaxStreams; ++i) {
    if (i >= n) break;
    float t[V];
#pragma unroll
    for (int e = 0; e < V; ++e) t[e] = h_s[i] * d[e];
    if (dx_next != nullptr) {
#pragma unroll
      for (int l = 0; l < kMaxStreams; ++l) {
        if (l >= n) break;
#pragma unroll
        for (int e = 0; e < V; ++e) t[e] = fmaf(r_s[i * n + l], g[l][e], t[e]);
      }
    }
    if constexpr (V == 2) {
      *reinterpret_cast<float2*>(out + i * chunk.width + rel) =
          make_float2(t[0], t[1]);
    } else {
      out[s.minor ? rel * n + i : i * chunk.width + rel] = t[0];
    }
  }
}

}  // namespace

cudaError_t LaunchDxTerms(const DevSpec& s, int64_t tokens, DType dtype,
                          ChannelChunk chunk, const float* h_pre,
                          const void* dy, const float* r, const void* dx_next,
                          float* terms, cudaStream_t stream) {
  if (tokens <= 0) return cudaSuccess;
  // Pairs need even channel offsets and widths, and 4-byte aligned rows
  // (four channels a thread, with 8-byte loads, measured slower:
  // docs/decisions.md).
  const bool pairs = !s.minor && DTypeSize(dtype) == 2 && s.C % 2 == 0 &&
                     chunk.begin % 2 == 0 && chunk.width % 2 == 0 &&
                     reinterpret_cast<uintptr_t>(dy) % 4 == 0 &&
                     reinterpret_cast<uintptr_t>(dx_next) % 4 == 0;
  cudaError_t err = cudaSuccess;
  DispatchDType(dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    DispatchBool(pairs, [&](auto pair_tag) {
      constexpr int V = decltype(pair_tag)::value ? 2 : 1;
      const int64_t blocks =
          (chunk.width + kTermsThreads * V - 1) / (kTermsThreads * V);
      err = LaunchAfterPrevious(
          dx_terms_kernel<T, V>, dim3(GridSize(tokens), GridSize(blocks)),
          dim3(kTermsThreads), 0, stream, s, chunk, h_pre,
          static_cast<const T*>(dy), r, static_cast<const T*>(dx_next), terms);
    });
  });
  return err;
}

}  // namespace mhc::cuda
