// The projection forward of wide layers (n >= 7) on warpgroup mmas, for
// TF32 precision. projection_forward_wide.cu's mma.sync tiles spend more
// issue slots on fragment loads, x unpacking and addressing than on mmas
// (tensor pipe ~38 % busy at n = 16); here each warpgroup issues one
// wgmma per 8 k for 64 tokens x kW logits, its B operand (phi') read by
// the tensor cores straight from the swizzled stage (wgmma.cuh) and its A
// operand (x, converted to tf32) loaded once per k for all kW logits.
//
// Unit: 128 tokens x kW logits over one K chunk, 64 tokens per warpgroup;
// same chunks, tiles and partial layout as proj_mma.cuh, so the chunk sum and
// the fused pre forward's mixing read the partials unchanged. Per stage of
// kWideStageK k: x and raw phi by cp.async, then phi' = phi * gamma (one
// rounded multiply, as the SPEC defines it) rounded to tf32 in place and the
// sum of squares from the staged x while the previous stage's wgmmas run.
//
// Determinism / batch invariance: a token's h and sum of squares depend on
// its x row, phi', K and N only (wgmma rows are independent dot products; the
// order over k is fixed by the chunk and stage layout); chunks are added in
// order by projection_finish_kernel. No floating-point atomics.
#include <cstdint>

#include "common.cuh"
#include "dispatch.cuh"
#include "proj_mma.cuh"
#include "projection_forward_wgmma.h"
#include "wgmma.cuh"
#include "wide_stage.cuh"

namespace mhc::cuda {
namespace {

constexpr int kStageK = kWideStageK;
constexpr int kStages = 4;

constexpr int RoundUp(int v, int to) { return (v + to - 1) / to * to; }

// One stage: the phi rows (wgmma B layout, 1024-aligned), the x rows
// (StagedIndex), gamma.
template <typename T, int kW>
struct WgmmaPlan {
  static_assert(kW % 8 == 0, "B rows in whole swizzle atoms");
  static constexpr int kPhiBytes = kW * kStageK * 4;
  static constexpr int kXBytes = kMmaTokens * kStageK * sizeof(T);
  static constexpr int kBytes =
      RoundUp(kPhiBytes + kXBytes + kStageK * 4, kSwizzleAtomBytes);
  // The dynamic shared memory's start is aligned up to an atom in-kernel.
  static constexpr int kSmem = kStages * kBytes + kSwizzleAtomBytes;
};

// The tf32 bits of an x element: 16-bit values exactly, fp32 rounded.
template <typename T>
__device__ __forceinline__ uint32_t XTf32(const T* p) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    return static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16;
  } else if constexpr (std::is_same<T, __half>::value) {
    return __float_as_uint(__half2float(*p));
  } else {
    return __float_as_uint(RoundTf32Bits(*p));
  }
}

template <typename T, int kW>
__global__ void __launch_bounds__(kMmaThreads, 2)
    wgmma_projection_kernel(DevSpec s, int64_t tokens, const T* __restrict__ x,
                            const float* __restrict__ phi,
                            const float* __restrict__ gamma, float* partial,
                            unsigned long long* next_unit) {
  using Plan = WgmmaPlan<T, kW>;
  constexpr int kXPer = 16 / static_cast<int>(sizeof(T));  // x per chunk
  constexpr int kXChunks = kStageK / kXPer;
  constexpr int kXStep = kMmaThreads / kXChunks;
  constexpr int kXCopies = kMmaTokens / kXStep;
  constexpr int kPChunks = kStageK / 4;  // 16-byte chunks per phi row
  constexpr int kPStep = kMmaThreads / kPChunks;
  constexpr int kPCopies = (kW + kPStep - 1) / kPStep;
  static_assert(kXStep % 4 == 0 && kPStep % 8 == 0,
                "copy rows keep their swizzle");
  extern __shared__ __align__(16) char wgmma_fwd_smem[];
  const uint32_t base =
      static_cast<uint32_t>(__cvta_generic_to_shared(wgmma_fwd_smem));
  char* smem =
      wgmma_fwd_smem +
      ((kSwizzleAtomBytes - base % kSwizzleAtomBytes) % kSwizzleAtomBytes);
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int grp = lane >> 2;
  const int quad = lane & 3;
  const int wg = warp >> 2;  // warpgroup: 64-token half of the tile
  const int wq = warp & 3;   // its 16 rows
  const ChunkPlan plan = PlanChunks(s.K, s.N);
  const int groups = (s.N + kW - 1) / kW;
  const int64_t units = MmaTiles(tokens) * plan.chunks * groups;
  const int width = s.N + 1;

  auto phi_stage = [&](int buf) {
    return reinterpret_cast<float*>(smem + buf * Plan::kBytes);
  };
  auto x_stage = [&](int buf) {
    return reinterpret_cast<T*>(smem + buf * Plan::kBytes + Plan::kPhiBytes);
  };
  auto gamma_stage = [&](int buf) {
    return reinterpret_cast<float*>(smem + buf * Plan::kBytes +
                                    Plan::kPhiBytes + Plan::kXBytes);
  };

  // The copy plan: x chunk xj of rows xr + i kXStep, phi chunk pj of rows
  // pr + i kPStep; their places in a stage differ only by row offsets.
  const int xr = tid / kXChunks, xj = tid % kXChunks;
  const int pr = tid / kPChunks, pj = tid % kPChunks;
  const int x_dst = StagedIndex<T>(xr, xj * kXPer);
  const int phi_dst = SwizzledB(pr, pj * 4);
  const int64_t x_step = int64_t{kXStep} * s.K, phi_step = kPStep * s.K;

  ForEachUnit(units, groups, plan.chunks, next_unit, [&](MmaUnit unit) {
    const auto [tile, chunk, group] = unit;
    const int64_t m0 = tile * kMmaTokens;
    const int64_t kbeg = chunk * plan.chunk;
    const int64_t kend = min(s.K, kbeg + plan.chunk);
    const int g0 = group * kW;
    const int rows =
        static_cast<int>(min(static_cast<int64_t>(kMmaTokens), tokens - m0));
    const int logits = min(kW, s.N - g0);
    const int stages = static_cast<int>((kend - kbeg + kStageK - 1) / kStageK);

    const T* x_src = x + (m0 + xr) * s.K + kbeg + xj * kXPer;
    const float* phi_src = phi + (g0 + pr) * s.K + kbeg + pj * 4;
    unsigned x_rows = 0, phi_rows = 0;
#pragma unroll
    for (int i = 0; i < kXCopies; ++i) {
      if (xr + i * kXStep < rows) x_rows |= 1u << i;
    }
#pragma unroll
    for (int i = 0; i < kPCopies; ++i) {
      if (pr + i * kPStep < logits) phi_rows |= 1u << i;
    }
    auto load = [&](int st) {
      if (st >= stages) return;
      const int buf = st % kStages;
      const int kst = st * kStageK;
      T* xs = x_stage(buf);
      float* ps = phi_stage(buf);
      const bool x_k = kbeg + kst + xj * kXPer < kend;
#pragma unroll
      for (int i = 0; i < kXCopies; ++i) {
        const bool ok = x_k && ((x_rows >> i) & 1u);
        CpAsync<16>(xs + x_dst + i * kXStep * kStageK,
                    ok ? x_src + kst + i * x_step : x, ok);
      }
      const bool phi_k = kbeg + kst + pj * 4 < kend;
#pragma unroll
      for (int i = 0; i < kPCopies; ++i) {
        if (pr + i * kPStep >= kW) break;  // past the tile: nothing staged
        const bool ok = phi_k && ((phi_rows >> i) & 1u);
        CpAsync<16>(ps + phi_dst + i * kPStep * kStageK,
                    ok ? phi_src + kst + i * phi_step : phi, ok);
      }
      if (gamma != nullptr && tid < kPChunks) {
        const int64_t k = kbeg + kst + tid * 4;
        CpAsync<16>(gamma_stage(buf) + tid * 4, k < kend ? gamma + k : gamma,
                    k < kend);
      }
    };

    // The sum of squares: 16 k of row tid / 2 (half tid % 2 of the stage)
    // per thread, a fresh sum per stage added to the running one. phi'
    // rounded in place: the chunks this thread copied.
    float ss_run = 0.0f;
    auto prepare = [&](int st) {
      if (st >= stages) return;
      const int buf = st % kStages;
      const T* xs = x_stage(buf);
      float fresh = 0.0f;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float v[4];
        LoadX4(xs + StagedIndex<T>(tid >> 1, 16 * (tid & 1) + 4 * q), v);
#pragma unroll
        for (int e = 0; e < 4; ++e) fresh = fmaf(v[e], v[e], fresh);
      }
      ss_run += fresh;
      float4* at = reinterpret_cast<float4*>(phi_stage(buf) + phi_dst);
      const float4 g =
          gamma != nullptr
              ? *reinterpret_cast<const float4*>(gamma_stage(buf) + pj * 4)
              : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
#pragma unroll
      for (int i = 0; i < kPCopies; ++i) {
        if (pr + i * kPStep >= kW) break;
        const float4 p = at[i * kPStep * kStageK / 4];
        at[i * kPStep * kStageK / 4] =
            make_float4(RoundTf32Bits(__fmul_rn(p.x, g.x)),
                        RoundTf32Bits(__fmul_rn(p.y, g.y)),
                        RoundTf32Bits(__fmul_rn(p.z, g.z)),
                        RoundTf32Bits(__fmul_rn(p.w, g.w)));
      }
    };

    float acc[kW / 2];
#pragma unroll
    for (int i = 0; i < kW / 2; ++i) acc[i] = 0.0f;

    // A fragments of all four k steps first (they must stay untouched until
    // the wgmmas complete), then the wgmmas, committed as one group.
    auto compute = [&](int st) {
      const int buf = st % kStages;
      const T* xs = x_stage(buf);
      uint32_t a[kStageK / 8][4];
      const int row = 64 * wg + 16 * wq + grp;
#pragma unroll
      for (int j = 0; j < kStageK / 8; ++j) {
        const int k = 8 * j + quad;
        a[j][0] = XTf32(xs + StagedIndex<T>(row, k));
        a[j][1] = XTf32(xs + StagedIndex<T>(row + 8, k));
        a[j][2] = XTf32(xs + StagedIndex<T>(row, k + 4));
        a[j][3] = XTf32(xs + StagedIndex<T>(row + 8, k + 4));
      }
      WgmmaFence();
      const float* ps = phi_stage(buf);
#pragma unroll
      for (int j = 0; j < kStageK / 8; ++j) {
        WgmmaTf32<kW>(acc, a[j], SwizzledBDescriptor(ps, 32 * j));
      }
      WgmmaCommit();
    };

    // Stage st + 1 is prepared while st's wgmmas run; the barrier after
    // the copies' wait also orders every thread's wait for st - 1's wgmmas
    // before its buffer is refilled.
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      load(st);
      CpAsyncCommit();
    }
    CpAsyncWait<kStages - 2>();
    __syncthreads();
    prepare(0);
    FenceProxyAsyncShared();
    __syncthreads();
    for (int st = 0; st < stages; ++st) {
      compute(st);
      CpAsyncWait<kStages - 3>();
      __syncthreads();
      load(st + kStages - 1);
      CpAsyncCommit();
      prepare(st + 1);
      FenceProxyAsyncShared();
      WgmmaWait<0>();
      __syncthreads();
    }
    CpAsyncWait<0>();

    float* out =
        partial + PartialOffset(tokens, plan.chunks, width, tile, chunk) + g0;
#pragma unroll
    for (int i = 0; i < kW / 2; ++i) {
      const int t = 64 * wg + 16 * wq + grp + 8 * ((i >> 1) & 1);
      const int col = 8 * (i >> 2) + 2 * quad + (i & 1);
      if (t < rows && col < logits) out[t * width + col] = acc[i];
    }
    // A row's two halves, the first half first.
    const float other = __shfl_xor_sync(0xffffffffu, ss_run, 1);
    const int row = tid >> 1;
    if ((tid & 1) == 0 && group == 0 && row < rows) {
      out[row * width + s.N] = ss_run + other;
    }
    // The next unit's first loads reuse the stages this one computed from.
    __syncthreads();
  });
}

// Logits per unit: the fewest computed (groups x width), the wider on a tie.
int TileWidth(int N) {
  const int padded144 = (N + 143) / 144 * 144;
  const int padded96 = (N + 95) / 96 * 96;
  return padded144 <= padded96 ? 144 : 96;
}

template <typename T, int kW>
cudaError_t LaunchTiles(const DevSpec& s, int64_t tokens, const void* x,
                        const float* phi, const float* gamma, float* partial,
                        unsigned long long* next_unit, cudaStream_t stream) {
  const int64_t chunks = PlanChunks(s.K, s.N).chunks;
  const int64_t units = MmaTiles(tokens) * chunks * ((s.N + kW - 1) / kW);
  return LaunchPersistent(wgmma_projection_kernel<T, kW>, units,
                          WgmmaPlan<T, kW>::kSmem, next_unit, stream, s, tokens,
                          static_cast<const T*>(x), phi, gamma, partial);
}

}  // namespace

bool WgmmaProjectionApplies(const LayerSpec& spec, DType dtype, const void* x,
                            const float* phi, const float* gamma) {
  const int64_t per16 = 16 / static_cast<int64_t>(DTypeSize(dtype));
  return spec.matmul_precision == MatmulPrecision::kTf32 &&
         spec.K() % per16 == 0 && Aligned16(x) && Aligned16(phi) &&
         (gamma == nullptr || Aligned16(gamma));
}

absl::Status LaunchWgmmaProjectionPartials(const LayerSpec& spec,
                                           int64_t tokens, DType dtype,
                                           const void* x, const float* phi,
                                           const float* gamma, float* partial,
                                           unsigned long long* next_unit,
                                           cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(spec);
  cudaError_t err = cudaSuccess;
  DispatchDType(dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    err = TileWidth(s.N) == 144
              ? LaunchTiles<T, 144>(s, tokens, x, phi, gamma, partial,
                                    next_unit, stream)
              : LaunchTiles<T, 96>(s, tokens, x, phi, gamma, partial, next_unit,
                                   stream);
  });
  const std::string shape = ShapeString(spec, tokens, dtype);
  MHC_CUDA_RETURN_IF_ERROR(err, "projection forward (wgmma)", shape);
  MHC_CUDA_CHECK_LAUNCH("projection forward (wgmma)", shape);
  return absl::OkStatus();
}

}  // namespace mhc::cuda
