// The mma variant of the projection forward: persistent CTAs over units of
// 128 tokens x a K chunk x one group of up to kLogitGroup logits
// (ProjectUnit, mma.cuh), their partials added per token in chunk order by
// the finish kernel. Determinism / batch invariance: a token's h depends on
// K and N alone (the chunks, the mma order); an integer counter hands out
// the units, and which CTA runs one never changes its bits.
#include "common.cuh"
#include "dispatch.cuh"
#include "overflow_repair.cuh"
#include "overflow_repair.h"
#include "projection/forward/mma.cuh"
#include "projection/forward/mma.h"

namespace mhc::cuda {
namespace {

// The plan sizes the phi' split from these.
static_assert(proj::kBf16HiMidWords == kBf16HiMidWords &&
                  proj::kBf16StageWords == kBf16StageWords,
              "the plan's geometry is the kernels'");

// Persistent CTAs over the units (tile, K chunk of PlanChunks, group of
// kLogitGroup phi rows; the groups of one tile and chunk run side by side,
// so x comes from HBM once and from L2 for the other groups), each unit's
// partials to its PartialOffset columns; group 0 also writes the sum of
// squares. With more units than CTAs, each CTA takes its next unit from
// next_unit when it finishes one: unit times vary with HBM traffic, and a
// fixed stride left the last wave waiting on the slowest CTAs. x is copied
// kXBytes at a time (the plan's x_copy_bytes), fixed per kernel so that the
// copy addresses are set once per unit.
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

// The projection op's overflow repair of token m, whose h row and mean
// square the finish kernel wrote: its float64 values rounded to fp32, as the
// fused ops keep them (the fp32 sum of squares overflows before the division
// by K where the mean square itself still fits). In place: the scaled
// values, then unscaled element by element. Out of line, so the chunk sum
// keeps its registers.
__device__ __noinline__ void RepairFinishedToken(const DevSpec& s,
                                                 const RepairSource& src,
                                                 int64_t m, float* h,
                                                 float* mean_square) {
  float* row = h + m * s.N;
  float ms_s = 0.0f;
  const int flag = RepairProjection(s, src, m, row, &ms_s);
  if (flag == 0) return;  // x is not finite: the fp32 values carry it
  StoreUnscaled(s, flag - kRepairFlagBias, row, ms_s, row, mean_square + m);
}

// A finish CTA holds whole tokens of N + 1 elements each: as many as
// kFinishThreads threads hold, or one token where a row is wider (at most
// kFinishMaxThreads: N = 288 at n = 16).
constexpr int kFinishThreads = 256;
constexpr int kFinishMaxThreads = 512;
static_assert(kMaxStreams * kMaxStreams + 2 * kMaxStreams + 1 <=
                  kFinishMaxThreads,
              "a token's row fits one CTA");
int FinishTokensPerCta(int width) {
  return width < kFinishThreads ? kFinishThreads / width : 1;
}

// A thread per element of a token's row (h, then the mean square); a CTA
// holds whole tokens. kChunkLoads: SumChunks' loads, no fewer than the
// layer's chunks (WithChunkLoads). kRepair (the projection op; the fused ops
// repair in their mixing kernels): a token whose row NeedsRepair gets
// RepairFinishedToken from its first thread, once the CTA's barrier has made
// the row's other elements visible to it. The flag is NeedsRepair's test,
// element by element; a CTA with no flagged element passes one barrier.
template <int kChunkLoads, bool kRepair>
__global__ void __launch_bounds__(kFinishMaxThreads)
    projection_finish_kernel(DevSpec s, int64_t tokens, const float* partial,
                             float* h, float* mean_square, RepairSource src) {
  WaitForPrerequisiteGrid();  // the units' partials
  const int chunks = PlanChunks(s.K, s.N).chunks;
  const int width = s.N + 1;
  const int t = static_cast<int>(threadIdx.x) / width;
  const int col = static_cast<int>(threadIdx.x) % width;
  const int64_t m = static_cast<int64_t>(blockIdx.x) * (blockDim.x / width) + t;
  bool flagged = false;
  if (m < tokens) {
    const float sum = SumChunks<kChunkLoads>(
        ChunksOf(partial, tokens, chunks, width, m), chunks, col);
    if (col < s.N) {
      h[m * s.N + col] = sum;
      flagged = NotFiniteBits(MagnitudeBits(sum));
    } else {
      const float ms = sum / static_cast<float>(s.K);
      mean_square[m] = ms;
      flagged = MeanSquareNeedsRepair(ms);
    }
  }
  if constexpr (kRepair) {
    if (!__syncthreads_or(flagged)) return;
    // The call takes its arguments by reference: from shared memory, since
    // a kernel parameter's address would copy it to every thread's stack at
    // the kernel's start, flagged or not.
    __shared__ int token_flagged[kFinishThreads];  // tokens of the CTA
    __shared__ DevSpec spec;
    __shared__ RepairSource from;
    if (col == 0) token_flagged[t] = 0;
    if (threadIdx.x == 0) {
      spec = s;
      from = src;
    }
    __syncthreads();
    if (flagged) token_flagged[t] = 1;
    __syncthreads();
    if (col == 0 && m < tokens && token_flagged[t] != 0) {
      RepairFinishedToken(spec, from, m, h, mean_square);
    }
  }
}

}  // namespace

absl::Status LaunchMmaForwardPartials(const LayerSpec& spec, int64_t tokens,
                                      DType dtype, const void* x,
                                      const float* phi, const float* gamma,
                                      const ProjectionForwardPlan& plan,
                                      void* workspace, cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(spec);
  const bool ieee = spec.matmul_precision == MatmulPrecision::kIeee;
  const LaunchShape shape(spec, tokens, dtype);
  char* base = static_cast<char*>(workspace);
  float* partial = reinterpret_cast<float*>(base);
  const bool vec_phi = plan.phi_vector;
  uint32_t* phi_split = nullptr;
  if (plan.split_phi) {
    phi_split =
        reinterpret_cast<uint32_t*>(base + plan.workspace.phi_split_offset);
    phi_split_kernel<<<GridSize((s.K + kMmaBk - 1) / kMmaBk), kMmaThreads, 0,
                       stream>>>(s, phi, gamma, ieee, vec_phi, phi_split);
    MHC_CUDA_CHECK_LAUNCH("projection forward mma (phi split)", shape);
  }
  auto* next_unit = reinterpret_cast<unsigned long long*>(
      base + plan.workspace.counter_offset);
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
      switch (plan.x_copy_bytes) {
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
  MHC_CUDA_RETURN_IF_ERROR(err, "projection forward mma", shape);
  MHC_CUDA_CHECK_LAUNCH("projection forward mma", shape);
  return absl::OkStatus();
}

absl::Status LaunchProjectionFinish(const LayerSpec& spec, int64_t tokens,
                                    DType dtype, const float* partial, float* h,
                                    float* mean_square,
                                    const RepairSource* repair,
                                    cudaStream_t stream) {
  if (tokens == 0) return absl::OkStatus();
  const DevSpec s = MakeDevSpec(spec);
  const int per_cta = FinishTokensPerCta(s.N + 1);
  const dim3 grid(GridSize((tokens + per_cta - 1) / per_cta));
  const dim3 block(static_cast<unsigned>(per_cta * (s.N + 1)));
  auto launch = [&](auto kernel) {
    return LaunchAfterPrevious(kernel, grid, block, 0, stream, s, tokens,
                               partial, h, mean_square,
                               repair != nullptr ? *repair : RepairSource{});
  };
  MHC_CUDA_RETURN_IF_ERROR(
      WithChunkLoads(
          PlanChunks(s.K, s.N).chunks,
          [&](auto loads) {
            constexpr int kLoads = decltype(loads)::value;
            return repair != nullptr
                       ? launch(projection_finish_kernel<kLoads, true>)
                       : launch(projection_finish_kernel<kLoads, false>);
          }),
      "projection forward (chunk sum)", LaunchShape(spec, tokens, dtype));
  MHC_CUDA_CHECK_LAUNCH("projection forward (chunk sum)",
                        LaunchShape(spec, tokens, dtype));
  return absl::OkStatus();
}

}  // namespace mhc::cuda
