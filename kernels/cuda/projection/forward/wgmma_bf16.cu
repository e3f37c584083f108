// The projection forward of bf16 layers with one logit group (n <= 4 mHC
// layers, heads) on warpgroup mmas. The mma.sync units
// (projection/forward/mma_bf16.cuh) spend most of their instructions per stage
// on fragment loads and addressing beside the mmas, and left HBM idle part of
// the time (docs/decisions.md); here the tensor cores read both operands from
// shared memory.
//
// Unit: 64 tokens (half of a projection/forward/mma.cuh tile) x one K chunk
// (PlanChunks), one warpgroup per CTA; the partials land in
// projection/forward/mma.cuh's layout, so the chunk sum and the fused pre
// forward's mixing read them unchanged. Units half the mma.sync units' size
// leave less of the last wave idle. Per stage of 64 k (one 128-byte swizzled
// row per token and per logit): x lands straight in wgmma's A layout (bf16, no
// conversion), as one tensor copy that one thread asks for where rows sit on
// 16 bytes (the copy engine swizzles and zero-fills rows past M and k past
// K; the threads' own cp.async pieces cost a fifth of a warp's
// instructions per stage, docs/decisions.md), rows 8 bytes off 16 (odd C at
// n = 4) as tensor copies of token pairs (bf16_unit.cuh), else as cp.async
// pieces; phi' = phi * gamma (one rounded multiply, as docs/SPEC.md defines
// it) split into bf16 terms hi + mid (TF32 precision: 16 significant bits) or
// hi + mid + lo (IEEE) lands in B tiles of 24 rows, copied (one bulk copy
// beside x's) from a split made once per launch; both ways x arrives give the
// same bits. The warpgroup issues, per 16 k, one wgmma.m64n24k16 per term for
// its 64 tokens; the products of bf16 x and a bf16 term are exact in fp32. The
// sum of squares comes from the same staged tile on mma.sync (ldmatrix, then x
// x^T: each token's x.x lands on the diagonal, exact products added in fp32)
// while the wgmmas run. Both accumulate four stages in the tensor cores, then
// are added to fp32 sums with rounded adds (the tensor cores truncate against a
// long running sum), as the mma.sync units do.
//
// Small batches (fewer units than SMs, the plan's unit_ctas) run each unit
// on a cluster: every CTA takes consecutive four-stage flush groups, sends
// each group's sums of a CTA's share of the rows to that CTA, and each CTA
// adds its rows' groups in group order, the adds one CTA per unit makes.
//
// Determinism / batch invariance: a token's h and sum of squares depend on
// its x row, phi', K and N only (rows of both products are independent dot
// products in a fixed k order); chunks are added in order by the chunk sum.
// No floating-point atomics.
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "common.cuh"
#include "dispatch.cuh"
#include "primitives/tensor_map.h"
#include "primitives/tma.cuh"
#include "primitives/wgmma.cuh"
#include "projection/forward/bf16_unit.cuh"
#include "projection/forward/mma.cuh"
#include "projection/forward/wgmma_bf16.h"

namespace mhc::cuda {
namespace {

using bf16_unit::kPairHalfRows;
using bf16_unit::kPairOddBoxBytes;
using bf16_unit::kPairOddCols;
using bf16_unit::kPairShift;
using bf16_unit::kRowBytes;
using bf16_unit::kRowChunks;
using bf16_unit::kStageK;
using bf16_unit::Terms;

// Stages in the ring: three at up to four CTAs per SM, or with the plan's
// deep_ring (fewer units than SMs, so one CTA per SM) the deep ring, so that
// the one CTA keeps more bytes in flight.
constexpr int kRing = 3;
constexpr int kDeepRing = proj::kBf16DeepStages;
constexpr int kUnitTokens = 64;           // wgmma rows
constexpr int kUnitThreads = 128;         // one warpgroup
constexpr int kTileLogits = kLogitGroup;  // B rows; zero past N
constexpr int kXTileBytes = kUnitTokens * kRowBytes;
constexpr int kTermTileBytes = kTileLogits * kRowBytes;
constexpr int kSplitChunks = kTileLogits * kRowChunks;  // per term
static_assert(kMmaTokens == 2 * kUnitTokens, "two units per partial tile");
static_assert(kUnitTokens == proj::kBf16UnitTokens, "the plan's units");
// A stage: the x tile (pair rows: the even tokens' box), then one B tile per
// term; all on swizzle atoms.
__host__ __device__ constexpr int XBytes(bool pair_rows) {
  return pair_rows ? kXTileBytes / 2 : kXTileBytes;
}
__host__ __device__ constexpr int StageBytes(int terms,
                                             bool pair_rows = false) {
  return XBytes(pair_rows) + terms * kTermTileBytes;
}
// Pair rows add each stage's odd box after the ring.
template <int kTerms, int kStages, bool kPairRows = false>
constexpr int SmemBytes() {
  return kStages * (StageBytes(kTerms, kPairRows) +
                    (kPairRows ? kPairOddBoxBytes : 0)) +
         kSwizzleAtomBytes;
}
static_assert(kXTileBytes % kSwizzleAtomBytes == 0 &&
                  kTermTileBytes % kSwizzleAtomBytes == 0,
              "operand tiles start on atoms");
// The split takes the workspace the mma.sync units' split would.
static_assert(Terms(false) * kTermTileBytes == kBf16HiMidWords * 4 &&
                  Terms(true) * kTermTileBytes == kBf16StageWords * 4,
              "same split bytes per stage");

// phi' split once for the launch: a CTA per 64-k stage, its term tiles
// where the units copy them from; and the units' counter zeroed.
template <int kTerms>
__global__ void __launch_bounds__(kSplitChunks)
    phi_planes_kernel(DevSpec s, const float* phi, const float* gamma, bool vec,
                      char* planes, unsigned long long* unit_counter) {
  // The split units and fewer units than SMs may take their slots beside it.
  AllowDependentLaunch();
  ZeroUnitCounter(unit_counter);
  const int g = threadIdx.x / kRowChunks, c = threadIdx.x % kRowChunks;
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * kStageK + c * 8;
  float v[8];
  FetchPhiChunk(s, phi, gamma, g, k0, s.K, vec, v);
  bf16_unit::StorePhiChunk<kTermTileBytes, kTerms>(
      v, planes + static_cast<int64_t>(blockIdx.x) * kTerms * kTermTileBytes, g,
      c);
}

// This warp's A fragments (its 16 rows, one per 16 k) of a landed stage of
// pair rows (bf16_unit.cuh): even tokens (warps 0, 1) by ldmatrix from their
// swizzled box, odd tokens (warps 2, 3) by 4-byte loads from theirs,
// kPairShift elements on.
__device__ __forceinline__ void LoadPairFragments(
    const char* even, const char* odd, int slab, int lane,
    uint32_t (&a)[kStageK / 16][4]) {
  if (slab >= kPairHalfRows) {
    const int grp = lane >> 2, quad = lane & 3;
    constexpr int kOddRowBytes = kPairOddCols * 2;
    const char* p = odd + (slab - kPairHalfRows + grp) * kOddRowBytes +
                    kPairShift * 2 + 4 * quad;
#pragma unroll
    for (int j = 0; j < kStageK / 16; ++j) {
      const char* at = p + 32 * j;
      a[j][0] = *reinterpret_cast<const uint32_t*>(at);
      a[j][1] = *reinterpret_cast<const uint32_t*>(at + 8 * kOddRowBytes);
      a[j][2] = *reinterpret_cast<const uint32_t*>(at + 16);
      a[j][3] = *reinterpret_cast<const uint32_t*>(at + 8 * kOddRowBytes + 16);
    }
    return;
  }
  const int row = slab + (lane & 15);
#pragma unroll
  for (int j = 0; j < kStageK / 16; ++j) {
    LdMatrixX4(a[j], even + SwizzledChunkAt(row, 2 * j + (lane >> 4)));
  }
}

// kTma: x (rows on 16 bytes) by tensor copies and the split by bulk copies,
// issued by one thread; else cp.async pieces of kCopyBytes (8 or 4) by every
// thread. phi' always comes split (phi_planes_kernel; projection/plan.cc
// says why). kPairRows (with kTma): x_map and odd_map are the pair maps of
// bf16_unit.cuh, each stage's odd box after the ring, the A operand from
// registers.
//
// kSplit: a cluster of split.ctas CTAs per unit on a grid of (split.ctas,
// chunks, tiles), split_plan the layer's PlanChunks from the host; each CTA
// with its share of the unit's flush groups, the slots of their sums and the
// inbox of the other groups' sums of its rows (bf16_unit::GroupInbox, after
// the ring in shared memory).
template <int kTerms, int kCopyBytes, bool kTma, int kStages, bool kSplit,
          bool kPairRows = false>
__global__ void __launch_bounds__(kUnitThreads, 4)
    bf16_wgmma_projection_kernel(const __grid_constant__ CUtensorMap x_map,
                                 const __grid_constant__ CUtensorMap odd_map,
                                 DevSpec s, int64_t tokens,
                                 const __nv_bfloat16* __restrict__ x,
                                 const char* __restrict__ planes,
                                 float* partial, ChunkPlan split_plan,
                                 bf16_unit::GroupSplit split,
                                 unsigned long long* next_unit) {
  static_assert(!kTma || kCopyBytes == 16, "tensor copies of 16-byte rows");
  static_assert(!kSplit || kTma, "split units take tensor copies");
  static_assert(!kPairRows || (kTma && !kSplit), "pair rows: one CTA a unit");
  constexpr int kXBytes = XBytes(kPairRows);
  constexpr int kStageBytes = StageBytes(kTerms, kPairRows);
  constexpr int kSplitBytes = kTerms * kTermTileBytes;
  extern __shared__ __align__(16) char bf16_proj_smem[];
  char* smem = AtomAligned(bf16_proj_smem);
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int grp = lane >> 2;
  const int quad = lane & 3;
  const int slab = 16 * warp;  // this warp's first token row
  // Whole units work their plan out themselves: taken from a parameter it
  // measured slower at a two-wave batch.
  const ChunkPlan plan = kSplit ? split_plan : PlanChunks(s.K, s.N);
  const int64_t units = bf16_unit::UnitTiles<kUnitTokens>(tokens) * plan.chunks;
  const int width = s.N + 1;
  bf16_unit::XCopies<kUnitThreads, kUnitTokens, kCopyBytes> x_copies(tid);
  const uint64_t a_desc0 = SwizzledDescriptor(smem);
  const uint64_t b_desc0 = SwizzledDescriptor(smem + kXBytes);
  // With kTma, the stages' copies complete on the ring's barriers.
  __shared__ __align__(8) uint64_t landed[kStages];
  CopyRing<kStages> ring{landed};
  __shared__ __align__(8) uint64_t inbox_landed;
  static_assert(kUnitTokens * (kTileLogits + 1) * 4 <= kStageBytes,
                "a ring slot holds a unit's group sums");
  bf16_unit::GroupInbox inbox(
      reinterpret_cast<float*>(smem + kStages * kStageBytes), &inbox_landed,
      width, split);
  if (kTma) {
    if (tid == 0) {
      ring.Init();
      if (kSplit) inbox.Init();
    }
    __syncthreads();
  }
  // A split launch's unit: its cluster's place in the grid.
  const MmaUnit split_unit{blockIdx.z, static_cast<int>(blockIdx.y), 0};
  if (kSplit) {
    inbox.Start();
    if (tid == 0) {
      inbox.Expect(
          bf16_unit::UnitSpanOf<kUnitTokens>(s, tokens, plan, split_unit)
              .stages);
    }
  }
  WaitForPrerequisiteGrid();  // the phi' planes
  if (kSplit) inbox.Open();
  char* odd_boxes = smem + kStages * kStageBytes;  // pair rows

  // A unit's tile index counts halves of projection/forward/mma.cuh's tiles.
  auto run_unit = [&](MmaUnit unit) {
    bf16_unit::UnitSpan u =
        bf16_unit::UnitSpanOf<kUnitTokens>(s, tokens, plan, unit);
    const int unit_stages = u.stages;
    if (kSplit) {  // this CTA's stages only
      u.kbeg += inbox.FirstStage() * kStageK;
      u.stages = inbox.Stages(unit_stages);
    }
    if (!kTma) x_copies.Begin(x, s.K, u);
    const char* split_src = planes + u.kbeg / kStageK * int64_t{kSplitBytes};
    // The ring slot of the stage before this CTA's last (GroupInbox::Send).
    float* const ring_slot = reinterpret_cast<float*>(
        smem + (u.stages >= 2 ? (u.stages - 2) % kStages : 0) * kStageBytes);

    auto load = [&](int st) {
      if (st >= u.stages) return;
      char* stage = smem + st % kStages * kStageBytes;
      if (kTma) {
        // One thread asks for the x tile (rows past the tokens and k past K
        // land as zeros) and the stage's split.
        if (tid != 0) return;
        uint64_t* bar = ring.Barrier(st);
        const int k = static_cast<int>(u.kbeg + st * kStageK);
        if (kPairRows) {
          MbarrierArriveExpectBytes(bar,
                                    kXBytes + kPairOddBoxBytes + kSplitBytes);
          const int pair = static_cast<int>(u.m0 / 2);
          TmaLoadTile2d(stage, &x_map, k, pair, bar);
          TmaLoadTile2d(odd_boxes + st % kStages * kPairOddBoxBytes, &odd_map,
                        static_cast<int>(s.K) - kPairShift + k, pair, bar);
        } else {
          MbarrierArriveExpectBytes(bar, kXTileBytes + kSplitBytes);
          TmaLoadTile2d(stage, &x_map, k, static_cast<int>(u.m0), bar);
        }
        BulkLoad(stage + kXBytes, split_src + st * kSplitBytes, kSplitBytes,
                 bar);
        return;
      }
      x_copies.Load(stage, s.K, st * kStageK, x);
      const char* src = split_src + st * kSplitBytes;
#pragma unroll
      for (int q = tid * 16; q < kSplitBytes; q += kUnitThreads * 16) {
        CpAsync<16>(stage + kXTileBytes + q, src + q, true);
      }
    };

    bf16_unit::WarpSums<kTileLogits> sums;
    sums.Zero();
    auto compute = [&](int st) {
      const int at = st % kStages * kStageBytes;
      const uint64_t b_desc = DescriptorPlus(b_desc0, at);
      if constexpr (kPairRows) {
        uint32_t a[kStageK / 16][4];
        LoadPairFragments(smem + at,
                          odd_boxes + st % kStages * kPairOddBoxBytes, slab,
                          lane, a);
        sums.IssueStage<kTerms, kTermTileBytes>(a, b_desc);
        if (bf16_unit::TokenOfRow<true>(slab) < u.rows) {
#pragma unroll
          for (int j = 0; j < kStageK / 16; ++j) sums.AddSquares(a[j]);
        }
      } else {
        sums.IssueStage<kTerms, kTermTileBytes>(DescriptorPlus(a_desc0, at),
                                                b_desc);
        // Rows past the tokens hold zeros.
        if (slab < u.rows) sums.AddSquares(smem + at, slab, lane);
      }
    };

    // Tensor copies of a unit the ring holds whole (a split unit's share)
    // all go out at once; else all but one slot, whose stage goes out once
    // the first has landed. (cp.async waits count kStages - 1 groups ahead.)
    const int ahead = kTma && u.stages <= kStages ? kStages : kStages - 1;
    for (int st = 0; st < ahead; ++st) {
      load(st);
      CpAsyncCommit();
    }
    for (int st = 0; st < u.stages; ++st) {
      if (kTma) {
        ring.Wait(st);
      } else {
        CpAsyncWait<kStages - 2>();
      }
      // The copies of stage st, for the wgmmas' proxy.
      FenceProxyAsyncShared();
      __syncthreads();
      if (st + kStages - 1 >= ahead) load(st + kStages - 1);
      CpAsyncCommit();
      compute(st);
      // Stage st's buffers are refilled after the next barrier.
      WgmmaWait<0>();
      static_assert(proj::kFlushStages == 4, "flush groups of four stages");
      if ((st & 3) == 3 || st == u.stages - 1) {
        sums.Flush(grp);
        if (kSplit) {  // the group's sums, from zero
          inbox.Send(sums, st, st == u.stages - 1, ring_slot, s.N, slab, grp,
                     quad);
          sums.Zero();
        }
      }
    }
    CpAsyncWait<0>();

    float* out =
        partial +
        PartialOffset(tokens, plan.chunks, width, unit.tile / 2, unit.chunk) +
        unit.tile % 2 * kUnitTokens * width;
    if (kSplit) {
      inbox.AddInOrder(unit_stages, u.rows, ring_slot, out);
    } else {
      sums.Store<kPairRows>(out, width, s.N, slab, u.rows, grp, quad);
    }
    // The next unit's first copies reuse the stages this one read.
    __syncthreads();
  };
  if (kSplit) {
    run_unit(split_unit);
  } else {
    ForEachUnit(units, 1, plan.chunks, next_unit, run_unit);
  }
  AllowDependentLaunch();  // the chunk sum may take this CTA's slot
}

template <int kTerms>
cudaError_t LaunchPlanes(const DevSpec& s, const float* phi, const float* gamma,
                         bool vec_phi, char* planes,
                         unsigned long long* unit_counter,
                         cudaStream_t stream) {
  phi_planes_kernel<kTerms>
      <<<GridSize((s.K + kStageK - 1) / kStageK), kSplitChunks, 0, stream>>>(
          s, phi, gamma, vec_phi, planes, unit_counter);
  return cudaGetLastError();
}

// The split runs first, then the units (LaunchPersistentBlocksAfter says
// when beside it). odd_map: pair rows' (else unread).
template <int kTerms, int kCopyBytes, bool kTma, int kStages = kRing,
          bool kPairRows = false>
cudaError_t LaunchTerms(const CUtensorMap& x_map, const CUtensorMap& odd_map,
                        const DevSpec& s, int64_t tokens, const void* x,
                        const float* phi, const float* gamma, bool vec_phi,
                        char* planes, float* partial,
                        unsigned long long* next_unit, cudaStream_t stream) {
  const ChunkPlan plan = PlanChunks(s.K, s.N);
  const int64_t units = bf16_unit::UnitTiles<kUnitTokens>(tokens) * plan.chunks;
  return LaunchPersistentBlocksAfter(
      [&](unsigned long long* counter) {
        return LaunchPlanes<kTerms>(s, phi, gamma, vec_phi, planes, counter,
                                    stream);
      },
      bf16_wgmma_projection_kernel<kTerms, kCopyBytes, kTma, kStages, false,
                                   kPairRows>,
      kUnitThreads,
      /*equal_shares=*/true, units, SmemBytes<kTerms, kStages, kPairRows>(),
      next_unit, stream, x_map, odd_map, s, tokens,
      static_cast<const __nv_bfloat16*>(x), static_cast<const char*>(planes),
      partial, plan, bf16_unit::GroupSplit::Of(plan, 1));
}

// One cluster of unit_ctas CTAs per unit, after the split.
template <int kTerms>
cudaError_t LaunchSplitUnits(const CUtensorMap& x_map, const DevSpec& s,
                             int64_t tokens, const void* x, const float* phi,
                             const float* gamma, bool vec_phi, char* planes,
                             float* partial, int unit_ctas,
                             cudaStream_t stream) {
  const ChunkPlan plan = PlanChunks(s.K, s.N);
  const bf16_unit::GroupSplit split =
      bf16_unit::GroupSplit::Of(plan, unit_ctas);
  const size_t split_bytes =
      bf16_unit::GroupSplit::Bytes(plan, s.K, unit_ctas, s.N + 1);
  cudaError_t e = LaunchPlanes<kTerms>(s, phi, gamma, vec_phi, planes,
                                       /*unit_counter=*/nullptr, stream);
  if (e != cudaSuccess) return e;
  constexpr int kStages = proj::kSplitRingStages;
  return LaunchLargeSmemClusters(
      bf16_wgmma_projection_kernel<kTerms, 16, true, kStages, true>,
      dim3(static_cast<unsigned>(unit_ctas), static_cast<unsigned>(plan.chunks),
           static_cast<unsigned>(bf16_unit::UnitTiles<kUnitTokens>(tokens))),
      dim3(static_cast<unsigned>(unit_ctas)), kUnitThreads,
      SmemBytes<kTerms, kStages>() + split_bytes, stream, x_map, x_map, s,
      tokens, static_cast<const __nv_bfloat16*>(x),
      static_cast<const char*>(planes), partial, plan, split,
      static_cast<unsigned long long*>(nullptr));
}

// x [tokens, K] bf16 as a tensor map of kUnitTokens x kStageK boxes in
// wgmma's 128-byte swizzle; false where the driver has no encoder or x does
// not fit one (rows not on 16 bytes, coordinates past 32 bits).
bool EncodeXTileMap(const void* x, int64_t K, int64_t tokens,
                    CUtensorMap* map) {
  return EncodeSwizzledRowTiles(x, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, K,
                                tokens, kStageK, kUnitTokens, map);
}

// Pair rows' maps (bf16_unit.cuh): the even tokens as rows of K two rows
// apart, in wgmma's swizzle (zeros past K and past the last even token), and
// the odd ones through the whole pairs [tokens / 2, 2K] in unswizzled, wider
// boxes (zeros past 2K). Half the boxes' rows start 16 bytes off 32, and the
// L2 filling 128 rather than 256 bytes per miss made the units 2-4 % faster
// (docs/decisions.md).
bool EncodePairRowMaps(const void* x, int64_t K, int64_t tokens,
                       CUtensorMap* even, CUtensorMap* odd) {
  const int64_t even_dims[2] = {K, (tokens + 1) / 2};
  const int64_t pair_dims[2] = {2 * K, tokens / 2};
  const int64_t strides[1] = {4 * K};
  const int even_box[2] = {kStageK, kPairHalfRows};
  const int odd_box[2] = {kPairOddCols, kPairHalfRows};
  return tokens >= 2 &&
         EncodeTiledMap(x, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, even_dims,
                        strides, even_box, CU_TENSOR_MAP_SWIZZLE_128B, even,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_128B) &&
         EncodeTiledMap(x, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, pair_dims,
                        strides, odd_box, CU_TENSOR_MAP_SWIZZLE_NONE, odd,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
}

}  // namespace

absl::Status LaunchBf16WgmmaProjectionPartials(
    const LayerSpec& spec, int64_t tokens, const void* x, const float* phi,
    const float* gamma, const ProjectionForwardPlan& plan, void* workspace,
    cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(spec);
  char* base = static_cast<char*>(workspace);
  float* partial = reinterpret_cast<float*>(base);
  if (!plan.split_phi) {
    return absl::InternalError("projection forward wgmma_bf16: no phi' split");
  }
  char* split = base + plan.workspace.phi_split_offset;
  auto* next_unit = reinterpret_cast<unsigned long long*>(
      base + plan.workspace.counter_offset);
  const bool vec_phi = plan.phi_vector;
  const cudaError_t err = bf16_unit::ForTermsAndCopies(
      spec, plan.x_copy_bytes, [&](auto terms, auto copy_bytes) {
        constexpr int kT = decltype(terms)::value;
        constexpr int kC = decltype(copy_bytes)::value;
        CUtensorMap x_map{};
        if constexpr (kC == 16) {
          // Rows on 16 bytes are also on 8: where no tensor map can be made
          // (no encoder in the driver, coordinates past 32 bits), the 8-byte
          // pieces take them, with the same bits.
          if (EncodeXTileMap(x, spec.K(), tokens, &x_map)) {
            if (plan.unit_ctas > 1) {
              return LaunchSplitUnits<kT>(x_map, s, tokens, x, phi, gamma,
                                          vec_phi, split, partial,
                                          plan.unit_ctas, stream);
            }
            if (plan.deep_ring) {
              return LaunchTerms<kT, 16, true, kDeepRing>(
                  x_map, x_map, s, tokens, x, phi, gamma, vec_phi, split,
                  partial, next_unit, stream);
            }
            return LaunchTerms<kT, 16, true>(x_map, x_map, s, tokens, x, phi,
                                             gamma, vec_phi, split, partial,
                                             next_unit, stream);
          }
          return LaunchTerms<kT, 8, false>(x_map, x_map, s, tokens, x, phi,
                                           gamma, vec_phi, split, partial,
                                           next_unit, stream);
        } else {
          if constexpr (kC == 8) {
            // The plan's pair rows; without the encoder, the pieces.
            CUtensorMap odd_map{};
            if (plan.pair_rows &&
                EncodePairRowMaps(x, spec.K(), tokens, &x_map, &odd_map)) {
              return LaunchTerms<kT, 16, true, kRing, true>(
                  x_map, odd_map, s, tokens, x, phi, gamma, vec_phi, split,
                  partial, next_unit, stream);
            }
          }
          return LaunchTerms<kT, kC, false>(x_map, x_map, s, tokens, x, phi,
                                            gamma, vec_phi, split, partial,
                                            next_unit, stream);
        }
      });
  const LaunchShape shape(spec, tokens, DType::kBF16);
  MHC_CUDA_RETURN_IF_ERROR(err, "projection forward wgmma_bf16", shape);
  MHC_CUDA_CHECK_LAUNCH("projection forward wgmma_bf16", shape);
  return absl::OkStatus();
}

}  // namespace mhc::cuda
