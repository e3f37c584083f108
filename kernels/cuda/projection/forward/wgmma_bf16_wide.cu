// The projection forward of bf16 layers with 49-80 logits (n = 7, 8 mHC
// layers) on warpgroup mmas. The TF32 warpgroup tiles
// (projection/forward/wgmma_tf32_wide.cu) convert x to tf32 in shared memory
// first, which costs more issue slots than the copy of x (docs/decisions.md);
// here, as for one logit group (projection/forward/wgmma_bf16.cu), x lands by
// cp.async straight in wgmma's A layout and phi' goes to the tensor cores in
// bf16 terms.
//
// Unit: 128 tokens (one projection/forward/mma.cuh tile) x one K chunk
// (PlanChunks), partials in projection/forward/mma.cuh's layout, one CTA of
// three warpgroups per SM. At 80 logits a stage's B tiles outweigh its x tile
// (20 KB against 8 KB per 64 tokens), so two warpgroups, 64 tokens each, share
// them: they copy x and issue per stage of 64 k one wgmma.m64n80k16 per term
// and 16 k, and take the sum of squares from the staged x tile on mma.sync
// while the wgmmas run (projection/forward/bf16_unit.cuh, which also states the
// numerics). The third warpgroup copies raw phi rows and gamma with cp.async
// into the same stages and splits phi' into bf16 term tiles one stage ahead of
// the wgmmas, beside the other two's path (in their own warps the split left
// the kernel issue-bound). Loads from L2 outside the copy pipeline wait behind
// its copies (a split from registers measured far slower), and a split made
// once per launch (320 B per k) with the K-chunk partials would exceed the 5 %
// workspace budget below M ~ 9000 at n = 8, C = 4096.
//
// Determinism / batch invariance: a token's h and sum of squares depend on
// its x row, phi', K and N only (rows of both products are independent dot
// products in a fixed k order, flushed every four stages of its chunk);
// chunks are added in order by the chunk sum. No floating-point atomics.
#include <cuda_bf16.h>

#include <cstdint>

#include "common.cuh"
#include "dispatch.cuh"
#include "primitives/wgmma.cuh"
#include "projection/forward/bf16_unit.cuh"
#include "projection/forward/mma.cuh"
#include "projection/forward/wgmma_bf16.h"

namespace mhc::cuda {
namespace {

using bf16_unit::kRowBytes;
using bf16_unit::kRowChunks;
using bf16_unit::kStageK;

constexpr int kTileLogits = 80;  // B rows; zero past N
constexpr int kUnitTokens = kMmaTokens;
// Two warpgroups issue the wgmmas and copy x; a third copies phi and gamma
// and splits phi', so that the split runs beside the wgmma warps' path
// instead of in it.
constexpr int kMmaThreads = 256;
constexpr int kSplitThreads = 128;
constexpr int kUnitThreads = kMmaThreads + kSplitThreads;

// Shared memory: a ring of kStages copy stages (the x tile in the A layout,
// then raw phi rows: 64 fp32 of each of the 80 logits), the B tiles of two
// stages (the one the wgmmas read, the one being split), then gamma for
// each copy stage. Every operand tile starts on an atom.
template <int kTerms>
struct WidePlan {
  static constexpr int kXTileBytes = kUnitTokens * kRowBytes;
  static constexpr int kRawBytes = kTileLogits * kStageK * 4;
  static constexpr int kTermTileBytes = kTileLogits * kRowBytes;
  static constexpr int kSplitBytes = kTerms * kTermTileBytes;
  static constexpr int kCopyBytes = kXTileBytes + kRawBytes;
  // As deep as fits one CTA per SM (227 KB).
  static constexpr int kStages = kTerms == 2 ? 5 : 4;
  static constexpr int kSplitAt = kStages * kCopyBytes;
  static constexpr int kGammaAt = kSplitAt + 2 * kSplitBytes;
  static constexpr int kSmem =
      kGammaAt + kStages * kStageK * 4 + kSwizzleAtomBytes;
  // Raw phi copies: 16 pieces of 16 bytes per logit row and stage.
  static constexpr int kRawPasses = kRawBytes / 16 / kSplitThreads;
  // The split: 8 k (one 16-byte chunk of each term) per thread and pass.
  static constexpr int kChunks = kTileLogits * kRowChunks;
  static constexpr int kChunkPasses = kChunks / kSplitThreads;
  static_assert(kXTileBytes % kSwizzleAtomBytes == 0 &&
                    kCopyBytes % kSwizzleAtomBytes == 0 &&
                    kTermTileBytes % kSwizzleAtomBytes == 0,
                "operand tiles start on atoms");
  static_assert(kRawBytes % (16 * kSplitThreads) == 0 &&
                    kChunks % kSplitThreads == 0,
                "whole copy and split passes");
  static_assert(kSmem <= 227 * 1024, "one CTA per SM");
};

template <int kTerms, int kCopyBytes>
__global__ void __launch_bounds__(kUnitThreads, 1)
    bf16_wgmma_wide_projection_kernel(DevSpec s, int64_t tokens,
                                      const __nv_bfloat16* __restrict__ x,
                                      const float* __restrict__ phi,
                                      const float* __restrict__ gamma,
                                      float* partial,
                                      unsigned long long* next_unit) {
  using Plan = WidePlan<kTerms>;
  constexpr int kStages = Plan::kStages;
  extern __shared__ __align__(16) char bf16_wide_smem[];
  char* smem = AtomAligned(bf16_wide_smem);
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int grp = lane >> 2;
  const int quad = lane & 3;
  const int slab = 16 * warp;  // this warp's first token row
  // Its warpgroup's 64 rows of the x tile, the A operand.
  const int a_rows_at = (warp >> 2) * 64 * kRowBytes;
  const bool splitter = tid >= kMmaThreads;  // warpgroup 2
  const int sid = tid - kMmaThreads;         // its thread
  const ChunkPlan plan = PlanChunks(s.K, s.N);
  const int64_t units = MmaTiles(tokens) * plan.chunks;
  const int width = s.N + 1;
  bf16_unit::XCopies<kMmaThreads, kUnitTokens, kCopyBytes> x_copies(tid);
  const uint64_t a_desc0 = SwizzledDescriptor(smem);
  const uint64_t b_desc0 = SwizzledDescriptor(smem + Plan::kSplitAt);
  auto copies = [&](int st) { return smem + st % kStages * Plan::kCopyBytes; };
  auto staged_gamma = [&](int st) {
    return reinterpret_cast<float*>(smem + Plan::kGammaAt +
                                    st % kStages * kStageK * 4);
  };
  auto split_tiles = [&](int st) {
    return smem + Plan::kSplitAt + (st & 1) * Plan::kSplitBytes;
  };
  // A splitter's raw phi pieces: piece q = sid + i kSplitThreads is 4 k of
  // logit row q / 16 (sid / 16 + 8 i) at k 4 (q % 16) of the stage (the
  // same in every pass), staged at 16 q bytes.
  constexpr int kRowsPerPass = kSplitThreads / 16;
  const int phi_row = sid >> 4, phi_k = 4 * (sid & 15);
  const int64_t phi_step = kRowsPerPass * s.K;

  ForEachUnit(units, 1, plan.chunks, next_unit, [&](MmaUnit unit) {
    const bf16_unit::UnitSpan u =
        bf16_unit::UnitSpanOf<kUnitTokens>(s, tokens, plan, unit);
    x_copies.Begin(x, s.K, u);

    // Zeros past N and past the chunk (K % 4 == 0: a piece is all in or
    // all out).
    auto load = [&](int st) {
      if (st >= u.stages) return;
      char* stage = copies(st);
      const int kst = st * kStageK;
      if (!splitter) {
        x_copies.Load(stage, s.K, kst, x);
        return;
      }
      const float* src = phi + phi_row * s.K + u.kbeg + kst + phi_k;
      const bool k_ok = kst + phi_k < u.span;
      char* dst = stage + Plan::kXTileBytes + 16 * sid;
#pragma unroll
      for (int i = 0; i < Plan::kRawPasses; ++i) {
        const bool ok = k_ok && phi_row + i * kRowsPerPass < s.N;
        CpAsync<16>(dst + 16 * i * kSplitThreads, ok ? src : phi, ok);
        src += phi_step;
      }
      if (gamma != nullptr && sid < kStageK / 4) {
        const bool ok = kst + 4 * sid < u.span;
        CpAsync<16>(staged_gamma(st) + 4 * sid,
                    ok ? gamma + u.kbeg + kst + 4 * sid : gamma, ok);
      }
    };
    // phi' = phi * gamma of stage st into its bf16 term tiles.
    auto split = [&](int st) {
      if (!splitter || st >= u.stages) return;
      const float4* raw =
          reinterpret_cast<const float4*>(copies(st) + Plan::kXTileBytes);
      const float4* gam = reinterpret_cast<const float4*>(staged_gamma(st));
      char* tiles = split_tiles(st);
#pragma unroll
      for (int i = 0; i < Plan::kChunkPasses; ++i) {
        const int q = sid + i * kSplitThreads;
        const int c = q % kRowChunks;  // of logit row q / kRowChunks
        const float4 lo = raw[2 * q], hi = raw[2 * q + 1];
        float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        if (gamma != nullptr) {
          const float4 a = gam[2 * c], b = gam[2 * c + 1];
          const float g8[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = __fmul_rn(v[e], g8[e]);
        }
        bf16_unit::StorePhiChunk<Plan::kTermTileBytes, kTerms>(
            v, tiles, q / kRowChunks, c);
      }
    };

    bf16_unit::WarpSums<kTileLogits> sums;
    sums.Zero();
    auto compute = [&](int st) {
      if (splitter) return;
      const int at = st % kStages * Plan::kCopyBytes;
      const uint64_t a_desc = DescriptorPlus(a_desc0, at + a_rows_at);
      const uint64_t b_desc =
          DescriptorPlus(b_desc0, (st & 1) * Plan::kSplitBytes);
      sums.IssueStage<kTerms, Plan::kTermTileBytes>(a_desc, b_desc);
      // Rows past the tokens hold zeros.
      if (slab < u.rows) sums.AddSquares(smem + at, slab, lane);
    };

    // Stage st + 1 is split while st's wgmmas run. The barrier at the top
    // of each step publishes the copies of st and st + 1 and the split of
    // st, and orders every thread's wait for st - 1's wgmmas before the
    // copy stage and B tiles they read are refilled.
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      load(st);
      CpAsyncCommit();
    }
    CpAsyncWait<kStages - 2>();
    __syncthreads();
    split(0);
    for (int st = 0; st < u.stages; ++st) {
      CpAsyncWait<kStages - 3>();
      // The copies of st and the split of st, for the wgmmas' proxy.
      FenceProxyAsyncShared();
      __syncthreads();
      load(st + kStages - 1);
      CpAsyncCommit();
      compute(st);
      split(st + 1);
      if (!splitter) {
        WgmmaWait<0>();
        if ((st & 3) == 3 || st == u.stages - 1) sums.Flush(grp);
      }
    }
    CpAsyncWait<0>();

    if (!splitter) {
      sums.Store(partial + PartialOffset(tokens, plan.chunks, width, unit.tile,
                                         unit.chunk),
                 width, s.N, slab, u.rows, grp, quad);
    }
    // The next unit's first copies and split reuse what this one read.
    __syncthreads();
  });
}

template <int kTerms, int kCopyBytes>
cudaError_t LaunchWide(const DevSpec& s, int64_t tokens, const void* x,
                       const float* phi, const float* gamma, float* partial,
                       unsigned long long* next_unit, cudaStream_t stream) {
  const int64_t units = MmaTiles(tokens) * PlanChunks(s.K, s.N).chunks;
  return LaunchPersistentBlocks(
      bf16_wgmma_wide_projection_kernel<kTerms, kCopyBytes>, kUnitThreads,
      /*equal_shares=*/true, units, WidePlan<kTerms>::kSmem, next_unit, stream,
      s, tokens, static_cast<const __nv_bfloat16*>(x), phi, gamma, partial);
}

}  // namespace

absl::Status LaunchBf16WideProjectionPartials(
    const LayerSpec& spec, int64_t tokens, const void* x, const float* phi,
    const float* gamma, const ProjectionForwardPlan& plan, void* workspace,
    cudaStream_t stream) {
  static_assert(proj::kBf16WideLogits == kTileLogits,
                "the plan's geometry is the kernel's");
  float* partial = static_cast<float*>(workspace);
  auto* next_unit = reinterpret_cast<unsigned long long*>(
      static_cast<char*>(workspace) + plan.workspace.counter_offset);
  const DevSpec s = MakeDevSpec(spec);
  const cudaError_t err = bf16_unit::ForTermsAndCopies(
      spec, plan.x_copy_bytes, [&](auto terms, auto copy_bytes) {
        return LaunchWide<decltype(terms)::value, decltype(copy_bytes)::value>(
            s, tokens, x, phi, gamma, partial, next_unit, stream);
      });
  const LaunchShape shape(spec, tokens, DType::kBF16);
  MHC_CUDA_RETURN_IF_ERROR(err, "projection forward wgmma_bf16_wide", shape);
  MHC_CUDA_CHECK_LAUNCH("projection forward wgmma_bf16_wide", shape);
  return absl::OkStatus();
}

}  // namespace mhc::cuda
