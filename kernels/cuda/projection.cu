// Projection h = phi' v with the sum of squares, and its backward (dx and
// the phi / gamma gradients); also the dx kernel the fused backward ops
// reuse. Determinism / batch invariance: the forward reduces each token over
// k in an order fixed by K and N (tensor-core units over a K split, added in
// chunk order, proj_mma.cuh); the backward
// computes dx per element with sums over g in order; phi / gamma gradients
// are partial sums over fixed chunks of kTokenChunk tokens (token order) in
// workspace, added over chunks in order by a second kernel. No floating-point
// atomics (an integer counter hands out the forward's units).
#include "common.cuh"
#include "dispatch.cuh"
#include "launch.h"
#include "overflow_repair.cuh"
#include "overflow_repair.h"
#include "proj_mma.cuh"
#include "projection_backward_rows.h"
#include "projection_backward_wgmma.h"
#include "projection_backward_wide.h"
#include "projection_forward_bf16.h"
#include "projection_forward_wide.h"

namespace mhc::cuda {
namespace {

constexpr int kDxThreads = 128;

// Persistent CTAs over the units (tile, K chunk of PlanChunks, group of
// kLogitGroup phi rows; the groups of one tile and chunk run side by side,
// so x comes from HBM once and from L2 for the other groups), each unit's
// partials to its PartialOffset columns; group 0 also writes the sum of
// squares. With more units than CTAs, each CTA takes its next unit from
// next_unit when it finishes one: unit times vary with HBM traffic, and a
// fixed stride left the last wave waiting on the slowest CTAs. x is copied
// kXBytes at a time (MmaCopyBytes), fixed per kernel so that the copy
// addresses are set once per unit.
template <typename T, bool kIeee, int kXBytes>
__global__ void __launch_bounds__(kMmaThreads, sizeof(T) == 4 ? 1 : 2)
    projection_partials_kernel(DevSpec s, int64_t tokens, const T* x,
                               const float* phi, const float* gamma,
                               const uint32_t* phi_split, float* partial,
                               bool vec_phi, unsigned long long* next_unit) {
  extern __shared__ __align__(16) char mma_smem[];
  const ChunkPlan plan = PlanChunks(s.K, s.N);
  const int groups = LogitGroups(s.N);
  const int64_t units = MmaTiles(tokens) * plan.chunks * groups;
  const int width = s.N + 1;
  ForEachUnit(units, groups, plan.chunks, next_unit, [&](MmaUnit unit) {
    const auto [tile, chunk, group] = unit;
    const int64_t m0 = tile * kMmaTokens;
    const int64_t kbeg = chunk * plan.chunk;
    const int row0 = group * kLogitGroup;
    DevSpec sg = s;
    sg.N = min(kLogitGroup, s.N - row0);
    const float* part = ProjectUnit<T, kIeee, kXBytes>(
        sg, x, phi + row0 * s.K, gamma, phi_split, tokens, m0, kbeg,
        min(s.K, kbeg + plan.chunk), vec_phi, mma_smem);
    float* out =
        partial + PartialOffset(tokens, plan.chunks, width, tile, chunk) + row0;
    const int rows = static_cast<int>(min(int64_t{kMmaTokens}, tokens - m0));
    const int cols = sg.N + (group == 0 ? 1 : 0);
    for (int idx = threadIdx.x; idx < rows * cols; idx += kMmaThreads) {
      const int t = idx / cols;
      const int col = idx % cols;
      if (col < sg.N) {
        out[t * width + col] = part[t * kPartRow + col];
      } else {
        out[t * width + s.N] = part[t * kPartRow + kMmaCols];
      }
    }
    __syncthreads();
  });
}

// phi' (times gamma) split into bf16 terms for every kMmaBk stage of K, in
// the blocks ProjectUnit copies: a CTA per stage, the same per-thread values
// and arithmetic as the in-tile split, so both give the same bits.
__global__ void __launch_bounds__(kMmaThreads)
    phi_split_kernel(DevSpec s, const float* phi, const float* gamma, bool ieee,
                     bool vec, uint32_t* out) {
  const int prow = threadIdx.x >> 3;
  const int pk = (threadIdx.x & 7) * 8;
  float pv[8];
  FetchPhiChunk(s, phi, gamma, prow,
                static_cast<int64_t>(blockIdx.x) * kMmaBk + pk, s.K, vec, pv);
  Bf16TileMath::StorePhi(pv, prow, pk, ieee,
                         out + blockIdx.x * int64_t{Bf16SplitWords(ieee)});
}

__global__ void projection_finish_kernel(DevSpec s, int64_t tokens,
                                         const float* partial, float* h,
                                         float* mean_square) {
  WaitForPrerequisiteGrid();  // the units' partials
  const int chunks = PlanChunks(s.K, s.N).chunks;
  const int width = s.N + 1;
  const int64_t idx =
      static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= tokens * width) return;
  const int64_t m = idx / width;
  const int col = static_cast<int>(idx % width);
  const float sum =
      SumChunks(ChunksOf(partial, tokens, chunks, width, m), chunks, col);
  if (col < s.N) {
    h[m * s.N + col] = sum;
  } else {
    mean_square[m] = sum / static_cast<float>(s.K);
  }
}

// The projection op's overflow repair (overflow_repair.cuh): a token whose
// mean square exceeds kRepairMeanSquare or is not finite, or whose h is not
// finite, gets its float64 values rounded to fp32, as the fused ops keep
// them; the fp32 sum of squares overflows before the division by K where
// the mean square itself still fits. A thread per token; the others return
// after the check. Only the single op runs it: the fused ops repair in
// their mixing kernels.
constexpr int kRepairCheckThreads = 128;
__global__ void __launch_bounds__(kRepairCheckThreads)
    projection_repair_kernel(DevSpec s, int64_t tokens, RepairSource src,
                             float* h, float* mean_square) {
  const int64_t m =
      static_cast<int64_t>(blockIdx.x) * kRepairCheckThreads + threadIdx.x;
  if (m >= tokens) return;
  float* row = h + m * s.N;
  if (!NeedsRepair(s, row, mean_square[m])) return;
  float ms_s = 0.0f;
  // In place: the scaled values, then unscaled element by element.
  const int flag = RepairProjection(s, src, m, row, &ms_s);
  if (flag == 0) return;  // x is not finite: the fp32 values carry it
  StoreUnscaled(s, flag - kRepairFlagBias, row, ms_s, row, mean_square + m);
}

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
      const float dm = a.dms[m] * ms_scale;
#pragma unroll
      for (int e = 0; e < VK; ++e) out[e] += fmaf(dm, v[e], sp[e]);
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

// A block per kReduceCols consecutive k: lane group j (of kReduceRows) takes
// rows g = j, j + kReduceRows, ... for its column, adds the chunk partials
// in chunk order, and dgamma adds the groups' row sums in group order (an
// order fixed by N alone). Spreading g over the block keeps enough loads in
// flight: a thread per k alone was latency bound (docs/decisions.md).
constexpr int kReduceCols = 32;
constexpr int kReduceRows = 8;
constexpr int kReduceGroup = 8;
__global__ void __launch_bounds__(kReduceCols* kReduceRows)
    phi_grad_reduce_kernel(DevSpec s, int64_t chunks, const float* partial,
                           const float* phi, const float* gamma,
                           float* grads_phi, float* grads_gamma) {
  __shared__ float dgamma_rows[kReduceRows][kReduceCols];
  const int col = threadIdx.x % kReduceCols;
  const int row = threadIdx.x / kReduceCols;
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kReduceCols + col;
  const int64_t plane = static_cast<int64_t>(s.N) * s.K;
  float dgamma = 0.0f;
  if (k < s.K) {
    for (int g = row; g < s.N; g += kReduceRows) {
      // phi and the gradient load beside the chunk partials, not after.
      const float phi_gk = phi[g * s.K + k];
      const float grad_gk =
          grads_phi != nullptr ? grads_phi[g * s.K + k] : 0.0f;
      const float sum =
          OrderedSum<kReduceGroup>(partial + g * s.K + k, plane, chunks);
      if (grads_phi != nullptr) {
        grads_phi[g * s.K + k] = grad_gk + (s.has_gamma ? sum * gamma[k] : sum);
      }
      dgamma = fmaf(sum, phi_gk, dgamma);
    }
  }
  dgamma_rows[row][col] = dgamma;
  __syncthreads();
  if (row != 0 || k >= s.K || grads_gamma == nullptr) return;
  float total = 0.0f;
  for (int j = 0; j < kReduceRows; ++j) total += dgamma_rows[j][col];
  grads_gamma[k] += total;
}

size_t PhiPartialBytes(const LayerSpec& spec, int64_t tokens) {
  return AlignBytes(sizeof(float) * NumPhiChunks(spec, tokens) *
                    spec.NumLogits() * spec.K());
}

}  // namespace

// The dphi chunk partials, then the wide kernels' scratch.
size_t ProjectionBackwardWorkspace(const LayerSpec& spec, int64_t tokens,
                                   DType dtype) {
  return PhiPartialBytes(spec, tokens) +
         WideDxScratchBytes(spec, tokens, dtype, /*terms=*/false);
}

namespace {

size_t PartialBytes(const LayerSpec& spec, int64_t tokens) {
  return AlignBytes(sizeof(float) * tokens *
                    PlanChunks(spec.K(), spec.NumLogits()).chunks *
                    (spec.NumLogits() + 1));
}

// bf16 layers split phi' once per launch when the split (96 B per k, 144
// under IEEE) costs at most 2.5 % of the x bytes (M >= 1920 / 2880 tokens);
// smaller batches split it per tile.
size_t PhiSplitBytes(const LayerSpec& spec, int64_t tokens, DType dtype) {
  if (dtype != DType::kBF16 || LogitGroups(spec.NumLogits()) > 1) return 0;
  const int64_t K = spec.K();
  const bool ieee = spec.matmul_precision == MatmulPrecision::kIeee;
  const size_t bytes = AlignBytes(sizeof(uint32_t) * Bf16SplitWords(ieee) *
                                  ((K + kMmaBk - 1) / kMmaBk));
  const size_t x_bytes = static_cast<size_t>(tokens) * K * 2;
  return bytes * 40 <= x_bytes ? bytes : 0;
}

}  // namespace

size_t MmaProjectionWorkspace(const LayerSpec& spec, int64_t tokens,
                              DType dtype) {
  if (!spec.dynamic) return 0;
  return PartialBytes(spec, tokens) + PhiSplitBytes(spec, tokens, dtype) +
         kUnitCounterBytes;
}

size_t ProjectionForwardWorkspace(const LayerSpec& spec, int64_t tokens,
                                  DType dtype) {
  return MmaProjectionWorkspace(spec, tokens, dtype);
}

absl::Status LaunchProjectionPartials(const LayerSpec& spec, int64_t tokens,
                                      DType dtype, const void* x,
                                      const float* phi, const float* gamma,
                                      void* workspace, cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(spec);
  if (!s.has_gamma) gamma = nullptr;
  const bool ieee = spec.matmul_precision == MatmulPrecision::kIeee;
  float* partial = static_cast<float*>(workspace);
  if (UseBf16WgmmaProjection(spec, dtype, x)) {
    char* after_partials =
        static_cast<char*>(workspace) + PartialBytes(spec, tokens);
    const size_t split_bytes = PhiSplitBytes(spec, tokens, dtype);
    return LaunchBf16WgmmaProjectionPartials(
        spec, tokens, x, phi, gamma, split_bytes > 0 ? after_partials : nullptr,
        partial,
        reinterpret_cast<unsigned long long*>(after_partials + split_bytes),
        stream);
  }
  const bool vec_phi = PhiVectorLoads(s.K, phi, gamma);
  uint32_t* phi_split = nullptr;
  if (PhiSplitBytes(spec, tokens, dtype) > 0) {
    phi_split = reinterpret_cast<uint32_t*>(static_cast<char*>(workspace) +
                                            PartialBytes(spec, tokens));
    phi_split_kernel<<<GridSize((s.K + kMmaBk - 1) / kMmaBk), kMmaThreads, 0,
                       stream>>>(s, phi, gamma, ieee, vec_phi, phi_split);
    MHC_CUDA_CHECK_LAUNCH("projection forward (phi split)",
                          ShapeString(spec, tokens, dtype));
  }
  auto* next_unit = reinterpret_cast<unsigned long long*>(
      static_cast<char*>(workspace) + PartialBytes(spec, tokens) +
      PhiSplitBytes(spec, tokens, dtype));
  if (UseBf16WideProjection(spec, dtype, x, phi, gamma)) {
    return LaunchBf16WideProjectionPartials(spec, tokens, x, phi, gamma,
                                            partial, next_unit, stream);
  }
  if (UseWideProjection(spec)) {
    return LaunchWideProjectionPartials(spec, tokens, dtype, x, phi, gamma,
                                        partial, next_unit, stream);
  }
  const int64_t units =
      MmaTiles(tokens) * PlanChunks(s.K, s.N).chunks * LogitGroups(s.N);
  cudaError_t err = cudaSuccess;
  DispatchDType(dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    auto launch = [&](auto kernel) {
      err = LaunchPersistent(kernel, units, MmaSmemBytes<T>(), next_unit,
                             stream, s, tokens, static_cast<const T*>(x), phi,
                             gamma, static_cast<const uint32_t*>(phi_split),
                             partial, vec_phi);
    };
    auto for_width = [&](auto ieee) {
      constexpr bool kIeee = decltype(ieee)::value;
      switch (MmaCopyBytes<T>(s.K, x)) {
        case 16:
          return launch(projection_partials_kernel<T, kIeee, 16>);
        case 8:
          return launch(projection_partials_kernel<T, kIeee, 8>);
        case 4:
          return launch(projection_partials_kernel<T, kIeee, 4>);
        default:
          return launch(projection_partials_kernel<T, kIeee, 0>);
      }
    };
    if (ieee) {
      for_width(std::true_type{});
    } else {
      for_width(std::false_type{});
    }
  });
  MHC_CUDA_RETURN_IF_ERROR(err, "projection forward (mma)",
                           ShapeString(spec, tokens, dtype));
  MHC_CUDA_CHECK_LAUNCH("projection forward (mma)",
                        ShapeString(spec, tokens, dtype));
  return absl::OkStatus();
}

absl::Status LaunchMmaProjection(const LayerSpec& spec, int64_t tokens,
                                 DType dtype, const void* x, const float* phi,
                                 const float* gamma, void* workspace, float* h,
                                 float* mean_square, cudaStream_t stream) {
  MHC_RETURN_IF_ERROR(LaunchProjectionPartials(spec, tokens, dtype, x, phi,
                                               gamma, workspace, stream));
  const float* partial = static_cast<const float*>(workspace);
  const DevSpec s = MakeDevSpec(spec);
  const int64_t elements = tokens * (s.N + 1);
  // Its CTAs start as the units' CTAs finish.
  MHC_CUDA_RETURN_IF_ERROR(
      LaunchAfterPrevious(projection_finish_kernel,
                          dim3(GridSize((elements + 255) / 256)), dim3(256), 0,
                          stream, s, tokens, partial, h, mean_square),
      "projection forward (chunk sum)", ShapeString(spec, tokens, dtype));
  MHC_CUDA_CHECK_LAUNCH("projection forward (chunk sum)",
                        ShapeString(spec, tokens, dtype));
  return absl::OkStatus();
}

// The op is defined for dynamic layers only (the Backend checks it).
absl::Status LaunchProjectionForward(const ProjectionForwardParams& p,
                                     Workspace ws, cudaStream_t stream) {
  if (ws.bytes < MmaProjectionWorkspace(*p.spec, p.tokens, p.act_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda projection forward ", ShapeString(*p.spec, p.tokens, p.act_dtype),
        ": workspace too small"));
  }
  const float* gamma = p.spec->has_gamma ? p.weights.gamma : nullptr;
  MHC_RETURN_IF_ERROR(LaunchMmaProjection(*p.spec, p.tokens, p.act_dtype, p.x,
                                          p.weights.phi, p.weights.gamma,
                                          ws.data, p.h, p.mean_square, stream));
  const DevSpec s = MakeDevSpec(*p.spec);
  projection_repair_kernel<<<GridSize((p.tokens + kRepairCheckThreads - 1) /
                                      kRepairCheckThreads),
                             kRepairCheckThreads, 0, stream>>>(
      s, p.tokens, RepairSource{p.x, p.act_dtype, p.weights.phi, gamma}, p.h,
      p.mean_square);
  MHC_CUDA_CHECK_LAUNCH("projection forward (overflow repair)",
                        ShapeString(*p.spec, p.tokens, p.act_dtype));
  return absl::OkStatus();
}

absl::Status LaunchDxAndPhiPartials(const DxArgs& a, cudaStream_t stream) {
  if (UseRowsWgmmaDx(a)) {
    return LaunchRowsWgmmaDxAndPhiPartials(a, stream);
  }
  if (UseWgmmaDx(a)) {
    return LaunchWgmmaDxAndPhiPartials(a, stream);
  }
  if (UseMmaDx(a)) {
    return LaunchMmaDxAndPhiPartials(a, stream);
  }
  if (UseWideDx(a)) {
    return LaunchWideDxAndPhiPartials(a, stream);
  }
  const DevSpec s = MakeDevSpec(*a.spec);
  const bool vk2 = s.K % 2 == 0 && Aligned16(a.x) && Aligned16(a.dx) &&
                   (a.phi == nullptr || Aligned16(a.phi)) &&
                   (a.gamma == nullptr || Aligned16(a.gamma));
  const int vk = vk2 ? 2 : 1;
  const int64_t per_block = static_cast<int64_t>(kDxThreads) * vk;
  const dim3 grid(GridSize(NumChunks(a.tokens)),
                  GridSize((s.K + per_block - 1) / per_block));
  DxDev d{a.phi,   s.has_gamma ? a.gamma : nullptr,
          a.dh,    a.dms,
          a.h_pre, a.dy,
          a.r,     a.dx_next,
          a.dx,    a.dphi_partial};
  DispatchDType(a.act_dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    const T* x = static_cast<const T*>(a.x);
    if (vk2) {
      dx_kernel<T, 2><<<grid, kDxThreads, 0, stream>>>(s, a.tokens, x, d);
    } else {
      dx_kernel<T, 1><<<grid, kDxThreads, 0, stream>>>(s, a.tokens, x, d);
    }
  });
  MHC_CUDA_CHECK_LAUNCH("dx", ShapeString(*a.spec, a.tokens, a.act_dtype));
  return absl::OkStatus();
}

absl::Status LaunchPhiGradReduce(const LayerSpec& spec, int64_t tokens,
                                 const float* partial, const float* phi,
                                 const float* gamma, float* grads_phi,
                                 float* grads_gamma, cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(spec);
  if (!s.has_gamma) grads_gamma = nullptr;
  if (grads_phi == nullptr && grads_gamma == nullptr) return absl::OkStatus();
  phi_grad_reduce_kernel<<<GridSize((s.K + kReduceCols - 1) / kReduceCols),
                           kReduceCols * kReduceRows, 0, stream>>>(
      s, NumPhiChunks(spec, tokens), partial, phi,
      s.has_gamma ? gamma : nullptr, grads_phi, grads_gamma);
  MHC_CUDA_CHECK_LAUNCH("phi gradient reduce",
                        ShapeString(spec, tokens, DType::kF32));
  return absl::OkStatus();
}

absl::Status LaunchProjectionBackward(const ProjectionBackwardParams& p,
                                      Workspace ws, cudaStream_t stream) {
  const std::string shape = ShapeString(*p.spec, p.tokens, p.act_dtype);
  const bool want_grads =
      p.grads.phi != nullptr || (p.spec->has_gamma && p.grads.gamma != nullptr);
  const size_t scratch =
      WideDxScratchBytes(*p.spec, p.tokens, p.act_dtype, /*terms=*/false);
  const size_t partial_bytes = PhiPartialBytes(*p.spec, p.tokens);
  if ((want_grads || scratch > 0) && ws.bytes < partial_bytes + scratch) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda projection backward ", shape, ": workspace too small"));
  }
  DxArgs a;
  a.spec = p.spec;
  a.tokens = p.tokens;
  a.act_dtype = p.act_dtype;
  a.x = p.x;
  a.phi = p.weights.phi;
  a.gamma = p.weights.gamma;
  a.dh = p.dh;
  a.dms = p.dmean_square;
  a.dx = p.dx;
  a.dphi_partial = want_grads ? static_cast<float*>(ws.data) : nullptr;
  a.wide_scratch =
      scratch > 0 ? static_cast<char*>(ws.data) + partial_bytes : nullptr;
  MHC_RETURN_IF_ERROR(LaunchDxAndPhiPartials(a, stream));
  if (!want_grads) return absl::OkStatus();
  return LaunchPhiGradReduce(*p.spec, p.tokens, a.dphi_partial, p.weights.phi,
                             p.weights.gamma, p.grads.phi, p.grads.gamma,
                             stream);
}

}  // namespace mhc::cuda
