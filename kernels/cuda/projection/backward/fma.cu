// The fma variant of the projection backward: per token, dx[m][k] = (the
// fused terms, when given) + sum_g dh[m][g] phi'[g][k] + dms[m] 2 v_k / K,
// a thread per k (or two), with sums over g in order; the dphi partials per
// chunk of kTokenChunk tokens, token order. No atomics.
#include "common.cuh"
#include "dispatch.cuh"
#include "projection/backward/fma.h"
#include "projection/backward/ms_term.cuh"

namespace mhc::cuda {
namespace {

constexpr int kDxThreads = 128;

struct DxDev {
  const float* phi;
  const float* gamma;
  const float* dh;
  const float* dms;
  const float* h_pre;
  const void* dy;
  const float* r;
  const void* dx_next;
  void* dx;
  float* dphi_partial;
};

template <typename T, int VK>
__global__ void __launch_bounds__(kDxThreads)
    dx_kernel(DevSpec s, int64_t tokens, const T* x, DxDev a) {
  WaitForPrerequisiteGrid();  // dh, dms and the terms' inputs
  constexpr int kGb = kRowsPerPass;
  const int64_t k0 =
      (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * VK;
  if (k0 >= s.K) return;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kTokenChunk;
  const int64_t end = min(tokens, begin + kTokenChunk);
  const int n = s.n;
  int stream[VK];
  int64_t chan[VK];
#pragma unroll
  for (int e = 0; e < VK; ++e) {
    const int64_t k = k0 + e;
    stream[e] = static_cast<int>(s.minor ? k % n : k / s.C);
    chan[e] = s.minor ? k / n : k % s.C;
  }
  const T* dy = static_cast<const T*>(a.dy);
  const T* dx_next = static_cast<const T*>(a.dx_next);
  T* dx = static_cast<T*>(a.dx);
  const bool proj = a.dh != nullptr;
  const bool small = s.N <= kGb;
  const float ms_scale = 2.0f / static_cast<float>(s.K);
  float ph[kGb][VK];
  float gm[VK];
#pragma unroll
  for (int v = 0; v < VK; ++v) gm[v] = 1.0f;
  if (proj && s.has_gamma) LoadVec<float, VK>(a.gamma + k0, gm);
  if (proj && small) {
#pragma unroll
    for (int g = 0; g < kGb; ++g) {
      if (g >= s.N) break;
      LoadVec<float, VK>(a.phi + g * s.K + k0, ph[g]);
#pragma unroll
      for (int v = 0; v < VK; ++v) ph[g][v] *= gm[v];
    }
  }
  float acc[kGb][VK];
#pragma unroll
  for (int g = 0; g < kGb; ++g) {
#pragma unroll
    for (int v = 0; v < VK; ++v) acc[g][v] = 0.0f;
  }
  for (int64_t m = begin; m < end; ++m) {
    float v[VK];
    float out[VK];
#pragma unroll
    for (int e = 0; e < VK; ++e) out[e] = 0.0f;
    if (a.h_pre != nullptr) {
#pragma unroll
      for (int e = 0; e < VK; ++e) {
        out[e] = a.h_pre[m * n + stream[e]] * ToFloat(dy[m * s.C + chan[e]]);
      }
    }
    if (a.r != nullptr) {
#pragma unroll
      for (int e = 0; e < VK; ++e) {
        const float* r_row = a.r + (m * n + stream[e]) * n;
        const T* g_row = dx_next + m * s.K;
        float t = out[e];
        for (int j = 0; j < n; ++j) {
          t = fmaf(r_row[j], ToFloat(g_row[XIndex(s, j, chan[e])]), t);
        }
        out[e] = t;
      }
    }
    if (proj) {
      LoadVec<T, VK>(x + m * s.K + k0, v);
      const float* dh_row = a.dh + m * s.N;
      float sp[VK];
#pragma unroll
      for (int e = 0; e < VK; ++e) sp[e] = 0.0f;
      if (small) {
#pragma unroll
        for (int g = 0; g < kGb; ++g) {
          if (g >= s.N) break;
          const float d = dh_row[g];
#pragma unroll
          for (int e = 0; e < VK; ++e) {
            sp[e] = fmaf(d, ph[g][e], sp[e]);
            acc[g][e] = fmaf(d, v[e], acc[g][e]);
          }
        }
      } else {
        for (int g = 0; g < s.N; ++g) {
          const float d = dh_row[g];
          float p[VK];
          LoadVec<float, VK>(a.phi + g * s.K + k0, p);
#pragma unroll
          for (int e = 0; e < VK; ++e) sp[e] = fmaf(d, p[e] * gm[e], sp[e]);
        }
      }
      MsTermOf(a.dms[m], ms_scale).With([&](auto add) {
#pragma unroll
        for (int e = 0; e < VK; ++e) out[e] += add(v[e], sp[e]);
      });
    }
    StoreVec<T, VK>(dx + m * s.K + k0, out);
  }
  if (!proj || a.dphi_partial == nullptr) return;
  float* partial = a.dphi_partial + blockIdx.x * s.N * s.K;
  if (small) {
#pragma unroll
    for (int g = 0; g < kGb; ++g) {
      if (g >= s.N) break;
#pragma unroll
      for (int e = 0; e < VK; ++e) partial[g * s.K + k0 + e] = acc[g][e];
    }
    return;
  }
  for (int g0 = 0; g0 < s.N; g0 += kGb) {
#pragma unroll
    for (int g = 0; g < kGb; ++g) {
#pragma unroll
      for (int e = 0; e < VK; ++e) acc[g][e] = 0.0f;
    }
    for (int64_t m = begin; m < end; ++m) {
      float v[VK];
      LoadVec<T, VK>(x + m * s.K + k0, v);
      const float* dh_row = a.dh + m * s.N;
#pragma unroll
      for (int g = 0; g < kGb; ++g) {
        if (g0 + g >= s.N) break;
        const float d = dh_row[g0 + g];
#pragma unroll
        for (int e = 0; e < VK; ++e) acc[g][e] = fmaf(d, v[e], acc[g][e]);
      }
    }
#pragma unroll
    for (int g = 0; g < kGb; ++g) {
      if (g0 + g >= s.N) break;
#pragma unroll
      for (int e = 0; e < VK; ++e) {
        partial[(g0 + g) * s.K + k0 + e] = acc[g][e];
      }
    }
  }
}

}  // namespace

absl::Status LaunchFmaDxAndPhiPartials(const DxArgs& a,
                                       const ProjectionBackwardPlan& plan,
                                       cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*a.spec);
  const bool vk2 = plan.fma_vector == 2;
  const int vk = vk2 ? 2 : 1;
  const int64_t per_block = static_cast<int64_t>(kDxThreads) * vk;
  const dim3 grid(GridSize(NumChunks(a.tokens)),
                  GridSize((s.K + per_block - 1) / per_block));
  DxDev d{a.phi,   s.has_gamma ? a.gamma : nullptr,
          a.dh,    a.dms,
          a.h_pre, a.dy,
          a.r,     a.dx_next,
          a.dx,    a.dphi_partial};
  cudaError_t err = cudaSuccess;
  DispatchDType(a.act_dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    const T* x = static_cast<const T*>(a.x);
    err = vk2 ? LaunchAfterPrevious(dx_kernel<T, 2>, grid, dim3(kDxThreads), 0,
                                    stream, s, a.tokens, x, d)
              : LaunchAfterPrevious(dx_kernel<T, 1>, grid, dim3(kDxThreads), 0,
                                    stream, s, a.tokens, x, d);
  });
  MHC_CUDA_RETURN_IF_ERROR(err, "projection backward fma",
                           LaunchShape(*a.spec, a.tokens, a.act_dtype));
  MHC_CUDA_CHECK_LAUNCH("projection backward fma",
                        LaunchShape(*a.spec, a.tokens, a.act_dtype));
  return absl::OkStatus();
}

}  // namespace mhc::cuda
