// Scale (logits and gates) forward and backward, plus the fixed-order
// token reductions that turn per-token contributions into parameter
// gradients. Determinism / batch invariance: one thread per token for
// everything per token; dalpha / dbeta (and every other parameter gradient
// built from per-token rows) are summed over fixed chunks of kTokenChunk
// tokens in token order, then over chunks in order, never with atomics.
// The n = 4 scale backward reduces inside the kernel instead: fixed chunks of
// kScaleChunk tokens (a constant, never a function of M), each summed as 8
// runs of 32 tokens in token order and then the 8 runs in order; the chunk
// partials are then summed by one warp per column in a fixed lane / butterfly
// order. Only dalpha / dbeta (sums over tokens) go through it, so per-token
// outputs keep their bits whatever the batch.
#include "common.cuh"
#include "dispatch.cuh"
#include "launch.h"
#include "mix.cuh"

namespace mhc::cuda {
namespace {

constexpr int kTokenThreads = 64;

template <int NT>
__global__ void __launch_bounds__(kTokenThreads)
    scale_forward_kernel(DevSpec s, int64_t tokens, const float* h,
                         const float* mean_square, const float* alpha,
                         const float* beta, float* h_pre, float* h_post,
                         float* logits) {
  const int64_t m = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (m >= tokens) return;
  const int n = StreamCount<NT>(s);
  float hp[NT], hq[NT], a[NT * NT];
  const float* h_row = s.dynamic ? h + m * s.N : nullptr;
  const float ms = s.dynamic ? mean_square[m] : 0.0f;
  ScaleForwardToken<NT>(s, h_row, ms, alpha, beta, hp, hq, a);
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    if (i >= n) break;
    h_pre[m * n + i] = hp[i];
  }
  if (s.head) return;
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    if (i >= n) break;
    h_post[m * n + i] = hq[i];
  }
#pragma unroll
  for (int e = 0; e < NT * NT; ++e) {
    if (e >= n * n) break;
    logits[m * n * n + e] = a[e];
  }
}

template <int NT>
__global__ void __launch_bounds__(kTokenThreads)
    scale_backward_kernel(DevSpec s, int64_t tokens, const float* h,
                          const float* mean_square, const float* alpha,
                          const float* beta, const float* dh_pre,
                          const float* dh_post, const float* dlogits, float* dh,
                          float* dmean_square, float* contrib) {
  const int64_t m = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (m >= tokens) return;
  const int n = StreamCount<NT>(s);
  float da[NT * NT];
#pragma unroll
  for (int e = 0; e < NT * NT; ++e) {
    da[e] = (!s.head && e < n * n) ? dlogits[m * n * n + e] : 0.0f;
  }
  const int width = s.N + s.num_alpha;
  ScaleBackwardToken<NT>(
      s, s.dynamic ? h + m * s.N : nullptr, s.dynamic ? mean_square[m] : 0.0f,
      alpha, beta, dh_pre + m * n, s.head ? nullptr : dh_post + m * n, da,
      s.dynamic ? dh + m * s.N : nullptr,
      s.dynamic ? dmean_square + m : nullptr, contrib + m * width);
}

constexpr int kScaleChunk = 256;  // tokens per block = per partial row
constexpr int kScaleRuns = 8;     // runs of kScaleChunk / kScaleRuns tokens
constexpr int kScaleWidth = 27;   // widest row on this path: N + 3, n = 4
constexpr int kScaleStride = kScaleWidth + 2;  // odd: spreads smem banks

__global__ void __launch_bounds__(kScaleChunk)
    scale_backward_chunk_kernel(DevSpec s, int64_t tokens, const float* h,
                                const float* mean_square, const float* alpha,
                                const float* beta, const float* dh_pre,
                                const float* dh_post, const float* dlogits,
                                float* dh, float* dmean_square,
                                float* partial) {
  __shared__ float rows[kScaleChunk * kScaleStride];
  __shared__ float runs[kScaleWidth * kScaleRuns];
  const int width = s.N + s.num_alpha;
  const int t = threadIdx.x;
  const int64_t m = static_cast<int64_t>(blockIdx.x) * kScaleChunk + t;
  float* row = rows + t * kScaleStride;
  if (m < tokens) {
    constexpr int n = 4;
    float da[n * n];
#pragma unroll
    for (int e = 0; e < n * n; ++e) {
      da[e] = s.head ? 0.0f : dlogits[m * n * n + e];
    }
    ScaleBackwardToken<n>(s, s.dynamic ? h + m * s.N : nullptr,
                          s.dynamic ? mean_square[m] : 0.0f, alpha, beta,
                          dh_pre + m * n, s.head ? nullptr : dh_post + m * n,
                          da, s.dynamic ? dh + m * s.N : nullptr,
                          s.dynamic ? dmean_square + m : nullptr, row);
  } else {
    for (int w = 0; w < width; ++w) row[w] = 0.0f;
  }
  __syncthreads();
  constexpr int kRun = kScaleChunk / kScaleRuns;
  if (t < width * kScaleRuns) {
    const int w = t / kScaleRuns, q = t % kScaleRuns;
    const float* src = rows + q * kRun * kScaleStride + w;
    float sum = 0.0f;
#pragma unroll 8
    for (int i = 0; i < kRun; ++i) sum += src[i * kScaleStride];
    runs[w * kScaleRuns + q] = sum;
  }
  __syncthreads();
  if (t < width) {
    float sum = 0.0f;
#pragma unroll
    for (int q = 0; q < kScaleRuns; ++q) sum += runs[t * kScaleRuns + q];
    partial[blockIdx.x * width + t] = sum;
  }
}

// One warp per column: lane l adds chunks l, l + 32, ... in order, then the
// lanes combine in a fixed butterfly; adds into out_a (w < split) / out_b.
__global__ void warp_chunk_sum_kernel(const float* partial, int64_t chunks,
                                      int width, int split, float* out_a,
                                      float* out_b) {
  const int w = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (w >= width) return;  // whole warps leave together
  float sum = 0.0f;
  for (int64_t q = lane; q < chunks; q += 32) sum += partial[q * width + w];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    sum += __shfl_xor_sync(0xffffffffu, sum, off);
  }
  if (lane != 0) return;
  if (w < split) {
    if (out_a != nullptr) out_a[w] += sum;
  } else if (out_b != nullptr) {
    out_b[w - split] += sum;
  }
}

__global__ void column_partial_kernel(const float* rows, int64_t tokens,
                                      int width, float* partial) {
  const int w = blockIdx.y * blockDim.x + threadIdx.x;
  if (w >= width) return;
  const int64_t chunk = blockIdx.x;
  const int64_t begin = chunk * kTokenChunk;
  const int64_t end = min(tokens, begin + kTokenChunk);
  float sum = 0.0f;
  for (int64_t m = begin; m < end; ++m) sum += rows[m * width + w];
  partial[chunk * width + w] = sum;
}

__global__ void chunk_sum_kernel(const float* partial, int64_t chunks,
                                 int64_t width, int64_t split, float* out_a,
                                 float* out_b) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (w >= width) return;
  float sum = 0.0f;
  for (int64_t q = 0; q < chunks; ++q) sum += partial[q * width + w];
  if (w < split) {
    if (out_a != nullptr) out_a[w] += sum;
  } else if (out_b != nullptr) {
    out_b[w - split] += sum;
  }
}

}  // namespace

absl::Status LaunchColumnSum(const float* rows, int64_t tokens, int width,
                             int split, float* partial, float* out_a,
                             float* out_b, cudaStream_t stream) {
  if (out_a == nullptr && out_b == nullptr) return absl::OkStatus();
  const int64_t chunks = NumChunks(tokens);
  const dim3 grid(GridSize(chunks), GridSize((width + 127) / 128));
  column_partial_kernel<<<grid, 128, 0, stream>>>(rows, tokens, width, partial);
  MHC_CUDA_CHECK_LAUNCH("column sum",
                        absl::StrCat("[M=", tokens, " W=", width, "]"));
  chunk_sum_kernel<<<GridSize((width + 127) / 128), 128, 0, stream>>>(
      partial, chunks, width, split, out_a, out_b);
  MHC_CUDA_CHECK_LAUNCH("column sum (chunks)",
                        absl::StrCat("[M=", tokens, " W=", width, "]"));
  return absl::OkStatus();
}

absl::Status LaunchChunkSum(const float* partial, int64_t chunks, int64_t width,
                            float* out, cudaStream_t stream) {
  chunk_sum_kernel<<<GridSize((width + 127) / 128), 128, 0, stream>>>(
      partial, chunks, width, width, out, nullptr);
  MHC_CUDA_CHECK_LAUNCH("chunk sum",
                        absl::StrCat("[chunks=", chunks, " W=", width, "]"));
  return absl::OkStatus();
}

size_t ScaleBackwardWorkspace(const LayerSpec& spec, int64_t tokens) {
  const int64_t width = spec.NumLogits() + spec.NumAlpha();
  return AlignBytes(sizeof(float) * tokens * width) +
         AlignBytes(sizeof(float) * NumChunks(tokens) * width);
}

absl::Status LaunchScaleForward(const ScaleForwardParams& p,
                                cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*p.spec);
  const unsigned grid =
      GridSize((p.tokens + kTokenThreads - 1) / kTokenThreads);
  DispatchMix(s.n, [&](auto nt) {
    scale_forward_kernel<decltype(nt)::value>
        <<<grid, kTokenThreads, 0, stream>>>(s, p.tokens, p.h, p.mean_square,
                                             p.weights.alpha, p.weights.beta,
                                             p.h_pre, p.h_post, p.logits);
  });
  MHC_CUDA_CHECK_LAUNCH("scale forward",
                        ShapeString(*p.spec, p.tokens, DType::kF32));
  return absl::OkStatus();
}

absl::Status LaunchScaleBackward(const ScaleBackwardParams& p, Workspace ws,
                                 cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*p.spec);
  const std::string shape = ShapeString(*p.spec, p.tokens, DType::kF32);
  if (ws.bytes < ScaleBackwardWorkspace(*p.spec, p.tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda scale backward ", shape, ": workspace too small"));
  }
  const int width = s.N + s.num_alpha;
  if (p.tokens == 0) return absl::OkStatus();
  if (s.n == 4 && width <= kScaleWidth) {
    float* partial = static_cast<float*>(ws.data);
    const int64_t chunks = (p.tokens + kScaleChunk - 1) / kScaleChunk;
    scale_backward_chunk_kernel<<<GridSize(chunks), kScaleChunk, 0, stream>>>(
        s, p.tokens, p.h, p.mean_square, p.weights.alpha, p.weights.beta,
        p.dh_pre, p.dh_post, p.dlogits, p.dh, p.dmean_square, partial);
    MHC_CUDA_CHECK_LAUNCH("scale backward", shape);
    float* out_b = s.dynamic ? p.grads.alpha : nullptr;
    if (p.grads.beta == nullptr && out_b == nullptr) return absl::OkStatus();
    constexpr int kWarps = 4;
    warp_chunk_sum_kernel<<<GridSize((width + kWarps - 1) / kWarps),
                            32 * kWarps, 0, stream>>>(partial, chunks, width,
                                                      s.N, p.grads.beta, out_b);
    MHC_CUDA_CHECK_LAUNCH("scale backward (chunks)", shape);
    return absl::OkStatus();
  }
  float* contrib = static_cast<float*>(ws.data);
  float* partial =
      reinterpret_cast<float*>(static_cast<char*>(ws.data) +
                               AlignBytes(sizeof(float) * p.tokens * width));
  const unsigned grid =
      GridSize((p.tokens + kTokenThreads - 1) / kTokenThreads);
  DispatchMix(s.n, [&](auto nt) {
    scale_backward_kernel<decltype(nt)::value>
        <<<grid, kTokenThreads, 0, stream>>>(
            s, p.tokens, p.h, p.mean_square, p.weights.alpha, p.weights.beta,
            p.dh_pre, p.dh_post, p.dlogits, p.dh, p.dmean_square, contrib);
  });
  MHC_CUDA_CHECK_LAUNCH("scale backward", shape);
  return LaunchColumnSum(contrib, p.tokens, width, s.N, partial, p.grads.beta,
                         s.dynamic ? p.grads.alpha : nullptr, stream);
}

}  // namespace mhc::cuda
