// The projection forward of fp16 and fp32 layers with one logit group (n <= 4
// mHC layers, heads) under TF32 precision, on warpgroup mmas with A from
// registers. The mma.sync units (projection/forward/mma.cuh) ran these layers
// at about half of copy bandwidth, where bf16 ones run on wgmma_bf16.cu.
//
// Unit, ring and partials as wgmma_bf16.cu: 64 tokens x one K chunk
// (PlanChunks) per unit, one warpgroup per CTA, projection/forward/mma.cuh's
// partial layout. Per stage of 64 k one thread asks for x by tensor copies
// (one 128-byte box row per token for fp16, two for fp32; rows past M and k
// past K land as zeros) and for phi' = phi * gamma rounded to TF32, made once
// per launch into two 32-k B tiles per stage.
//
// Each thread reads its A fragments' x straight from the staged tile: per 32
// k, 8 consecutive k of each of its two rows (16 bytes of fp16, 32 of fp32),
// converts them (fp16 exactly, fp32 rounded to TF32 as the mma.sync units
// round it) and issues per 8 k one wgmma.m64n24k8. The m16n8k8 A fragment
// puts a thread's two k of each step at columns quad and quad + 4, so the B
// tiles hold phi' in the matching order: column l of step j is k = 8 (l % 4)
// + 2 j + l / 4 of the block. Every product then pairs the right x and phi'
// with no shuffle and no converted copy of x in shared memory.
//
// The sum of squares: each thread adds the squares of its x values (fp32,
// unrounded) in k order into one sum per row and four stages, added into a
// running sum; the four threads of a row add theirs in a fixed xor tree at
// the unit's end.
//
// Determinism / batch invariance: a token's h and sum of squares depend on
// its x row, phi', K and N only (fixed k orders; the tensor cores accumulate
// four stages, then rounded adds into fp32 sums, as wgmma_bf16.cu); chunks
// are added in order by the chunk sum. No floating-point atomics.
#include <cuda.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

#include "common.cuh"
#include "primitives/tensor_map.h"
#include "primitives/tma.cuh"
#include "primitives/wgmma.cuh"
#include "projection/forward/bf16_unit.cuh"
#include "projection/forward/mma.cuh"
#include "projection/forward/mma.h"
#include "projection/forward/wgmma_tf32.h"

namespace mhc::cuda {
namespace {

using bf16_unit::kStageK;

constexpr int kRing = 3;
constexpr int kDeepRing = proj::kBf16DeepStages;
constexpr int kUnitTokens = proj::kBf16UnitTokens;  // wgmma rows
constexpr int kUnitThreads = 128;                   // one warpgroup
constexpr int kTileLogits = kLogitGroup;            // B rows; zero past N
constexpr int kBlockK = 32;  // k per B tile: one 128-byte row of TF32
constexpr int kBlocks = kStageK / kBlockK;
constexpr int kSteps = kBlockK / 8;  // wgmma k steps per block
constexpr int kBTileBytes = kTileLogits * 128;
constexpr int kPlaneBytes = kBlocks * kBTileBytes;  // per stage
static_assert(kMmaTokens == 2 * kUnitTokens, "two units per partial tile");
static_assert(kPlaneBytes == proj::kBf16HiMidWords * 4,
              "the plan's split bytes per stage");

// x of one stage: kBoxes tensor-copy boxes of 64 token rows x 128 bytes.
template <typename T>
struct XStage {
  static constexpr int kBoxes = sizeof(T) / 2;
  static constexpr int kBoxK = 128 / sizeof(T);
  static constexpr int kBoxBytes = kUnitTokens * 128;
  static constexpr int kBytes = kBoxes * kBoxBytes;
  static_assert(kBoxes * kBoxK == kStageK, "a stage is whole boxes");
};

template <typename T>
constexpr int StageBytes() {
  return XStage<T>::kBytes + kPlaneBytes;
}
template <typename T, int kStages>
constexpr int SmemBytes() {
  return kStages * StageBytes<T>() + kSwizzleAtomBytes;
}
static_assert(XStage<__half>::kBytes % kSwizzleAtomBytes == 0 &&
                  kBTileBytes % kSwizzleAtomBytes == 0,
              "operand tiles start on atoms");

// Staged k 8 quad .. 8 quad + 7 of 32-k block b of token row r.
template <typename T>
__device__ __forceinline__ void LoadEight(const char* stage, int r, int b,
                                          int quad, float (&v)[8]);
template <>
__device__ __forceinline__ void LoadEight<__half>(const char* stage, int r,
                                                  int b, int quad,
                                                  float (&v)[8]) {
  const uint4 w =
      *reinterpret_cast<const uint4*>(stage + SwizzledChunkAt(r, 4 * b + quad));
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 pair;
    memcpy(&pair, &words[i], sizeof(pair));
    const float2 f = __half22float2(pair);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
template <>
__device__ __forceinline__ void LoadEight<float>(const char* stage, int r,
                                                 int b, int quad,
                                                 float (&v)[8]) {
  const char* box = stage + b * XStage<float>::kBoxBytes;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float4 f = *reinterpret_cast<const float4*>(
        box + SwizzledChunkAt(r, 2 * quad + h));
    v[4 * h] = f.x;
    v[4 * h + 1] = f.y;
    v[4 * h + 2] = f.z;
    v[4 * h + 3] = f.w;
  }
}

// The TF32 operand of an x value: fp16 values are TF32 already.
template <typename T>
__device__ __forceinline__ uint32_t Tf32Operand(float v) {
  if constexpr (sizeof(T) == 2) {
    return __float_as_uint(v);
  } else {
    return __float_as_uint(RoundTf32(v));
  }
}

// phi' rounded to TF32 once for the launch, in the units' k order: a CTA
// per 64-k stage, a thread per 16-byte chunk of its two B tiles. Chunk c of
// a tile row is step c / 2, columns 4 (c % 2) .. 4 (c % 2) + 3: k = c + 8 i.
// Also zeroes the units' counter.
__global__ void __launch_bounds__(kBlocks* kTileLogits * 8)
    phi_tf32_planes_kernel(DevSpec s, const float* phi, const float* gamma,
                           char* planes, unsigned long long* unit_counter) {
  AllowDependentLaunch();  // fewer units than SMs may start beside it
  ZeroUnitCounter(unit_counter);
  const int c = threadIdx.x % 8;
  const int g = threadIdx.x / 8 % kTileLogits;
  const int b = threadIdx.x / (8 * kTileLogits);
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * kStageK + b * kBlockK;
  float w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t k = k0 + c + 8 * i;
    w[i] = g < s.N && k < s.K
               ? RoundTf32(__fmul_rn(phi[g * s.K + k],
                                     gamma != nullptr ? gamma[k] : 1.0f))
               : 0.0f;
  }
  *reinterpret_cast<float4*>(planes +
                             static_cast<int64_t>(blockIdx.x) * kPlaneBytes +
                             b * kBTileBytes + SwizzledChunkAt(g, c)) =
      make_float4(w[0], w[1], w[2], w[3]);
}

template <typename T, int kStages>
__global__ void __launch_bounds__(kUnitThreads, 4)
    tf32_wgmma_projection_kernel(const __grid_constant__ CUtensorMap x_map,
                                 DevSpec s, int64_t tokens,
                                 const char* __restrict__ planes,
                                 float* partial,
                                 unsigned long long* next_unit) {
  using X = XStage<T>;
  constexpr int kStageBytes = StageBytes<T>();
  extern __shared__ __align__(16) char tf32_proj_smem[];
  char* smem = AtomAligned(tf32_proj_smem);
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int grp = lane >> 2;
  const int quad = lane & 3;
  const int slab = 16 * warp;  // this warp's first token row
  const ChunkPlan plan = PlanChunks(s.K, s.N);
  const int64_t units = bf16_unit::UnitTiles<kUnitTokens>(tokens) * plan.chunks;
  const int width = s.N + 1;
  const uint64_t b_desc0 = SwizzledDescriptor(smem + X::kBytes);
  // The stages' copies complete on the ring's barriers.
  __shared__ __align__(8) uint64_t landed[kStages];
  CopyRing<kStages> ring{landed};
  if (tid == 0) ring.Init();
  __syncthreads();
  WaitForPrerequisiteGrid();  // the phi' planes

  // A unit's tile index counts halves of projection/forward/mma.cuh's tiles.
  ForEachUnit(units, 1, plan.chunks, next_unit, [&](MmaUnit unit) {
    const bf16_unit::UnitSpan u =
        bf16_unit::UnitSpanOf<kUnitTokens>(s, tokens, plan, unit);
    const char* plane_src = planes + u.kbeg / kStageK * int64_t{kPlaneBytes};

    auto load = [&](int st) {
      if (st >= u.stages || tid != 0) return;
      char* stage = smem + st % kStages * kStageBytes;
      uint64_t* bar = ring.Barrier(st);
      MbarrierArriveExpectBytes(bar, kStageBytes);
#pragma unroll
      for (int b = 0; b < X::kBoxes; ++b) {
        TmaLoadTile2d(stage + b * X::kBoxBytes, &x_map,
                      static_cast<int>(u.kbeg + st * kStageK + b * X::kBoxK),
                      static_cast<int>(u.m0), bar);
      }
      BulkLoad(stage + X::kBytes, plane_src + st * kPlaneBytes, kPlaneBytes,
               bar);
    };

    float acc[kTileLogits / 2], fresh[kTileLogits / 2];
    ZeroFill(acc);
    ZeroFill(fresh);
    // Rows grp and grp + 8, this quad's k: added over four stages, then
    // into the running sums with the logits.
    float squares[2] = {0.0f, 0.0f}, fresh_squares[2] = {0.0f, 0.0f};
    auto compute = [&](int st) {
      const char* stage = smem + st % kStages * kStageBytes;
      const uint64_t b_desc =
          DescriptorPlus(b_desc0, st % kStages * kStageBytes);
      uint32_t a[kBlocks][kSteps][4];
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
        float v[2][8];
        LoadEight<T>(stage, slab + grp, b, quad, v[0]);
        LoadEight<T>(stage, slab + grp + 8, b, quad, v[1]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            fresh_squares[h] = fmaf(v[h][e], v[h][e], fresh_squares[h]);
          }
        }
#pragma unroll
        for (int j = 0; j < kSteps; ++j) {
          a[b][j][0] = Tf32Operand<T>(v[0][2 * j]);
          a[b][j][1] = Tf32Operand<T>(v[1][2 * j]);
          a[b][j][2] = Tf32Operand<T>(v[0][2 * j + 1]);
          a[b][j][3] = Tf32Operand<T>(v[1][2 * j + 1]);
        }
      }
      WgmmaFence();
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
#pragma unroll
        for (int j = 0; j < kSteps; ++j) {
          WgmmaTf32RegA<kTileLogits>(
              fresh, a[b][j], DescriptorPlus(b_desc, b * kBTileBytes + 32 * j));
        }
      }
      WgmmaCommit();
    };

#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) load(st);
    for (int st = 0; st < u.stages; ++st) {
      ring.Wait(st);
      // Everyone is done with stage st - 1, whose slot is refilled now.
      __syncthreads();
      load(st + kStages - 1);
      compute(st);
      WgmmaWait<0>();
      // The tensor cores truncate against a long running sum: four stages
      // at a time, then rounded adds.
      if ((st & 3) == 3 || st == u.stages - 1) {
#pragma unroll
        for (int i = 0; i < kTileLogits / 2; ++i) {
          acc[i] += fresh[i];
          fresh[i] = 0.0f;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          squares[h] += fresh_squares[h];
          fresh_squares[h] = 0.0f;
        }
      }
    }

    float* out =
        partial +
        PartialOffset(tokens, plan.chunks, width, unit.tile / 2, unit.chunk) +
        unit.tile % 2 * kUnitTokens * width;
    bf16_unit::StoreLogits<kTileLogits>(acc, out, width, s.N, slab, u.rows, grp,
                                        quad);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = squares[h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int t = slab + grp + 8 * h;
      if (quad == 0 && t < u.rows) out[t * width + s.N] = sum;
    }
    // The next unit's first copies reuse the stages this one read.
    __syncthreads();
  });
  AllowDependentLaunch();  // the chunk sum may take this CTA's slot
}

// The planes run first, then the units (LaunchPersistentBlocksAfter says
// when beside them).
template <typename T, int kStages>
cudaError_t LaunchUnits(const CUtensorMap& x_map, const DevSpec& s,
                        int64_t tokens, const float* phi, const float* gamma,
                        char* planes, float* partial,
                        unsigned long long* next_unit, cudaStream_t stream) {
  const int64_t units =
      bf16_unit::UnitTiles<kUnitTokens>(tokens) * PlanChunks(s.K, s.N).chunks;
  return LaunchPersistentBlocksAfter(
      [&](unsigned long long* counter) {
        phi_tf32_planes_kernel<<<GridSize((s.K + kStageK - 1) / kStageK),
                                 kBlocks * kTileLogits * 8, 0, stream>>>(
            s, phi, gamma, planes, counter);
        return cudaGetLastError();
      },
      tf32_wgmma_projection_kernel<T, kStages>, kUnitThreads,
      /*equal_shares=*/true, units, SmemBytes<T, kStages>(), next_unit, stream,
      x_map, s, tokens, static_cast<const char*>(planes), partial);
}

template <typename T>
cudaError_t LaunchRing(bool deep_ring, const CUtensorMap& x_map,
                       const DevSpec& s, int64_t tokens, const float* phi,
                       const float* gamma, char* planes, float* partial,
                       unsigned long long* next_unit, cudaStream_t stream) {
  return deep_ring
             ? LaunchUnits<T, kDeepRing>(x_map, s, tokens, phi, gamma, planes,
                                         partial, next_unit, stream)
             : LaunchUnits<T, kRing>(x_map, s, tokens, phi, gamma, planes,
                                     partial, next_unit, stream);
}

}  // namespace

absl::Status LaunchTf32WgmmaProjectionPartials(
    const LayerSpec& spec, int64_t tokens, DType dtype, const void* x,
    const float* phi, const float* gamma, const ProjectionForwardPlan& plan,
    void* workspace, cudaStream_t stream) {
  const LaunchShape shape(spec, tokens, dtype);
  if (!plan.split_phi || dtype == DType::kBF16) {
    return absl::InternalError(absl::StrCat(
        "projection forward wgmma_tf32: fp16 / fp32 with phi' planes, ",
        ShapeText(shape)));
  }
  const bool half = dtype == DType::kF16;
  CUtensorMap x_map{};
  if (!EncodeSwizzledRowTiles(
          x,
          half ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
               : CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
          half ? 2 : 4, spec.K(), tokens,
          half ? XStage<__half>::kBoxK : XStage<float>::kBoxK, kUnitTokens,
          &x_map)) {
    return LaunchMmaForwardPartials(spec, tokens, dtype, x, phi, gamma, plan,
                                    workspace, stream);
  }
  const DevSpec s = MakeDevSpec(spec);
  char* base = static_cast<char*>(workspace);
  float* partial = reinterpret_cast<float*>(base);
  char* planes = base + plan.workspace.phi_split_offset;
  auto* next_unit = reinterpret_cast<unsigned long long*>(
      base + plan.workspace.counter_offset);
  const cudaError_t err =
      half ? LaunchRing<__half>(plan.deep_ring, x_map, s, tokens, phi, gamma,
                                planes, partial, next_unit, stream)
           : LaunchRing<float>(plan.deep_ring, x_map, s, tokens, phi, gamma,
                               planes, partial, next_unit, stream);
  MHC_CUDA_RETURN_IF_ERROR(err, "projection forward wgmma_tf32", shape);
  MHC_CUDA_CHECK_LAUNCH("projection forward wgmma_tf32", shape);
  return absl::OkStatus();
}

}  // namespace mhc::cuda
