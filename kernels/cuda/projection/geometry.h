// The tile sizes of the projection kernels that decide which kernel a launch
// takes and how much workspace it needs. Plain C++ without CUDA, so that the
// plan (plan.h) can be read on any host; each kernel file checks its own
// constants against these with static_asserts, or uses these directly.
#ifndef MHC_KERNELS_CUDA_PROJECTION_GEOMETRY_H_
#define MHC_KERNELS_CUDA_PROJECTION_GEOMETRY_H_

#include <cstddef>
#include <cstdint>

namespace mhc::cuda::proj {

// Rounds a byte count up so that every workspace slice stays 256-B aligned.
constexpr size_t AlignBytes(size_t bytes) {
  return (bytes + 255) & ~size_t{255};
}

// Tokens per parameter-gradient partial (common.cuh's kTokenChunk).
inline constexpr int64_t kTokenChunk = 1024;

// The SMs of the GPUs the small-batch rules are set for (H100, H200): a
// launch of fewer CTAs leaves SMs idle.
inline constexpr int64_t kTunedSms = 132;

// ---- Forward (forward/mma.cuh and the kernels that share its partials).

inline constexpr int kMmaBk = 64;           // k per pipeline stage
inline constexpr int kMmaTileTokens = 128;  // tokens per partial tile
inline constexpr int kLogitGroup = 24;      // logits of one mma.sync unit
inline constexpr int kBf16WideLogits = 80;  // logits of the bf16 wide unit
// Words of phi' split into bf16 terms per kMmaBk stage: hi + mid, and lo
// under IEEE.
inline constexpr int kBf16HiMidWords = 1536;
inline constexpr int kBf16StageWords = 2304;
inline constexpr size_t kUnitCounterBytes = 256;
// The bf16 warpgroup-mma units (forward/wgmma_bf16.cu): tokens per unit, and
// the stages a unit keeps in flight when there are fewer units than SMs.
inline constexpr int kBf16UnitTokens = 64;
inline constexpr int kBf16DeepStages = 8;

// The tensor cores accumulate a flush group of stages, which then goes into
// the unit's fp32 sums with one rounded add (they truncate against a long
// running sum): a chunk's sums are its groups' added in order, from zero.
inline constexpr int kFlushStages = 4;
constexpr int FlushGroups(int64_t span) {
  const int64_t group_k = int64_t{kMmaBk} * kFlushStages;
  return static_cast<int>((span + group_k - 1) / group_k);
}

// Small batches of the bf16 warpgroup-mma units split each unit's flush
// groups over a cluster of CTAs (up to the portable cluster size), each CTA
// taking GroupsPerCta consecutive groups on a ring of kSplitRingStages; the
// groups' sums meet in the cluster's shared memory and are added in order,
// so the bits are those of one CTA per unit. Sized for kSplitCtasPerSm CTAs
// per SM.
inline constexpr int kMaxUnitCtas = 8;
inline constexpr int kSplitRingStages = 4;
inline constexpr int kSplitCtasPerSm = 3;
constexpr int GroupsPerCta(int64_t chunk, int unit_ctas) {
  return (FlushGroups(chunk) + unit_ctas - 1) / unit_ctas;
}

// At most 16 chunks of about 2048 k (more for wide layers): enough units to
// fill the GPU at M = 2048, and the partials ((N + 1) floats per token and
// chunk) stay under 2.5 % of the bf16 x bytes once K >= 2048.
inline constexpr int kMaxChunks = 16;
inline constexpr int64_t kChunkTarget = 2048;

struct ChunkPlan {
  int chunks;
  int64_t chunk;  // multiple of kMmaBk
};

// Depends on K and N alone, so every token of a layer sees the same chunks.
constexpr ChunkPlan PlanChunks(int64_t K, int N) {
  const int64_t wide = int64_t{80} * (N + 1);  // 2.5 %: 4 (N + 1) / (2 k)
  const int64_t target = wide > kChunkTarget ? wide : kChunkTarget;
  int64_t c = (K + target - 1) / target;
  if (c < 1) c = 1;
  if (c > kMaxChunks) c = kMaxChunks;
  int64_t chunk = (K + c - 1) / c;
  chunk = (chunk + kMmaBk - 1) / kMmaBk * kMmaBk;
  ChunkPlan p{};
  p.chunk = chunk;
  p.chunks = static_cast<int>((K + chunk - 1) / chunk);
  return p;
}

constexpr int LogitGroups(int N) { return (N + kLogitGroup - 1) / kLogitGroup; }

// Logits of one unit of the mma.sync GEMM tiles (forward/mma_wide.cu): 4
// warps across, `tiles` tiles of 8 each.
constexpr int WideUnitLogits(int tiles) { return 4 * 8 * tiles; }
// The tile width of a layer: the fewest logits computed (groups x tiles),
// the wider tile on a tie.
constexpr int WideForwardTiles(int N) {
  const int groups3 = (N + WideUnitLogits(3) - 1) / WideUnitLogits(3);
  const int groups2 = (N + WideUnitLogits(2) - 1) / WideUnitLogits(2);
  return 3 * groups3 <= 2 * groups2 ? 3 : 2;
}

// Logits per unit of the TF32 wgmma tiles (forward/wgmma_tf32_wide.cu):
// the fewest computed (groups x width), the wider on a tie.
constexpr int WgmmaWideTileLogits(int N) {
  const int padded144 = (N + 143) / 144 * 144;
  const int padded96 = (N + 95) / 96 * 96;
  return padded144 <= padded96 ? 144 : 96;
}

// ---- Backward: the warpgroup-mma kernels of n = 4 and n = 8 layers.

inline constexpr int kWgmmaVec = 8;  // 16-bit elements per 16-byte copy
inline constexpr int kWgmmaN4StageTokens = 64;
inline constexpr int kWgmmaN4Chans = 32;  // channels of every stream per CTA
inline constexpr int kWgmmaN4CtasPerSm = 2;
// The n = 4 kernels split a chunk's stages over up to kMaxChunkCtas CTAs
// while the chunks leave SMs idle: as many as fit one per SM
// (kOneCtaPerSmSmem) where that is at least kMinSoloChunkCtas, else as many
// as fit two per SM. The last of a chunk's CTAs to finish adds their dphi,
// behind one arrival counter per (channel tile, chunk): a launch splits
// only while those number at most kSplitArrivals (docs/decisions.md).
inline constexpr int kMaxChunkCtas = 4;
inline constexpr int kMinSoloChunkCtas = 3;
inline constexpr int kSplitArrivals = static_cast<int>(kTunedSms);
inline constexpr int kWgmmaN8StageTokens = 32;

// ---- Backward: the register-resident mma.sync kernel (backward/mma.cuh).

inline constexpr int kDxCols = 128;  // columns of K per CTA
inline constexpr int kDxStageTokens = 32;
inline constexpr int kMaxSmemPerBlock = 227 * 1024;  // sm_90 opt-in limit
inline constexpr int kDxMaxTiles = 10;               // logit tiles of 8
// A dynamic shared-memory request that leaves an SM no room for a second CTA
// (each CTA also holds 1 KiB the driver reserves).
inline constexpr int kOneCtaPerSmSmem = kMaxSmemPerBlock / 2 + 1024;
// A launch of fewer CTAs (128 columns x a token chunk) than kTunedSms runs
// dphi and dx apart, dx in CTAs of at most this many tokens, halved down to
// one stage while they number fewer than kDxApartCtasPerSm per SM.
inline constexpr int kDxApartTokens = 4 * kDxStageTokens;
inline constexpr int kDxApartCtasPerSm = 1;
constexpr int DxTilesFor(int N) { return N <= 8 ? 1 : N <= 24 ? 3 : 10; }
// The n = 4 stream-major kernel with both terms sums each stage's terms
// once per channel for all four streams; their fp32 sums take the place of
// a fourth stage in the copy ring.
constexpr bool DxSumsTerms(int n, bool stream_major, bool aggregate,
                           bool residual) {
  return n == 4 && stream_major && aggregate && residual;
}
// The run-map build (rows off 16 bytes, backward/mma.cuh) lands each run
// with the 16 bytes before it and shifts x into a tile of its own, so two
// stages are what keeps two CTAs per SM.
constexpr int DxStages(bool summed_terms, bool run_maps = false) {
  return run_maps ? 2 : summed_terms ? 3 : 4;
}
// Floats per row of the summed terms: 128 columns and a pad that keeps the
// epilogue's pair loads and the summing threads' 16-byte stores free of bank
// conflicts.
inline constexpr int kDxTermsStride = kDxCols + 8;
constexpr int DhAFloats(int tiles) {
  return kDxStageTokens / 16 * tiles * 32 * 4;
}
constexpr int DhBFloats(int tiles) {
  return kDxStageTokens / 8 * tiles * 32 * 2;
}
// Elements of one staged activation row (esize bytes each): 128 columns and
// a pad.
constexpr int DxRowStride(int esize, int tiles) {
  return esize == 4             ? kDxCols + 4
         : tiles == kDxMaxTiles ? kDxCols + 24
                                : kDxCols + 8;
}
// Stream runs per staged 16-bit row whose extra words the pad holds.
constexpr int DxPadRuns(int esize, int tiles) {
  return (DxRowStride(esize, tiles) - kDxCols) * esize / 4;
}
constexpr int DxDyRow(int esize, int n) { return kDxCols / n + 16 / esize; }

// Shared memory of one CTA: the stages of x, dx_next (residual), dy
// (aggregate), dh, the dh fragments, dms, H_pre (aggregate) and R
// (residual), and with summed terms one stage's sums in fp32.
constexpr int DxSmemBytes(int esize, int n, int N, bool ieee, bool aggregate,
                          bool residual, bool summed_terms) {
  const int tiles = DxTilesFor(N);
  const int rows = DxStages(summed_terms) * kDxStageTokens;
  const int xb = rows * DxRowStride(esize, tiles) * esize;
  const int copies = ieee ? 2 : 1;
  return xb + (residual ? xb : 0) +
         (aggregate ? rows * DxDyRow(esize, n) * esize : 0) + rows * N * 4 +
         copies * DhAFloats(tiles) * 4 + copies * DhBFloats(tiles) * 4 +
         rows * 4 + (aggregate ? rows * n * 4 : 0) +
         (residual ? rows * n * n * 4 : 0) +
         (summed_terms ? kDxStageTokens * kDxTermsStride * 4 : 0);
}

// ---- Backward: the two-kernel GEMM form of wide layers (backward/wide.cu).

inline constexpr int kLogitPad = 32;      // logits padded to a multiple
inline constexpr int kLogitBlock = 32;    // logits per dx stage
inline constexpr int kWgmmaDxBlocks = 6;  // dx on wgmma from this many

// Channels per chunk of the fused terms: a sixteenth of C in whole 16-byte
// runs, so the scratch stays near 4 % of a bf16 request's activations.
constexpr int64_t TermsChunkChannels(int64_t C) {
  const int64_t width = ((C + 15) / 16 + 7) / 8 * 8;
  return width < C ? width : C;
}

}  // namespace mhc::cuda::proj

#endif  // MHC_KERNELS_CUDA_PROJECTION_GEOMETRY_H_
