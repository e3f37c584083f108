// Tensor-core projection forward for layers with more than 2 kLogitGroup
// logits (n >= 7 mHC layers). There projection/forward/mma.cuh's units of
// kLogitGroup logits cost a pass over the x tile each, with 3 mma column tiles
// per fragment load (n = 16: 12 passes; docs/decisions.md). Here a unit is a
// GEMM tile of 128 tokens x 32 kNT logits (kNT = 2
// or 3) over one K chunk: warp (wt, wl) owns tokens 64 wt.. and logits
// 8 kNT wl.. (4 x kNT mma tiles). Two CTAs share an SM (tf32); the logit
// groups of one tile and chunk run side by side, so x comes from HBM once.
// A CTA of the whole 288 logits of n = 16 (one CTA per SM, 255 registers)
// measured slower: the second CTA hides the barriers and mma latency.
// TF32 launches with 16-byte aligned rows go to the warpgroup-mma form
// (projection/forward/wgmma_tf32_wide.cu); IEEE and unaligned rows stay here.
//
// Same units, partial layout and chunks as projection/forward/mma.cuh
// (PlanChunks, PartialOffset), so projection_finish_kernel and the fused pre
// forward's mixing read the partials unchanged. Numerics: 16-bit x converts to
// tf32 exactly; phi' = phi * gamma (one rounded multiply, as docs/SPEC.md
// defines it) is rounded to tf32 once per stage in shared memory, and under
// IEEE split into high and low parts (fp32 x too: hi*hi + hi*lo + lo*hi). Under
// IEEE each stage accumulates in fresh registers added to the running sums with
// rounded fp32 adds (the tensor cores' accumulation truncates against a
// long running sum); tf32 accumulates in the mma.
//
// Determinism / batch invariance: a token's h and sum of squares depend on
// its x row, phi', K and N only (mma rows are independent dot products; the
// order over k is fixed by the chunk and stage layout); chunks are added in
// order by projection_finish_kernel. No floating-point atomics.
#include <cstdint>

#include "common.cuh"
#include "dispatch.cuh"
#include "projection/forward/mma.cuh"
#include "projection/forward/mma_wide.h"
#include "projection/forward/wide_stage.cuh"

namespace mhc::cuda {
namespace {

constexpr int kStageK = kWideStageK;

// Logits of a unit: 4 warps across, kNT tiles of 8 each.
template <int kNT>
constexpr int UnitLogits() {
  return 4 * 8 * kNT;
}

// One pipeline stage: x rows of kStageK elements, phi rows of kStageK
// floats (rounded in place to phi' in tf32, the low parts beside them under
// IEEE), then gamma; each row in 16-byte chunks.
template <typename T, bool kIeee, int kNT>
struct StagePlan {
  static constexpr int kXBytes = kMmaTokens * kStageK * sizeof(T);
  static constexpr int kPhiBytes = UnitLogits<kNT>() * kStageK * 4;
  static constexpr int kBytes =
      kXBytes + (kIeee ? 2 : 1) * kPhiBytes + kStageK * 4;
  static constexpr int kStages = 4;
  static constexpr int kSmem = kStages * kBytes;
};

// tf32 bits of an x value: 16-bit values are exact, fp32 is rounded (and
// its remainder kept in lo under IEEE).
template <typename T, bool kIeee>
__device__ __forceinline__ void XParts(float v, uint32_t& hi, uint32_t& lo) {
  if constexpr (sizeof(T) == 2) {
    hi = __float_as_uint(v);
  } else {
    const float h = RoundTf32Bits(v);
    hi = __float_as_uint(h);
    if constexpr (kIeee) lo = __float_as_uint(RoundTf32Bits(v - h));
  }
}

template <typename T, bool kIeee, int kNT, bool kVector>
__global__ void __launch_bounds__(kMmaThreads, kIeee ? 1 : 2)
    wide_projection_kernel(DevSpec s, int64_t tokens, const T* __restrict__ x,
                           const float* __restrict__ phi,
                           const float* __restrict__ gamma, float* partial,
                           unsigned long long* next_unit) {
  using Plan = StagePlan<T, kIeee, kNT>;
  constexpr int kStages = Plan::kStages;
  constexpr int kLogits = UnitLogits<kNT>();
  constexpr bool kSplitX = kIeee && sizeof(T) == 4;
  constexpr int kXPer = 16 / static_cast<int>(sizeof(T));  // x per chunk
  constexpr int kPChunks = kStageK / 4;  // 16-byte chunks per phi row
  extern __shared__ __align__(16) char wide_fwd_smem[];
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int grp = lane >> 2;
  const int quad = lane & 3;
  const int wt = warp >> 2;  // 64-token half
  const int wl = warp & 3;   // logit quarter
  const ChunkPlan plan = PlanChunks(s.K, s.N);
  const int groups = (s.N + kLogits - 1) / kLogits;
  const int64_t units = MmaTiles(tokens) * plan.chunks * groups;
  const int width = s.N + 1;

  auto x_stage = [&](int buf) {
    return reinterpret_cast<T*>(wide_fwd_smem + buf * Plan::kBytes);
  };
  // part 0: phi, then its tf32 high part; 1: the low part (IEEE).
  auto phi_stage = [&](int buf, int part) {
    return reinterpret_cast<float*>(wide_fwd_smem + buf * Plan::kBytes +
                                    Plan::kXBytes) +
           part * kLogits * kStageK;
  };
  auto gamma_stage = [&](int buf) {
    return phi_stage(buf, 0) + (kIeee ? 2 : 1) * kLogits * kStageK;
  };
  // The lane's fragment rows start at the warp's first row + grp; the other
  // rows it reads are 8 apart, which leaves the swizzle unchanged, so they
  // are these offsets (per 16-k half) plus constants.
  int x_frag[2], phi_frag[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    x_frag[half] = StagedIndex<T>(wt * 64 + grp, 16 * half + 4 * quad);
    phi_frag[half] =
        StagedIndex<float>(wl * 8 * kNT + grp, 16 * half + 4 * quad);
  }

  // The copy plan (see load): x chunk xj of rows xr + i kXStep, phi chunk
  // pj of rows pr + 32 i, and their swizzled places in a stage.
  constexpr int kXChunks = kStageK / kXPer;
  constexpr int kXStep = kMmaThreads / kXChunks;
  constexpr int kXCopies = kMmaTokens / kXStep;
  static_assert(kXStep % 4 == 0 && kMmaThreads / kPChunks == 32,
                "copy rows keep their swizzle");
  const int xr = tid / kXChunks, xj = tid % kXChunks;
  const int pr = tid / kPChunks, pj = tid % kPChunks;
  const int x_dst = StagedIndex<T>(xr, xj * kXPer);
  const int phi_dst = StagedIndex<float>(pr, pj * 4);
  const int64_t x_step = int64_t{kXStep} * s.K, phi_step = 32 * s.K;

  ForEachUnit(units, groups, plan.chunks, next_unit, [&](MmaUnit unit) {
    const auto [tile, chunk, group] = unit;
    const WideUnit u = WideUnitOf<kLogits>(s, tokens, plan, unit);

    // Vector copies: this thread always takes chunk xj of rows xr + i
    // kXStep (x) and chunk pj of rows pr + i 32 (phi), rows that keep its
    // swizzle, so a stage only adds its k offset.
    const T* x_src = x + (u.m0 + xr) * s.K + u.kbeg + xj * kXPer;
    const float* phi_src = phi + (u.g0 + pr) * s.K + u.kbeg + pj * 4;
    unsigned x_rows = 0, phi_rows = 0;
#pragma unroll
    for (int i = 0; i < kXCopies; ++i) {
      if (xr + i * kXStep < u.rows) x_rows |= 1u << i;
    }
#pragma unroll
    for (int i = 0; i < kNT; ++i) {
      if (pr + i * 32 < u.logits) phi_rows |= 1u << i;
    }
    auto load = [&](int st) {
      if (st >= u.stages) return;
      const int buf = st % kStages;
      const int kst = st * kStageK;
      T* xs = x_stage(buf);
      float* ps = phi_stage(buf, 0);
      if constexpr (kVector) {
        const bool x_k = u.kbeg + kst + xj * kXPer < u.kend;
#pragma unroll
        for (int i = 0; i < kXCopies; ++i) {
          const bool ok = x_k && ((x_rows >> i) & 1u);
          CpAsync<16>(xs + x_dst + i * kXStep * kStageK,
                      ok ? x_src + kst + i * x_step : x, ok);
        }
        const bool phi_in_k = u.kbeg + kst + pj * 4 < u.kend;
#pragma unroll
        for (int i = 0; i < kNT; ++i) {
          const bool ok = phi_in_k && ((phi_rows >> i) & 1u);
          CpAsync<16>(ps + phi_dst + i * 32 * kStageK,
                      ok ? phi_src + kst + i * phi_step : phi, ok);
        }
        if (gamma != nullptr && tid < kPChunks) {
          const int64_t k = u.kbeg + kst + tid * 4;
          CpAsync<16>(gamma_stage(buf) + tid * 4,
                      k < u.kend ? gamma + k : gamma, k < u.kend);
        }
      } else {
        // Rows that are not 16-byte aligned (odd K): element copies.
        const int64_t k0 = u.kbeg + kst;
        for (int e = tid; e < kMmaTokens * kStageK; e += kMmaThreads) {
          const int r = e / kStageK;
          const int k = e % kStageK;
          xs[StagedIndex<T>(r, k)] = r < u.rows && k0 + k < u.kend
                                         ? x[(u.m0 + r) * s.K + k0 + k]
                                         : FromFloat<T>(0.0f);
        }
        for (int e = tid; e < kLogits * kStageK; e += kMmaThreads) {
          const int r = e / kStageK;
          const int k = e % kStageK;
          ps[StagedIndex<float>(r, k)] = r < u.logits && k0 + k < u.kend
                                             ? phi[(u.g0 + r) * s.K + k0 + k]
                                             : 0.0f;
        }
        if (gamma != nullptr && tid < kStageK) {
          gamma_stage(buf)[tid] = k0 + tid < u.kend ? gamma[k0 + tid] : 0.0f;
        }
      }
    };

    float ss_run = 0.0f;
    // phi' = phi * gamma (one rounded multiply, as docs/SPEC.md defines it),
    // rounded to tf32 in place, its remainder rounded beside it under IEEE:
    // once per CTA and stage instead of once per warp that reads it. This
    // thread takes the chunks it copied: k 4 pj .. 4 pj + 3 of rows pr +
    // 32 i.
    auto prepare = [&](int st) {
      if (st >= u.stages) return;
      const int buf = st % kStages;
      // The sum of squares: 16 k of row tid / 2 (half tid % 2 of the
      // stage) per thread, in a fresh register added to the running one.
      {
        const T* row = x_stage(buf);
        float fresh = 0.0f;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          float v[4];
          LoadX4(row + StagedIndex<T>(tid >> 1, 16 * (tid & 1) + 4 * q), v);
#pragma unroll
          for (int e = 0; e < 4; ++e) fresh = fmaf(v[e], v[e], fresh);
        }
        ss_run += fresh;
      }
      float4* hi_at = reinterpret_cast<float4*>(phi_stage(buf, 0) + phi_dst);
      float4* lo_at = reinterpret_cast<float4*>(phi_stage(buf, 1) + phi_dst);
      const float4 g =
          gamma != nullptr
              ? *reinterpret_cast<const float4*>(gamma_stage(buf) + pj * 4)
              : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
#pragma unroll
      for (int i = 0; i < kNT; ++i) {
        const float4 p = hi_at[i * 8 * kStageK];
        const float v[4] = {__fmul_rn(p.x, g.x), __fmul_rn(p.y, g.y),
                            __fmul_rn(p.z, g.z), __fmul_rn(p.w, g.w)};
        float hi[4], lo[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          hi[e] = RoundTf32Bits(v[e]);
          lo[e] = kIeee ? RoundTf32Bits(v[e] - hi[e]) : 0.0f;
        }
        hi_at[i * 8 * kStageK] = make_float4(hi[0], hi[1], hi[2], hi[3]);
        if constexpr (kIeee) {
          lo_at[i * 8 * kStageK] = make_float4(lo[0], lo[1], lo[2], lo[3]);
        }
      }
    };

    float acc[4][kNT][4];
    ZeroFill(acc);

    // The mma's k slots quad and quad + 4 take physical k 4 quad + 2 v and
    // 4 quad + 2 v + 1 (v: the k step of the 16-k half) for both operands:
    // the same products, one 8- or 16-byte load per fragment row. IEEE
    // products start each stage at zero and are added to the running sums
    // with rounded fp32 adds.
    auto compute = [&](int st) {
      const int buf = st % kStages;
      const T* xs = x_stage(buf);
      const float* ph = phi_stage(buf, 0);
      const float* pl = phi_stage(buf, 1);
      float fresh[kIeee ? 4 : 1][kIeee ? kNT : 1][4] = {};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint32_t ah[4][2][4], al[4][2][4];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          float a[4], b[4];
          LoadX4(xs + x_frag[half] + mt * 16 * kStageK, a);
          LoadX4(xs + x_frag[half] + (mt * 16 + 8) * kStageK, b);
#pragma unroll
          for (int v = 0; v < 2; ++v) {
            const float vals[4] = {a[2 * v], b[2 * v], a[2 * v + 1],
                                   b[2 * v + 1]};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              XParts<T, kIeee>(vals[e], ah[mt][v][e], al[mt][v][e]);
            }
          }
        }
        // Column tiles in pairs: the two k steps' mmas into one
        // accumulator are 8 mmas apart, not 4, past the mma latency.
#pragma unroll
        for (int nt0 = 0; nt0 < kNT; nt0 += 2) {
          constexpr int kPair = 2;
          float4 hi[kPair], lo[kPair];
#pragma unroll
          for (int j = 0; j < kPair; ++j) {
            if (nt0 + j >= kNT) break;
            const int at = phi_frag[half] + (nt0 + j) * 8 * kStageK;
            hi[j] = *reinterpret_cast<const float4*>(ph + at);
            if constexpr (kIeee) {
              lo[j] = *reinterpret_cast<const float4*>(pl + at);
            }
          }
#pragma unroll
          for (int v = 0; v < 2; ++v) {
#pragma unroll
            for (int j = 0; j < kPair; ++j) {
              if (nt0 + j >= kNT) break;
              const int nt = nt0 + j;
              const float h0 = v == 0 ? hi[j].x : hi[j].z;
              const float h1 = v == 0 ? hi[j].y : hi[j].w;
#pragma unroll
              for (int mt = 0; mt < 4; ++mt) {
                if constexpr (kIeee) {
                  const float l0 = v == 0 ? lo[j].x : lo[j].z;
                  const float l1 = v == 0 ? lo[j].y : lo[j].w;
                  Mma1688(fresh[mt][nt], ah[mt][v], h0, h1);
                  Mma1688(fresh[mt][nt], ah[mt][v], l0, l1);
                  if constexpr (kSplitX) {
                    Mma1688(fresh[mt][nt], al[mt][v], h0, h1);
                  }
                } else {
                  Mma1688(acc[mt][nt], ah[mt][v], h0, h1);
                }
              }
            }
          }
        }
      }
      if constexpr (kIeee) {
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] += fresh[mt][nt][e];
          }
        }
      }
    };

    // Stage st + 1 is rounded while st computes: the wait before each
    // barrier lets one copy group fewer stay in flight.
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      load(st);
      CpAsyncCommit();
    }
    CpAsyncWait<kStages - 2>();
    __syncthreads();
    prepare(0);
    for (int st = 0; st < u.stages; ++st) {
      CpAsyncWait<kStages - 3>();
      __syncthreads();
      load(st + kStages - 1);
      CpAsyncCommit();
      prepare(st + 1);
      compute(st);
    }
    CpAsyncWait<0>();

    float* out =
        partial + PartialOffset(tokens, plan.chunks, width, tile, chunk) + u.g0;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int t = wt * 64 + mt * 16 + grp + 8 * h;
        if (t >= u.rows) continue;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = wl * 8 * kNT + nt * 8 + 2 * quad + e;
            if (col < u.logits) out[t * width + col] = acc[mt][nt][2 * h + e];
          }
        }
      }
    }
    StoreRowSquares(out, width, s.N, ss_run, group == 0, u.rows);
    // The next unit's first loads reuse the stages this one computed from.
    __syncthreads();
  });
}

// The plan picks the tile width (proj::WideForwardTiles) from these.
static_assert(UnitLogits<2>() == proj::WideUnitLogits(2) &&
                  UnitLogits<3>() == proj::WideUnitLogits(3),
              "the plan's geometry is the kernel's");

}  // namespace

absl::Status LaunchWideProjectionPartials(const LayerSpec& spec, int64_t tokens,
                                          DType dtype, const void* x,
                                          const float* phi, const float* gamma,
                                          const ProjectionForwardPlan& plan,
                                          void* workspace,
                                          cudaStream_t stream) {
  const bool ieee = spec.matmul_precision == MatmulPrecision::kIeee;
  // 16-byte copies need whole 16-byte chunks of every row.
  const bool vector = plan.vector_rows;
  float* partial = static_cast<float*>(workspace);
  auto* next_unit = reinterpret_cast<unsigned long long*>(
      static_cast<char*>(workspace) + plan.workspace.counter_offset);
  const DevSpec s = MakeDevSpec(spec);
  const int64_t chunks = PlanChunks(s.K, s.N).chunks;
  cudaError_t err = cudaSuccess;
  DispatchDType(dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    DispatchBool(ieee, [&](auto ieee_tag) {
      DispatchBool(vector, [&](auto vector_tag) {
        DispatchBool(plan.tile_logits == UnitLogits<3>(), [&](auto three_tag) {
          constexpr bool kIeee = decltype(ieee_tag)::value;
          // TF32 with vector rows takes the wgmma_tf32_wide variant.
          constexpr bool kVector = kIeee && decltype(vector_tag)::value;
          constexpr int kNT = decltype(three_tag)::value ? 3 : 2;
          const int64_t units =
              MmaTiles(tokens) * chunks *
              ((s.N + UnitLogits<kNT>() - 1) / UnitLogits<kNT>());
          err = LaunchPersistent(wide_projection_kernel<T, kIeee, kNT, kVector>,
                                 units, StagePlan<T, kIeee, kNT>::kSmem,
                                 next_unit, stream, s, tokens,
                                 static_cast<const T*>(x), phi, gamma, partial);
        });
      });
    });
  });
  const LaunchShape shape(spec, tokens, dtype);
  MHC_CUDA_RETURN_IF_ERROR(err, "projection forward mma_wide", shape);
  MHC_CUDA_CHECK_LAUNCH("projection forward mma_wide", shape);
  return absl::OkStatus();
}

}  // namespace mhc::cuda
