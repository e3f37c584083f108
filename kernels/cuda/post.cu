// Post (expand & combine) x_next[j][c] = H_post[j] (f[c] + bias[c]) +
// sum_i R[i][j] x[i][c] and its backward.
// Determinism / batch invariance: one CTA per token; x_next, df and dx are
// elementwise with sums in a fixed stream order; dH_post and dH_res are
// reduced over channels by the fixed-shape GroupSum. dbias is summed over
// fixed chunks of kTokenChunk tokens (token order inside a chunk) into
// workspace partials, then over chunks in order: deterministic for any M.
// bf16 stream-major rows at n = 3 and 5..16 run on the tensor cores instead
// (post_mma.cu); the post plan (plans/post.h) says where.
#include <type_traits>

#include "common.cuh"
#include "dispatch.cuh"
#include "launch.h"
#include "post_backward_steps.cuh"
#include "post_mixing.cuh"
#include "primitives/l2_prefetch.cuh"
#include "primitives/row_access.cuh"
#include "primitives/staged_windows.cuh"

namespace mhc::cuda {
namespace {

// The wide backward kernels split a token's streams into kSlices slices of
// S = NT / kSlices, one group of threads each: group p computes
// dx and the dH_res rows of streams [p S, p S + S) from all of dx_next,
// whose rows the other groups read again from L1 / L2; group 0 also
// computes df and dH_post. One thread holding all NT + NT^2 sums needs
// nearly all registers at n = 8 (too few warps per SM to keep HBM busy) and
// local memory at n = 16. The forward splits only at n = 16 (x_next rows by
// slice, from all of x): at n = 8 the second read of x cost more than the
// halved per-thread sums saved (docs/decisions.md).
template <int NT>
inline constexpr int kPostForwardSlices = NT >= 16 ? 4 : 1;
template <int NT>
inline constexpr int kPostBackwardSlices = NT >= 16 ? 4 : (NT >= 8 ? 2 : 1);

// Threads per slice group of the backward: n = 4 on vector rows runs 64
// (more CTAs per SM than of 128 at the same registers), which hides a CTA's
// fixed costs (the mixing values, the sums' reduction and stores) where C is
// small and a CTA has few channel steps; strided rows (odd C) and the other
// row kernels measured slower that way (docs/decisions.md).
template <int NT, bool kStrided>
inline constexpr int kPostBackwardGroup =
    NT == 4 && !kStrided ? 64 : kRowThreads;

// The slice of the calling thread's group (of kGroup threads): its first
// stream, and the thread's index within the group.
struct PostSlice {
  int first;
  int thread;
};
template <int NT, int kSlices, int kGroup = kRowThreads>
__device__ __forceinline__ PostSlice SliceOfThread() {
  if constexpr (kSlices == 1) return PostSlice{0, int(threadIdx.x)};
  return PostSlice{int(threadIdx.x) / kGroup * (NT / kSlices),
                   int(threadIdx.x) % kGroup};
}

// The n = 4 backward on 16-byte vector rows keeps two channel steps of
// loads in flight (post_backward_steps.cuh).
template <typename T, int NT, int V, bool kStrided>
inline constexpr bool kPipelinedBackward =
    NT == 4 && !kStrided && V * sizeof(T) == 16;

// Resident CTAs per SM the post kernels are compiled for (kRowThreads says
// why). The n = 4 backward holds 20 sums and 2 x 4 streams of loads:
// uncapped the compiler leaves three CTAs of 128 threads per SM, which
// leaves HBM idle (docs/decisions.md); capped at five or six such CTAs it
// spills, so its strided 128-thread CTAs are capped at four. Its vector
// rows' 64-thread CTAs, with two steps of loads, hold 168 registers at six
// (eight spill). The strided forward (odd C) gains from five likewise.
template <int NT, bool kStrided>
inline constexpr int kPostForwardBlocks = NT == 4 && kStrided ? 5 : 0;
template <int NT, bool kStrided>
inline constexpr int kPostBackwardBlocks = NT != 4    ? 0
                                           : kStrided ? 4
                                                      : 6;

// Stream-minor vector rows whose 16-byte words each hold whole channels
// (kPer / NT of them): n = 2 and 4, and n = 8 in 16 bits. The general loop
// gives a thread V consecutive channels, so at n = 4 a warp's 16-byte
// accesses lie 64 bytes apart and every access moves half a sector; the
// forward, which mostly streams, ran slower than on stream-major rows
// (bench/RESULTS.md). Here a step's words are dealt to the threads in turn:
// each warp access covers consecutive words, and its f loads consecutive
// channels. Every output is the general loop's sum: the same bits.
template <typename T, int NT, int V, bool kStrided>
inline constexpr bool kPostForwardMinorWords =
    V > 1 && !kStrided && (16 / sizeof(T)) % NT == 0;

template <typename T, int NT>
__device__ __forceinline__ void PostForwardMinorWords(
    const DevSpec& s, const T* x_row, const T* f_row, const float* bias,
    const float* r, const float* hp, T* out_row) {
  constexpr int kPer = 16 / sizeof(T);
  constexpr int kG = kPer / NT;  // channels per word
  constexpr int kWords = 4;      // a thread's word loads in flight
  const int64_t words = s.C / kG;
  const uint4* x_words = reinterpret_cast<const uint4*>(x_row);
  uint4* out_words = reinterpret_cast<uint4*>(out_row);
  for (int64_t w0 = threadIdx.x; w0 < words; w0 += kWords * kRowThreads) {
    uint4 xw[kWords];
    float fv[kWords][kG];
#pragma unroll
    for (int q = 0; q < kWords; ++q) {
      const int64_t w = w0 + q * kRowThreads;
      if (w < words) {
        xw[q] = x_words[w];
        LoadVec<T, kG>(f_row + w * kG, fv[q]);
      }
    }
#pragma unroll
    for (int q = 0; q < kWords; ++q) {
      const int64_t w = w0 + q * kRowThreads;
      if (w >= words) break;
      if (s.has_bias) AddChannels<kG, false>(bias, w * kG, s.C, fv[q]);
      const T* in = reinterpret_cast<const T*>(&xw[q]);
      uint4 word;
      T* out = reinterpret_cast<T*>(&word);
#pragma unroll
      for (int g = 0; g < kG; ++g) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          float acc = hp[j] * fv[q][g];
#pragma unroll
          for (int i = 0; i < NT; ++i) {
            acc = fmaf(r[i * NT + j], ToFloat(in[g * NT + i]), acc);
          }
          out[g * NT + j] = FromFloat<T>(acc);
        }
      }
      out_words[w] = word;
    }
  }
}

template <typename T, int NT, int V, bool kStrided, bool kStaged>
__global__ void __launch_bounds__(kRowThreads* kPostForwardSlices<NT>,
                                  kPostForwardBlocks<NT, kStrided>)
    post_forward_kernel(DevSpec s, const T* f, const T* x, const float* h_post,
                        const float* h_res, const float* bias, T* x_next) {
  WaitForPrerequisiteGrid();  // f, x and the mixing
  constexpr int kSlices = kPostForwardSlices<NT>;
  constexpr int kS = NT / kSlices;
  const int n = NT == 4 ? 4 : s.n;
  const int64_t m = blockIdx.x, tokens = gridDim.x;  // a CTA per token
  const PostSlice slice = SliceOfThread<NT, kSlices>();
  __shared__ float mix[kMixingSlots<NT>];
  const float* r = mix;
  const float* hp = mix + NT * NT;
  PostMixing<NT, kRowThreads * kSlices> mixing;
  FetchMixing<NT>(mixing, s, n, h_post, h_res, m);
  const T* row = x + m * s.K;
  const T* f_row = f + m * s.C;
  T* out_row = x_next + m * s.K;
  mixing.Publish(mix);
  if constexpr (kPostForwardMinorWords<T, NT, V, kStrided>) {
    if (s.minor) {
      PostForwardMinorWords<T, NT>(s, row, f_row, bias, r, hp, out_row);
      return;
    }
  }
  struct Loaded {
    float x[NT][V];
    float f[V];
  };
  auto step = [&](int64_t c, Loaded& l) {
    if (s.has_bias) AddChannels<V, kStrided>(bias, c, s.C, l.f);
    float out[kS][V];
#pragma unroll
    for (int a = 0; a < kS; ++a) {
      const int j = slice.first + a;
#pragma unroll
      for (int v = 0; v < V; ++v) {
        float acc = hp[j] * l.f[v];
#pragma unroll
        for (int i = 0; i < NT; ++i) {
          if (i >= n) break;
          acc = fmaf(r[i * NT + j], l.x[i][v], acc);
        }
        out[a][v] = acc;
      }
    }
    StoreStreamSlice<T, NT, kS, V, kStrided>(s, n, out_row, slice.first, c,
                                             out);
  };
  auto rows = [&](Loaded& l, auto&& visit) {
#pragma unroll
    for (int i = 0; i < NT; ++i) visit(row + i * s.C, x + tokens * s.K, l.x[i]);
    visit(f_row, f + tokens * s.C, l.f);
  };
  if (ForEachStagedStep<Loaded, T, V, kStaged, kRowThreads,
                        kRowThreads * kSlices / 32, NT + 1>(
          s.C, slice.thread, rows, [] {}, step)) {
    return;
  }
  for (int64_t c = FirstChannel<V, kStrided>(slice.thread); c < s.C;
       c += kRowThreads * V) {
    Loaded l;
    LoadStreams<T, NT, V, kStrided>(s, n, row, c, l.x);
    LoadChannels<T, V, kStrided>(f_row, c, s.C, l.f);
    step(c, l);
  }
}

template <typename T, int NT, int V, bool kStrided>
__global__ void __launch_bounds__(
    kPostBackwardGroup<NT, kStrided>* kPostBackwardSlices<NT>,
    kPostBackwardBlocks<NT, kStrided>)
    post_backward_kernel(DevSpec s, const T* dx_next, const T* f, const T* x,
                         const float* h_post, const float* h_res,
                         const float* bias, T* df, T* dx, float* dh_post,
                         float* dh_res) {
  WaitForPrerequisiteGrid();  // dx_next, f, x and the mixing
  constexpr int kSlices = kPostBackwardSlices<NT>;
  constexpr int kGroup = kPostBackwardGroup<NT, kStrided>;
  constexpr int kS = NT / kSlices;
  const int n = NT == 4 ? 4 : s.n;
  const int64_t m = blockIdx.x;
  const PostSlice slice = SliceOfThread<NT, kSlices, kGroup>();
  const bool first_group = slice.first == 0;
  // acc[j] = dH_post[j] (group 0), acc[NT + a*NT + j] = dR[first + a][j].
  constexpr int kW = NT + kS * NT;
  __shared__ float mix[kMixingSlots<NT>];
  __shared__ float red[kW * kSlices * (kGroup / 32)];
  __shared__ float total[kW * kSlices];
  const float* r = mix;
  const float* hp = mix + NT * NT;
  PostMixing<NT, kGroup * kSlices> mixing;
  FetchMixing<NT>(mixing, s, n, h_post, h_res, m);
  const T* g_row = dx_next + m * s.K;
  const T* x_row = x + m * s.K;
  const T* f_row = f + m * s.C;
  float acc[kW];
#pragma unroll
  for (int w = 0; w < kW; ++w) acc[w] = 0.0f;
  if constexpr (kPipelinedBackward<T, NT, V, kStrided>) {
    auto steps = [&](auto minor_tag) {
      PipelinedBackwardSteps<T, decltype(minor_tag)::value, kGroup>(
          s, g_row, x_row, f_row, bias, r, hp, df + m * s.C,
          dx == nullptr ? nullptr : dx + m * s.K, slice.thread, acc,
          [&] { mixing.Publish(mix); });
    };
    if (s.minor) {
      steps(std::true_type{});
    } else {
      steps(std::false_type{});
    }
  } else {
    struct Loaded {
      float g[NT][V];
      float x[kS][V];
      float f[V];
    };
    auto load = [&](int64_t c, Loaded& l) {
      LoadStreams<T, NT, V, kStrided>(s, n, g_row, c, l.g);
      LoadStreamSlice<T, NT, kS, V, kStrided>(s, n, x_row, slice.first, c, l.x);
      if (first_group) LoadChannels<T, V, kStrided>(f_row, c, s.C, l.f);
    };
    auto channel_steps = [&](auto load_step) {
      ForEachChannelStep<Loaded, V, kStrided, !kStrided, kGroup>(
          s.C, slice.thread, load_step, [&] { mixing.Publish(mix); },
          [&](int64_t c, Loaded& l) {
            if (first_group) {
              if (s.has_bias) AddChannels<V, kStrided>(bias, c, s.C, l.f);
              float dfv[V];
#pragma unroll
              for (int v = 0; v < V; ++v) {
                float d = 0.0f;
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                  if (j >= n) break;
                  d = fmaf(hp[j], l.g[j][v], d);
                }
                dfv[v] = d;
              }
              StoreChannels<T, V, kStrided>(df + m * s.C, c, s.C, dfv);
#pragma unroll
              for (int j = 0; j < NT; ++j) {
#pragma unroll
                for (int v = 0; v < V; ++v) {
                  acc[j] = fmaf(l.g[j][v], l.f[v], acc[j]);
                }
              }
            }
#pragma unroll
            for (int a = 0; a < kS; ++a) {
#pragma unroll
              for (int j = 0; j < NT; ++j) {
#pragma unroll
                for (int v = 0; v < V; ++v) {
                  acc[NT + a * NT + j] =
                      fmaf(l.x[a][v], l.g[j][v], acc[NT + a * NT + j]);
                }
              }
            }
            if (dx == nullptr) return;
            float out[kS][V];
#pragma unroll
            for (int a = 0; a < kS; ++a) {
              const int i = slice.first + a;
#pragma unroll
              for (int v = 0; v < V; ++v) {
                float d = 0.0f;
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                  if (j >= n) break;
                  d = fmaf(r[i * NT + j], l.g[j][v], d);
                }
                out[a][v] = d;
              }
            }
            StoreStreamSlice<T, NT, kS, V, kStrided>(s, n, dx + m * s.K,
                                                     slice.first, c, out);
          });
    };
    // 16-bit strided stream-major rows: each step also asks L2 for the
    // warp's span of the next step's rows, a lane a row. The element loads,
    // which hold a register each until they land, then wait for L2 rather
    // than HBM. Two or three steps ahead, fp32 rows and the stream-minor
    // block measured slower (docs/decisions.md) and keep the plain loop.
    if constexpr (NT == 4 && kStrided && sizeof(T) == 2) {
      if (!s.minor) {
        const int lane = slice.thread & 31;
        auto prefetch_step = [&](int64_t c_warp) {
          if (lane > 2 * NT || c_warp >= s.C) return;
          const T* row = lane < NT       ? g_row + lane * s.C
                         : lane < 2 * NT ? x_row + (lane - NT) * s.C
                                         : f_row;
          PrefetchSpanL2(row + c_warp, row + min(c_warp + 32 * V, s.C));
        };
        prefetch_step(FirstChannel<V, kStrided>(slice.thread) - lane);
        channel_steps([&](int64_t c, Loaded& l) {
          prefetch_step(c - lane + kGroup * V);
          load(c, l);
        });
      } else {
        channel_steps(load);
      }
    } else {
      channel_steps(load);
    }
  }
  GroupSum<kW>(acc, kGroup, red, total);
  const float* sums = total + slice.first / kS * kW;
  for (int t = slice.thread; t < kS * NT; t += kGroup) {
    const int i = slice.first + t / NT;
    const int j = t % NT;
    // dH_res is the gradient of H_res itself: transpose back for DEST_ROWS.
    if (i < n && j < n) {
      dh_res[m * n * n + (s.dest_rows ? j * n + i : i * n + j)] = sums[NT + t];
    }
  }
  if (first_group && slice.thread < n) {
    dh_post[m * n + slice.thread] = sums[slice.thread];
  }
}

// Per-chunk partial sums of df over the chunk's tokens in token order, in
// double: the per-token terms cancel, and an fp32 sum of 137 of them came out
// 1.1e-4 off (single channel, n = 8). The products of the fp32 / 16-bit
// inputs are exact in double, so only the partial's own rounding is left.
template <typename T>
__global__ void post_bias_partial_kernel(DevSpec s, int64_t tokens,
                                         const T* dx_next, const float* h_post,
                                         float* partial) {
  WaitForPrerequisiteGrid();  // dx_next and h_post
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= s.C) return;
  const int64_t chunk = blockIdx.x;
  const int64_t begin = chunk * kTokenChunk;
  const int64_t end = min(tokens, begin + kTokenChunk);
  double sum = 0.0;
  for (int64_t m = begin; m < end; ++m) {
    for (int j = 0; j < s.n; ++j) {
      sum =
          fma(static_cast<double>(h_post[m * s.n + j]),
              static_cast<double>(ToFloat(dx_next[m * s.K + XIndex(s, j, c)])),
              sum);
    }
  }
  partial[chunk * s.C + c] = static_cast<float>(sum);
}

// The bias the kernels read: none without has_post_bias.
const float* BiasOf(const LayerSpec& spec, const LayerWeights& weights) {
  return spec.has_post_bias ? weights.bias : nullptr;
}

}  // namespace

size_t PostBackwardWorkspace(const LayerSpec& spec, int64_t tokens) {
  if (!spec.has_post_bias) return 0;
  return AlignBytes(sizeof(float) * NumChunks(tokens) * spec.hidden);
}

PostPlan PlanOf(const PostForwardParams& p) {
  PostAlignment a;
  a.rows = LeastAlignment({p.f, p.x, p.x_next});
  a.bias = AddressAlignment(BiasOf(*p.spec, p.weights));
  return PlanPost(*p.spec, p.act_dtype, a);
}

PostPlan PlanOf(const PostBackwardParams& p) {
  PostAlignment a;
  a.rows = LeastAlignment({p.dx_next, p.f, p.x, p.df, p.dx});
  a.bias = AddressAlignment(BiasOf(*p.spec, p.weights));
  PostPlan plan = PlanPost(*p.spec, p.act_dtype, a);
  // Staged rows measured slower here than element loads, unlike in the
  // other row kernels (docs/decisions.md).
  plan.rows.staged = false;
  return plan;
}

absl::Status LaunchPostForward(const PostForwardParams& p,
                               cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*p.spec);
  const float* bias = BiasOf(*p.spec, p.weights);
  const PostPlan plan = PlanOf(p);
  if (plan.variant == PostVariant::kMma) {
    return LaunchPostForwardMma(p, stream);
  }
  const LaunchShape shape(*p.spec, p.tokens, p.act_dtype);
  cudaError_t err = cudaSuccess;
  const bool built = DispatchRows<RowKernel::kPost>(
      p.act_dtype, plan.rows, [&](auto tt, auto nt, auto vt, auto rt, auto st) {
        using T = typename decltype(tt)::type;
        err = LaunchAfterPrevious(
            post_forward_kernel<T, decltype(nt)::value, decltype(vt)::value,
                                decltype(rt)::value, decltype(st)::value>,
            dim3(GridSize(p.tokens)),
            dim3(kRowThreads * kPostForwardSlices<decltype(nt)::value>), 0,
            stream, s, static_cast<const T*>(p.f), static_cast<const T*>(p.x),
            p.h_post, p.h_res, bias, static_cast<T*>(p.x_next));
      });
  if (!built) return NoRowKernel("post forward", shape, plan.rows);
  MHC_CUDA_RETURN_IF_ERROR(err, "post forward", shape);
  MHC_CUDA_CHECK_LAUNCH("post forward", shape);
  return absl::OkStatus();
}

absl::Status LaunchPostBackward(const PostBackwardParams& p, Workspace ws,
                                cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*p.spec);
  const LaunchShape shape(*p.spec, p.tokens, p.act_dtype);
  const float* bias = BiasOf(*p.spec, p.weights);
  const PostPlan plan = PlanOf(p);
  cudaError_t err = cudaSuccess;
  if (plan.variant == PostVariant::kMma) {
    MHC_RETURN_IF_ERROR(LaunchPostBackwardMma(p, stream));
  } else {
    const bool built = DispatchRows<RowKernel::kPost>(
        p.act_dtype, plan.rows, [&](auto tt, auto nt, auto vt, auto rt, auto) {
          using T = typename decltype(tt)::type;
          err = LaunchAfterPrevious(
              post_backward_kernel<T, decltype(nt)::value, decltype(vt)::value,
                                   decltype(rt)::value>,
              dim3(GridSize(p.tokens)),
              dim3(
                  kPostBackwardGroup<decltype(nt)::value, decltype(rt)::value> *
                  kPostBackwardSlices<decltype(nt)::value>),
              0, stream, s, static_cast<const T*>(p.dx_next),
              static_cast<const T*>(p.f), static_cast<const T*>(p.x), p.h_post,
              p.h_res, bias, static_cast<T*>(p.df), static_cast<T*>(p.dx),
              p.dh_post, p.dh_res);
        });
    if (!built) return NoRowKernel("post backward", shape, plan.rows);
    MHC_CUDA_RETURN_IF_ERROR(err, "post backward", shape);
    MHC_CUDA_CHECK_LAUNCH("post backward", shape);
  }
  if (!s.has_bias || p.grads.bias == nullptr) return absl::OkStatus();
  if (ws.bytes < PostBackwardWorkspace(*p.spec, p.tokens)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda post backward ", ShapeText(shape), ": workspace too small"));
  }
  float* partial = static_cast<float*>(ws.data);
  const int64_t chunks = NumChunks(p.tokens);
  const dim3 grid(GridSize(chunks), GridSize((s.C + 127) / 128));
  DispatchDType(p.act_dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    err = LaunchAfterPrevious(
        post_bias_partial_kernel<T>, dim3(grid), dim3(128), 0, stream, s,
        p.tokens, static_cast<const T*>(p.dx_next), p.h_post, partial);
  });
  MHC_CUDA_RETURN_IF_ERROR(err, "post backward (bias partials)", shape);
  MHC_CUDA_CHECK_LAUNCH("post backward (bias partials)", shape);
  return LaunchChunkSum(partial, chunks, s.C, p.grads.bias, stream);
}

}  // namespace mhc::cuda
