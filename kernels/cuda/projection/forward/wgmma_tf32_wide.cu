// The projection forward of wide layers (n >= 7) on warpgroup mmas, for
// TF32 precision (bf16 layers of up to 80 logits with aligned rows take
// projection/forward/wgmma_bf16_wide.cu). projection/forward/mma_wide.cu's
// mma.sync tiles spend more issue slots on fragment loads, x unpacking and
// addressing than on mmas (the tensor pipe mostly idle at n = 16). Here each
// warpgroup issues one wgmma per 8 k for its 64 tokens x all kW logits of the
// unit, both operands read by the tensor cores from shared memory in
// primitives/wgmma.cuh's swizzled layout.
//
// Unit: 128 tokens x kW logits over one K chunk; same chunks, tiles and
// partial layout as projection/forward/mma.cuh, so the chunk sum and the fused
// pre forward's mixing read the partials unchanged. phi' = phi * gamma (one
// rounded multiply, as docs/SPEC.md defines it) rounded to tf32: where the
// plan gives it room (kRounded), once per launch into the workspace
// (round_phi_rows_kernel) in phi's [N][K] layout; else each unit rounds its
// stages in place. Per stage of kWideStageK k: x and phi by cp.async; then,
// while the previous stage's wgmmas run, x converted to tf32 into one of two
// operand tiles (16-byte loads and stores; exact for 16-bit x) with the sum
// of squares taken on the way (and phi' rounded in place). Two CTAs per SM
// for 16-bit x. Both forms give the same bits.
//
// Determinism / batch invariance: a token's h and sum of squares depend on
// its x row, phi', K and N only (wgmma rows are independent dot products; the
// order over k is fixed by the chunk and stage layout); chunks are added in
// order by projection_finish_kernel. No floating-point atomics.
#include <algorithm>
#include <cstdint>

#include "common.cuh"
#include "dispatch.cuh"
#include "primitives/wgmma.cuh"
#include "projection/forward/mma.cuh"
#include "projection/forward/wgmma_tf32_wide.h"
#include "projection/forward/wide_stage.cuh"

namespace mhc::cuda {
namespace {

constexpr int kStageK = kWideStageK;
constexpr int kStages = 3;           // two CTAs per SM
constexpr int kRoundPhiCtas = 1024;  // grid-stride past this

// Shared memory: two x tiles in tf32 (wgmma's A operand, 128 rows of the
// swizzled layout; one computes while the next is written), then kRing
// copy stages (phi rows in the B layout, raw x rows as StagedIndex places
// them), then (rounding in place) gamma for each stage. Every operand tile
// starts on an atom. kRing: kStages, or with fewer units than SMs (one CTA
// per SM) as many as one CTA's shared memory holds.
template <typename T, int kW, bool kRounded, int kRing>
struct WgmmaPlan {
  static_assert(kW % 8 == 0, "B rows in whole swizzle atoms");
  static constexpr int kOperandBytes = kMmaTokens * kStageK * 4;
  static constexpr int kPhiBytes = kW * kStageK * 4;
  static constexpr int kXBytes = kMmaTokens * kStageK * sizeof(T);
  static constexpr int kBytes = kPhiBytes + kXBytes;
  static constexpr int kStagesAt = 2 * kOperandBytes;
  static constexpr int kGammaAt = kStagesAt + kRing * kBytes;
  // The dynamic shared memory's start is aligned up to an atom in-kernel.
  static constexpr int kSmem =
      kGammaAt + (kRounded ? 0 : kRing * kStageK * 4) + kSwizzleAtomBytes;
  static_assert(kOperandBytes % kSwizzleAtomBytes == 0 &&
                    kBytes % kSwizzleAtomBytes == 0,
                "tiles stay on atoms");
};

// The deepest ring one CTA's shared memory holds, at most kBf16DeepStages.
template <typename T, int kW, bool kRounded>
constexpr int DeepRing() {
  using Shallow = WgmmaPlan<T, kW, kRounded, kStages>;
  constexpr int kPerStage =
      (Shallow::kSmem - Shallow::kStagesAt - kSwizzleAtomBytes) / kStages;
  constexpr int kFits =
      (proj::kMaxSmemPerBlock - Shallow::kStagesAt - kSwizzleAtomBytes) /
      kPerStage;
  constexpr int kRing = std::min(kFits, proj::kBf16DeepStages);
  static_assert(
      WgmmaPlan<T, kW, kRounded, kRing>::kSmem <= proj::kMaxSmemPerBlock,
      "the deep ring fits one CTA");
  return kRing;
}

// 16 consecutive x values (k0 a multiple of 16) of staged row r as floats.
template <typename T>
__device__ __forceinline__ void StagedX16(const T* xs, int r, int k0,
                                          float (&v)[16]) {
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 u =
          *reinterpret_cast<const float4*>(xs + StagedIndex<T>(r, k0 + 4 * q));
      v[4 * q] = u.x;
      v[4 * q + 1] = u.y;
      v[4 * q + 2] = u.z;
      v[4 * q + 3] = u.w;
    }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 u =
          *reinterpret_cast<const uint4*>(xs + StagedIndex<T>(r, k0 + 8 * h));
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr (std::is_same<T, __nv_bfloat16>::value) {
          v[8 * h + 2 * e] = __uint_as_float(w[e] << 16);
          v[8 * h + 2 * e + 1] = __uint_as_float(w[e] & 0xffff0000u);
        } else {
          const float2 f =
              __half22float2(*reinterpret_cast<const __half2*>(&w[e]));
          v[8 * h + 2 * e] = f.x;
          v[8 * h + 2 * e + 1] = f.y;
        }
      }
    }
  }
}

// Four elements of phi' = phi * gamma rounded to tf32.
__device__ __forceinline__ float4 RoundPhiTf32(float4 p, float4 g) {
  return make_float4(
      RoundTf32Bits(__fmul_rn(p.x, g.x)), RoundTf32Bits(__fmul_rn(p.y, g.y)),
      RoundTf32Bits(__fmul_rn(p.z, g.z)), RoundTf32Bits(__fmul_rn(p.w, g.w)));
}

// phi' = phi * gamma rounded to tf32, as phi's [N][K] rows (K % 4 == 0:
// the plan's vector rows): each unit rounding its stages in shared memory
// costs a load, multiply, rounding and store per element per unit, and the
// shared memory traffic with it, which bounds the units at large M. Also
// zeroes the units' counter.
__global__ void __launch_bounds__(kMmaThreads)
    round_phi_rows_kernel(DevSpec s, const float* __restrict__ phi,
                          const float* __restrict__ gamma,
                          float* __restrict__ rounded,
                          unsigned long long* unit_counter) {
  AllowDependentLaunch();  // fewer units than SMs may start beside it
  ZeroUnitCounter(unit_counter);
  const int64_t vectors = int64_t{s.N} * s.K / 4;
  for (int64_t q = int64_t{blockIdx.x} * kMmaThreads + threadIdx.x; q < vectors;
       q += int64_t{gridDim.x} * kMmaThreads) {
    const float4 p = reinterpret_cast<const float4*>(phi)[q];
    const float4 g = gamma != nullptr
                         ? *reinterpret_cast<const float4*>(gamma + q * 4 % s.K)
                         : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
    reinterpret_cast<float4*>(rounded)[q] = RoundPhiTf32(p, g);
  }
}

// kRounded: phi is phi' rounded (round_phi_rows_kernel) and gamma unused.
template <typename T, int kW, bool kRounded, int kRing>
__global__ void __launch_bounds__(kMmaThreads, 2)
    wgmma_projection_kernel(DevSpec s, int64_t tokens, const T* __restrict__ x,
                            const float* __restrict__ phi,
                            const float* __restrict__ gamma, float* partial,
                            unsigned long long* next_unit) {
  if constexpr (kRounded) WaitForPrerequisiteGrid();  // phi' rounded
  using Plan = WgmmaPlan<T, kW, kRounded, kRing>;
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
  char* smem = AtomAligned(wgmma_fwd_smem);
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

  auto operand = [&](int st) {
    return reinterpret_cast<float*>(smem + (st & 1) * Plan::kOperandBytes);
  };
  auto phi_stage = [&](int buf) {
    return reinterpret_cast<float*>(smem + Plan::kStagesAt +
                                    buf * Plan::kBytes);
  };
  auto x_stage = [&](int buf) {
    return reinterpret_cast<T*>(smem + Plan::kStagesAt + buf * Plan::kBytes +
                                Plan::kPhiBytes);
  };
  auto gamma_stage = [&](int buf) {
    return reinterpret_cast<float*>(smem + Plan::kGammaAt) + buf * kStageK;
  };

  // The copy plan: x chunk xj of rows xr + i kXStep, phi chunk pj of rows
  // pr + i kPStep; their places in a stage differ only by row offsets.
  const int xr = tid / kXChunks, xj = tid % kXChunks;
  const int pr = tid / kPChunks, pj = tid % kPChunks;
  const int x_dst = StagedIndex<T>(xr, xj * kXPer);
  const int phi_dst = SwizzledRow(pr, pj * 4);
  const int64_t x_step = int64_t{kXStep} * s.K, phi_step = kPStep * s.K;
  // Descriptors of this warpgroup's rows of operand tile 0 and of stage 0's
  // phi rows; the others are fixed byte offsets from them.
  const uint64_t a_desc0 = SwizzledDescriptor(operand(0) + 64 * wg * kStageK);
  const uint64_t b_desc0 = SwizzledDescriptor(phi_stage(0));

  ForEachUnit(units, groups, plan.chunks, next_unit, [&](MmaUnit unit) {
    const auto [tile, chunk, group] = unit;
    const WideUnit u = WideUnitOf<kW>(s, tokens, plan, unit);
    // A copy's chunk holds k below kend when its stage offset is below:
    const int x_klimit = u.span - xj * kXPer, phi_klimit = u.span - pj * 4;

    const T* x_src = x + (u.m0 + xr) * s.K + u.kbeg + xj * kXPer;
    const float* phi_src = phi + (u.g0 + pr) * s.K + u.kbeg + pj * 4;
    unsigned x_rows = 0, phi_rows = 0;
#pragma unroll
    for (int i = 0; i < kXCopies; ++i) {
      if (xr + i * kXStep < u.rows) x_rows |= 1u << i;
    }
#pragma unroll
    for (int i = 0; i < kPCopies; ++i) {
      if (pr + i * kPStep < u.logits) phi_rows |= 1u << i;
    }
    auto load = [&](int st) {
      if (st >= u.stages) return;
      const int buf = st % kRing;
      const int kst = st * kStageK;
      T* xs = x_stage(buf);
      float* ps = phi_stage(buf);
      const bool x_k = kst < x_klimit;
#pragma unroll
      for (int i = 0; i < kXCopies; ++i) {
        const bool ok = x_k && ((x_rows >> i) & 1u);
        CpAsync<16>(xs + x_dst + i * kXStep * kStageK,
                    ok ? x_src + kst + i * x_step : x, ok);
      }
      const bool phi_k = kst < phi_klimit;
#pragma unroll
      for (int i = 0; i < kPCopies; ++i) {
        if (pr + i * kPStep >= kW) break;  // past the tile: nothing staged
        const bool ok = phi_k && ((phi_rows >> i) & 1u);
        CpAsync<16>(ps + phi_dst + i * kPStep * kStageK,
                    ok ? phi_src + kst + i * phi_step : phi, ok);
      }
      if (!kRounded && gamma != nullptr && tid < kPChunks) {
        const int64_t k = u.kbeg + kst + tid * 4;
        CpAsync<16>(gamma_stage(buf) + tid * 4, k < u.kend ? gamma + k : gamma,
                    k < u.kend);
      }
    };

    // x to the tf32 operand tile and the sum of squares: 16 k of row tid /
    // 2 (half tid % 2 of the stage) per thread, a fresh sum per stage added
    // to the running one; without kRounded phi' rounded in place: the chunks
    // this thread copied.
    float ss_run = 0.0f;
    auto prepare = [&](int st) {
      if (st >= u.stages) return;
      const int buf = st % kRing;
      const int r = tid >> 1, k0 = 16 * (tid & 1);
      float v[16];
      StagedX16(x_stage(buf), r, k0, v);
      float fresh = 0.0f;
#pragma unroll
      for (int e = 0; e < 16; ++e) fresh = fmaf(v[e], v[e], fresh);
      ss_run += fresh;
      float* a_tile = operand(st);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float4 t;
        if constexpr (sizeof(T) == 4) {
          t = make_float4(RoundTf32Bits(v[4 * q]), RoundTf32Bits(v[4 * q + 1]),
                          RoundTf32Bits(v[4 * q + 2]),
                          RoundTf32Bits(v[4 * q + 3]));
        } else {
          t = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
        }
        *reinterpret_cast<float4*>(a_tile + SwizzledRow(r, k0 + 4 * q)) = t;
      }
      if constexpr (!kRounded) {
        float4* at = reinterpret_cast<float4*>(phi_stage(buf) + phi_dst);
        const float4 g =
            gamma != nullptr
                ? *reinterpret_cast<const float4*>(gamma_stage(buf) + pj * 4)
                : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
#pragma unroll
        for (int i = 0; i < kPCopies; ++i) {
          if (pr + i * kPStep >= kW) break;
          at[i * kPStep * kStageK / 4] =
              RoundPhiTf32(at[i * kPStep * kStageK / 4], g);
        }
      }
    };

    float acc[kW / 2];
#pragma unroll
    for (int i = 0; i < kW / 2; ++i) acc[i] = 0.0f;

    // The four k steps' wgmmas of this warpgroup's 64 rows, one group.
    auto compute = [&](int st) {
      const uint64_t a_desc =
          DescriptorPlus(a_desc0, (st & 1) * Plan::kOperandBytes);
      const uint64_t b_desc =
          DescriptorPlus(b_desc0, (st % kRing) * Plan::kBytes);
      WgmmaFence();
#pragma unroll
      for (int j = 0; j < kStageK / 8; ++j) {
        WgmmaTf32<kW>(acc, DescriptorPlus(a_desc, 32 * j),
                      DescriptorPlus(b_desc, 32 * j));
      }
      WgmmaCommit();
    };

    // Stage st + 1 is prepared while st's wgmmas run; the barrier after
    // the copies' wait also orders every thread's wait for st - 1's wgmmas
    // before its buffer is refilled.
#pragma unroll
    for (int st = 0; st < kRing - 1; ++st) {
      load(st);
      CpAsyncCommit();
    }
    CpAsyncWait<kRing - 2>();
    __syncthreads();
    prepare(0);
    FenceProxyAsyncShared();
    __syncthreads();
    for (int st = 0; st < u.stages; ++st) {
      compute(st);
      CpAsyncWait<kRing - 3>();
      __syncthreads();
      load(st + kRing - 1);
      CpAsyncCommit();
      prepare(st + 1);
      FenceProxyAsyncShared();
      WgmmaWait<0>();
      __syncthreads();
    }
    CpAsyncWait<0>();

    float* out =
        partial + PartialOffset(tokens, plan.chunks, width, tile, chunk) + u.g0;
#pragma unroll
    for (int i = 0; i < kW / 2; ++i) {
      const int t = 64 * wg + 16 * wq + grp + 8 * ((i >> 1) & 1);
      const int col = 8 * (i >> 2) + 2 * quad + (i & 1);
      if (t < u.rows && col < u.logits) out[t * width + col] = acc[i];
    }
    StoreRowSquares(out, width, s.N, ss_run, group == 0, u.rows);
    // The next unit's first loads reuse the stages this one computed from.
    __syncthreads();
  });
}

// With `rounded` the rounding runs first, then the units
// (LaunchPersistentBlocksAfter says when beside it).
template <typename T, int kW, int kShallow, int kDeep>
cudaError_t LaunchTiles(const DevSpec& s, int64_t tokens, const void* x,
                        const float* phi, const float* gamma, float* rounded,
                        float* partial, unsigned long long* next_unit,
                        bool deep_ring, cudaStream_t stream) {
  if constexpr (kDeep > kShallow) {
    if (deep_ring) {
      return LaunchTiles<T, kW, kDeep, kDeep>(
          s, tokens, x, phi, gamma, rounded, partial, next_unit, false, stream);
    }
  }
  constexpr int kRing = kShallow;
  const int64_t chunks = PlanChunks(s.K, s.N).chunks;
  const int64_t units = MmaTiles(tokens) * chunks * ((s.N + kW - 1) / kW);
  if (rounded == nullptr) {
    return LaunchPersistent(wgmma_projection_kernel<T, kW, false, kRing>, units,
                            WgmmaPlan<T, kW, false, kRing>::kSmem, next_unit,
                            stream, s, tokens, static_cast<const T*>(x), phi,
                            gamma, partial);
  }
  const int64_t vectors = int64_t{s.N} * s.K / 4;
  return LaunchPersistentBlocksAfter(
      [&](unsigned long long* counter) {
        round_phi_rows_kernel<<<GridSize(std::min<int64_t>(
                                    (vectors + kMmaThreads - 1) / kMmaThreads,
                                    kRoundPhiCtas)),
                                kMmaThreads, 0, stream>>>(s, phi, gamma,
                                                          rounded, counter);
        return cudaGetLastError();
      },
      wgmma_projection_kernel<T, kW, true, kRing>, kMmaThreads,
      /*equal_shares=*/false, units, WgmmaPlan<T, kW, true, kRing>::kSmem,
      next_unit, stream, s, tokens, static_cast<const T*>(x),
      static_cast<const float*>(rounded), static_cast<const float*>(nullptr),
      partial);
}

}  // namespace

absl::Status LaunchWgmmaProjectionPartials(
    const LayerSpec& spec, int64_t tokens, DType dtype, const void* x,
    const float* phi, const float* gamma, const ProjectionForwardPlan& plan,
    void* workspace, cudaStream_t stream) {
  const LaunchShape shape(spec, tokens, dtype);
  const DevSpec s = MakeDevSpec(spec);
  char* base = static_cast<char*>(workspace);
  float* partial = reinterpret_cast<float*>(base);
  // The plan's workspace has room for phi' rounded once where that pays.
  float* rounded =
      plan.workspace.phi_rounded > 0
          ? reinterpret_cast<float*>(base + plan.workspace.phi_rounded_offset)
          : nullptr;
  auto* next_unit = reinterpret_cast<unsigned long long*>(
      base + plan.workspace.counter_offset);
  cudaError_t err = cudaSuccess;
  DispatchDType(dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    // The per-unit form's gamma stages take the most: its depth fits both.
    // The plan deepens 16-bit x only (fp32 measured no faster).
    constexpr bool kDeepens = sizeof(T) == 2;
    err = plan.tile_logits == 144 ? LaunchTiles < T, 144, kStages,
    kDeepens ? DeepRing<T, 144, false>()
             : kStages > (s, tokens, x, phi, gamma, rounded, partial, next_unit,
                          plan.deep_ring, stream)
        : LaunchTiles < T,
    96, kStages,
    kDeepens ? DeepRing<T, 96, false>()
             : kStages > (s, tokens, x, phi, gamma, rounded, partial, next_unit,
                          plan.deep_ring, stream);
  });
  MHC_CUDA_RETURN_IF_ERROR(err, "projection forward wgmma_tf32_wide", shape);
  MHC_CUDA_CHECK_LAUNCH("projection forward wgmma_tf32_wide", shape);
  return absl::OkStatus();
}

}  // namespace mhc::cuda
