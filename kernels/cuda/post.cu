// Post (expand & combine) x_next[j][c] = H_post[j] (f[c] + bias[c]) +
// sum_i R[i][j] x[i][c] and its backward.
// Determinism / batch invariance: one CTA per token; x_next, df and dx are
// elementwise with sums in a fixed stream order; dH_post and dH_res are
// reduced over channels by the fixed-shape BlockSum. dbias is summed over
// fixed chunks of kTokenChunk tokens (token order inside a chunk) into
// workspace partials, then over chunks in order: deterministic for any M.
#include "common.cuh"
#include "dispatch.cuh"
#include "launch.h"
#include "row_access.cuh"

namespace mhc::cuda {
namespace {

// Loads H_post and R (source-rows form, R[i][j] at i*NT + j) of token m.
template <int NT>
__device__ __forceinline__ void LoadMixing(const DevSpec& s, int n,
                                           const float* h_post,
                                           const float* h_res, int64_t m,
                                           float* hp, float* r) {
  for (int t = threadIdx.x; t < NT * NT; t += blockDim.x) {
    const int i = t / NT;
    const int j = t % NT;
    float value = 0.0f;
    if (i < n && j < n) {
      const int idx = s.dest_rows ? j * n + i : i * n + j;
      value = h_res[m * n * n + idx];
    }
    r[t] = value;
  }
  if (threadIdx.x < NT) {
    hp[threadIdx.x] = threadIdx.x < n ? h_post[m * n + threadIdx.x] : 0.0f;
  }
  __syncthreads();
}

// Resident CTAs per SM the post kernels are compiled for (kRowThreads says
// why). The n = 4 backward holds 20 sums and 2 x 4 streams of loads:
// uncapped it took 134-156 registers, three CTAs per SM, which left HBM idle
// (bench/RESULTS.md: 8-15 % slower); capped at five or six it spills. The
// strided forward (odd C) gains from five likewise. The n = 8 backward (72
// sums) spills when capped and measured slower.
template <int NT, bool kStrided>
inline constexpr int kPostForwardBlocks = NT == 4 && kStrided ? 5 : 0;
template <int NT>
inline constexpr int kPostBackwardBlocks = NT == 4 ? 4 : 0;

template <typename T, int NT, int V, bool kStrided>
__global__ void __launch_bounds__(kRowThreads, kPostForwardBlocks<NT, kStrided>)
    post_forward_kernel(DevSpec s, const T* f, const T* x, const float* h_post,
                        const float* h_res, const float* bias, T* x_next) {
  const int n = NT == 4 ? 4 : s.n;
  const int64_t m = blockIdx.x;
  __shared__ float hp[NT];
  __shared__ float r[NT * NT];
  LoadMixing<NT>(s, n, h_post, h_res, m, hp, r);
  const T* row = x + m * s.K;
  const T* f_row = f + m * s.C;
  T* out_row = x_next + m * s.K;
  for (int64_t c = FirstChannel<V, kStrided>(threadIdx.x); c < s.C;
       c += kRowThreads * V) {
    float xv[NT][V];
    float fv[V];
    LoadStreams<T, NT, V, kStrided>(s, n, row, c, xv);
    LoadChannels<T, V, kStrided>(f_row, c, s.C, fv);
    if (s.has_bias) AddChannels<V, kStrided>(bias, c, s.C, fv);
    float out[NT][V];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int v = 0; v < V; ++v) {
        float acc = hp[j] * fv[v];
#pragma unroll
        for (int i = 0; i < NT; ++i) {
          if (i >= n) break;
          acc = fmaf(r[i * NT + j], xv[i][v], acc);
        }
        out[j][v] = acc;
      }
    }
    StoreStreams<T, NT, V, kStrided>(s, n, out_row, c, out);
  }
}

template <typename T, int NT, int V, bool kStrided>
__global__ void __launch_bounds__(kRowThreads, kPostBackwardBlocks<NT>)
    post_backward_kernel(DevSpec s, const T* dx_next, const T* f, const T* x,
                         const float* h_post, const float* h_res,
                         const float* bias, T* df, T* dx, float* dh_post,
                         float* dh_res) {
  const int n = NT == 4 ? 4 : s.n;
  const int64_t m = blockIdx.x;
  constexpr int kW = NT + NT * NT;
  __shared__ float hp[NT];
  __shared__ float r[NT * NT];
  __shared__ float red[kW * (kRowThreads / 32)];
  __shared__ float total[kW];
  LoadMixing<NT>(s, n, h_post, h_res, m, hp, r);
  const T* g_row = dx_next + m * s.K;
  const T* x_row = x + m * s.K;
  const T* f_row = f + m * s.C;
  // acc[j] = dH_post[j], acc[NT + i*NT + j] = dR[i][j].
  float acc[kW];
#pragma unroll
  for (int w = 0; w < kW; ++w) acc[w] = 0.0f;
  for (int64_t c = FirstChannel<V, kStrided>(threadIdx.x); c < s.C;
       c += kRowThreads * V) {
    float gv[NT][V];
    float xv[NT][V];
    float fv[V];
    LoadStreams<T, NT, V, kStrided>(s, n, g_row, c, gv);
    LoadStreams<T, NT, V, kStrided>(s, n, x_row, c, xv);
    LoadChannels<T, V, kStrided>(f_row, c, s.C, fv);
    if (s.has_bias) AddChannels<V, kStrided>(bias, c, s.C, fv);
    float dfv[V];
#pragma unroll
    for (int v = 0; v < V; ++v) {
      float d = 0.0f;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if (j >= n) break;
        d = fmaf(hp[j], gv[j][v], d);
      }
      dfv[v] = d;
    }
    StoreChannels<T, V, kStrided>(df + m * s.C, c, s.C, dfv);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int v = 0; v < V; ++v) acc[j] = fmaf(gv[j][v], fv[v], acc[j]);
    }
#pragma unroll
    for (int i = 0; i < NT; ++i) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int v = 0; v < V; ++v) {
          acc[NT + i * NT + j] = fmaf(xv[i][v], gv[j][v], acc[NT + i * NT + j]);
        }
      }
    }
    if (dx != nullptr) {
      float out[NT][V];
#pragma unroll
      for (int i = 0; i < NT; ++i) {
#pragma unroll
        for (int v = 0; v < V; ++v) {
          float d = 0.0f;
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            if (j >= n) break;
            d = fmaf(r[i * NT + j], gv[j][v], d);
          }
          out[i][v] = d;
        }
      }
      StoreStreams<T, NT, V, kStrided>(s, n, dx + m * s.K, c, out);
    }
  }
  BlockSum<kW>(acc, red, total);
  for (int t = threadIdx.x; t < n * n; t += blockDim.x) {
    const int a = t / n;
    const int b = t % n;
    // dH_res is the gradient of H_res itself: transpose back for DEST_ROWS.
    const int i = s.dest_rows ? b : a;
    const int j = s.dest_rows ? a : b;
    dh_res[m * n * n + t] = total[NT + i * NT + j];
  }
  if (threadIdx.x < n) dh_post[m * n + threadIdx.x] = total[threadIdx.x];
}

// Per-chunk partial sums of df over the chunk's tokens in token order.
template <typename T>
__global__ void post_bias_partial_kernel(DevSpec s, int64_t tokens,
                                         const T* dx_next, const float* h_post,
                                         float* partial) {
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= s.C) return;
  const int64_t chunk = blockIdx.x;
  const int64_t begin = chunk * kTokenChunk;
  const int64_t end = min(tokens, begin + kTokenChunk);
  float sum = 0.0f;
  for (int64_t m = begin; m < end; ++m) {
    float d = 0.0f;
    for (int j = 0; j < s.n; ++j) {
      d = fmaf(h_post[m * s.n + j], ToFloat(dx_next[m * s.K + XIndex(s, j, c)]),
               d);
    }
    sum += d;
  }
  partial[chunk * s.C + c] = sum;
}

}  // namespace

size_t PostBackwardWorkspace(const LayerSpec& spec, int64_t tokens) {
  if (!spec.has_post_bias) return 0;
  return AlignBytes(sizeof(float) * NumChunks(tokens) * spec.hidden);
}

absl::Status LaunchPostForward(const PostForwardParams& p,
                               cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*p.spec);
  const RowAccess access =
      ChooseRowAccess(*p.spec, p.act_dtype, p.f, p.x, p.x_next);
  const float* bias = s.has_bias ? p.weights.bias : nullptr;
  DispatchStreams(
      p.act_dtype, s.n, access, [&](auto tt, auto nt, auto vt, auto rt) {
        using T = typename decltype(tt)::type;
        post_forward_kernel<T, decltype(nt)::value, decltype(vt)::value,
                            decltype(rt)::value>
            <<<GridSize(p.tokens), kRowThreads, 0, stream>>>(
                s, static_cast<const T*>(p.f), static_cast<const T*>(p.x),
                p.h_post, p.h_res, bias, static_cast<T*>(p.x_next));
      });
  MHC_CUDA_CHECK_LAUNCH("post forward",
                        ShapeString(*p.spec, p.tokens, p.act_dtype));
  return absl::OkStatus();
}

absl::Status LaunchPostBackward(const PostBackwardParams& p, Workspace ws,
                                cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*p.spec);
  const std::string shape = ShapeString(*p.spec, p.tokens, p.act_dtype);
  const RowAccess access =
      ChooseRowAccess(*p.spec, p.act_dtype, p.dx_next, p.f, p.x, p.df, p.dx);
  const float* bias = s.has_bias ? p.weights.bias : nullptr;
  DispatchStreams(
      p.act_dtype, s.n, access, [&](auto tt, auto nt, auto vt, auto rt) {
        using T = typename decltype(tt)::type;
        post_backward_kernel<T, decltype(nt)::value, decltype(vt)::value,
                             decltype(rt)::value>
            <<<GridSize(p.tokens), kRowThreads, 0, stream>>>(
                s, static_cast<const T*>(p.dx_next), static_cast<const T*>(p.f),
                static_cast<const T*>(p.x), p.h_post, p.h_res, bias,
                static_cast<T*>(p.df), static_cast<T*>(p.dx), p.dh_post,
                p.dh_res);
      });
  MHC_CUDA_CHECK_LAUNCH("post backward", shape);
  if (!s.has_bias || p.grads.bias == nullptr) return absl::OkStatus();
  if (ws.bytes < PostBackwardWorkspace(*p.spec, p.tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda post backward ", shape, ": workspace too small"));
  }
  float* partial = static_cast<float*>(ws.data);
  const int64_t chunks = NumChunks(p.tokens);
  const dim3 grid(GridSize(chunks), GridSize((s.C + 127) / 128));
  DispatchDType(p.act_dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    post_bias_partial_kernel<T><<<grid, 128, 0, stream>>>(
        s, p.tokens, static_cast<const T*>(p.dx_next), p.h_post, partial);
  });
  MHC_CUDA_CHECK_LAUNCH("post backward (bias partials)", shape);
  return LaunchChunkSum(partial, chunks, s.C, p.grads.bias, stream);
}

}  // namespace mhc::cuda
