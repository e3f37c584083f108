// The projection plan's two tables and what they compute from a launch:
// each row a condition and the variant it picks, tried in order.
#include "projection/plan.h"

#include <algorithm>
#include <cstdint>
#include <limits>

#include "projection/geometry.h"
#include "projection/run_maps.h"

namespace mhc::cuda {
namespace {

using proj::AlignBytes;
using BV = ProjectionBackwardVariant;
using FV = ProjectionForwardVariant;

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// What every row of either table reads, derived once per launch.
struct Launch {
  const LayerSpec& spec;
  DType dtype;
  int64_t tokens;
  int N;
  int64_t K;
  int esize;  // bytes per activation element
  bool ieee;
  bool bf16;
  bool sixteen_bit;
  bool stream_major;
};

Launch LaunchOf(const LayerSpec& spec, DType dtype, int64_t tokens) {
  return {spec,
          dtype,
          tokens,
          static_cast<int>(spec.NumLogits()),
          spec.K(),
          static_cast<int>(DTypeSize(dtype)),
          spec.matmul_precision == MatmulPrecision::kIeee,
          dtype == DType::kBF16,
          dtype != DType::kF32,
          spec.layout == Layout::kStreamMajor};
}

// The widest copy (16, 8 or 4 bytes; 0: element copies) every x row takes:
// an odd C still leaves rows of 4 C elements 8-byte aligned and rows of 2 C
// elements 4-byte aligned.
int XCopyBytes(const Launch& l, int x_alignment) {
  for (int bytes : {16, 8, 4}) {
    if (l.K % (bytes / l.esize) == 0 && x_alignment >= bytes) return bytes;
  }
  return 0;
}

PlanExample Example(int n, int64_t hidden, DType dtype = DType::kBF16,
                    MatmulPrecision precision = MatmulPrecision::kTf32) {
  PlanExample e;
  e.n = n;
  e.hidden = hidden;
  e.dtype = dtype;
  e.precision = precision;
  return e;
}
PlanExample Static(PlanExample e) {
  e.dynamic = false;
  return e;
}
PlanExample WithAggregate(PlanExample e) {
  e.terms.aggregate = true;
  return e;
}

// ---- Forward.

struct ForwardCase {
  Launch l;
  const ProjectionForwardAlignment& a;
  int x_copy;        // XCopyBytes
  bool phi_vector;   // phi and gamma rows by 16-byte loads
  bool vector_rows;  // x, phi and gamma rows of whole 16-byte vectors
};

struct ForwardRule {
  ProjectionForwardRow row;
  bool (*holds)(const ForwardCase& c);
};

// The forward table, first row that holds wins.
const std::vector<ForwardRule>& ForwardRules() {
  static const auto* rules = new std::vector<ForwardRule>{
      {{FV::kNone, "static layer (no projection)", "-", "",
        Static(Example(4, 256))},
       [](const ForwardCase& c) { return !c.l.spec.dynamic; }},
      {{FV::kWgmmaBf16,
        "bf16, `N <= 24` (mHC `n <= 4`, every HEAD), `x` rows allow 16-, 8- "
        "or 4-byte copies",
        "kernels/cuda/projection/forward/wgmma_bf16.cu",
        "64-token units on `wgmma.m64n24k16`; `x` by tensor copies where rows "
        "sit on 16 bytes (three stages in flight; units fewer than SMs split "
        "their 256-k flush groups over a cluster of up to 8 CTAs, whose sums "
        "meet in shared memory in group order, or where a chunk is one group "
        "take eight stages); rows 8 bytes off 16 (`M >= 2`) by tensor "
        "copies of the even rows and of token pairs, the odd tokens' boxes 4 "
        "elements early and A read from either box into registers; else 8- "
        "/ 4-byte `cp.async` pieces; `phi'` split into bf16 terms once per "
        "launch, copied in beside `x`",
        Example(4, 256)},
       [](const ForwardCase& c) {
         return c.l.bf16 && proj::LogitGroups(c.l.N) == 1 && c.x_copy != 0;
       }},
      {{FV::kWgmmaTf32,
        "fp16 / fp32, TF32, `N <= 24` (mHC `n <= 4`, every HEAD), `x` rows on "
        "16 bytes",
        "kernels/cuda/projection/forward/wgmma_tf32.cu",
        "64-token units on `wgmma.m64n24k8` with A from registers: `x` by "
        "tensor copies, read from the staged tile by each thread as its "
        "fragments (fp32 rounded to TF32); `phi'` rounded to TF32 once per "
        "launch in the fragments' k order, copied in beside `x`",
        Example(4, 256, DType::kF16)},
       [](const ForwardCase& c) {
         return !c.l.bf16 && !c.l.ieee && proj::LogitGroups(c.l.N) == 1 &&
                c.x_copy == 16;
       }},
      {{FV::kWgmmaBf16Wide,
        "bf16, `48 < N <= 80` (mHC `n = 7, 8`), `x` rows allow copies, "
        "`phi` / `gamma` on 16 bytes",
        "kernels/cuda/projection/forward/wgmma_bf16_wide.cu",
        "128-token units of 80 logits on `wgmma`; a third warpgroup copies raw "
        "`phi` and splits it one stage ahead",
        Example(8, 256)},
       [](const ForwardCase& c) {
         return c.l.bf16 && c.l.N > 2 * proj::kLogitGroup &&
                c.l.N <= proj::kBf16WideLogits && c.x_copy != 0 && c.phi_vector;
       }},
      {{FV::kWgmmaTf32Wide,
        "`N > 48` (mHC `n >= 7`), TF32, `x`, `phi`, `gamma` rows of whole "
        "16-byte vectors",
        "kernels/cuda/projection/forward/wgmma_tf32_wide.cu",
        "128 tokens x 96 or 144 logits on `wgmma`, `x` converted to TF32 in a "
        "swizzled tile; `phi'` rounded to TF32 once per launch at one logit "
        "group or from 264 units (a wave) where the rounded rows fit the "
        "forward scratch's share of `x` (large M), else by each unit in "
        "place; 16-bit `x` with fewer units than SMs: a ring of 7-8 stages",
        Example(8, 256, DType::kF32)},
       [](const ForwardCase& c) {
         return c.l.N > 2 * proj::kLogitGroup && !c.l.ieee && c.vector_rows;
       }},
      // The wide rows start past two logit groups: n = 5, 6 layers (35, 48
      // logits) measured as fast or faster on two mma groups than on the
      // GEMM tiles.
      {{FV::kMmaWide, "`N > 48` otherwise (IEEE, rows off 16 bytes)",
        "kernels/cuda/projection/forward/mma_wide.cu",
        "GEMM tiles of 128 tokens x 64 or 96 logits on `mma.sync`",
        Example(8, 256, DType::kF32, MatmulPrecision::kIeee)},
       [](const ForwardCase& c) { return c.l.N > 2 * proj::kLogitGroup; }},
      {{FV::kMma,
        "everything else: `N <= 48` (fp16 / fp32 under IEEE or off 16 bytes, "
        "mHC `n = 5, 6`, bf16 rows without a copy width)",
        "kernels/cuda/projection/forward/mma.cu",
        "units of 128 tokens x a K chunk x up to 24 logits on `mma.sync` "
        "(bf16 against the `phi'` split, else TF32), the copy width fixed per "
        "kernel",
        Example(4, 256, DType::kF16, MatmulPrecision::kIeee)},
       [](const ForwardCase&) { return true; }},
  };
  return *rules;
}

// From this many units (token tiles x K chunks x logit groups: a wave of
// their two CTAs per SM) the wide TF32 units of several logit groups take
// phi' rounded once per launch.
constexpr int64_t kRoundPhiOnceUnits = 2 * proj::kTunedSms;

// The forward's scratch contract: at most this share of the bytes a request
// reads and writes, which x alone bounds from below; from n = 10 the pre
// forward keeps more per-token values beside the partials.
double ForwardScratchShare(int n) { return n <= 9 ? 0.05 : 0.07; }

// Whether `bytes` more keep the forward scratch of `partials` within its
// share of x: the pre forward's kept per-token values (H_pre, and for the
// mixing run as ops h, the mean square and the H_res logits) counted too,
// so that both the projection and the pre forward stay inside.
bool FitsForwardShare(const Launch& l, size_t partials, size_t bytes) {
  const int64_t n = l.spec.n;
  // Four slices, each aligned up to 256 bytes.
  const double kept = 4.0 * l.tokens * (n + l.N + 1 + n * n) + 4 * 256.0;
  const double x = static_cast<double>(l.tokens) * l.K * l.esize;
  return static_cast<double>(partials + bytes) + kept +
             proj::kUnitCounterBytes <=
         ForwardScratchShare(static_cast<int>(n)) * x;
}

// Logit groups and units (token tiles x K chunks x groups) of the
// wgmma_tf32_wide units.
int WideGroups(const Launch& l) {
  const int tile = proj::WgmmaWideTileLogits(l.N);
  return (l.N + tile - 1) / tile;
}
int64_t WideUnits(const Launch& l) {
  return (l.tokens + proj::kMmaTileTokens - 1) / proj::kMmaTileTokens *
         proj::PlanChunks(l.K, l.N).chunks * WideGroups(l);
}

ProjectionForwardWorkspaceLayout ForwardWorkspace(const Launch& l) {
  ProjectionForwardWorkspaceLayout w;
  if (!l.spec.dynamic) return w;
  const int chunks = proj::PlanChunks(l.K, l.N).chunks;
  w.partials = AlignBytes(sizeof(float) * l.tokens * chunks * (l.N + 1));
  // bf16 layers of one group split phi' (96 B per k, 144 under IEEE) once
  // per launch at every batch: split per tile, each stage waited on its own
  // phi fetch, a fixed cost per unit that small batches could not hide.
  // fp16 / fp32 ones under TF32 round it once into the same 96 B per k.
  if ((l.bf16 || !l.ieee) && proj::LogitGroups(l.N) == 1 && l.tokens > 0) {
    const int words = l.ieee ? proj::kBf16StageWords : proj::kBf16HiMidWords;
    w.phi_split = AlignBytes(sizeof(uint32_t) * words *
                             ((l.K + proj::kMmaBk - 1) / proj::kMmaBk));
  }
  // TF32 layers past two logit groups that the bf16 wide unit does not take
  // round phi' once per launch for the wgmma_tf32_wide units, which else
  // round each stage of it in shared memory, once per unit: at one logit
  // group (n = 7-11) at every M, at more from kRoundPhiOnceUnits units;
  // below that the units leave SMs idle and rounding once measured slower
  // (docs/decisions.md). The rounded rows are parameter-sized, so they are
  // taken only where they fit the forward scratch's share (large M). Sized
  // whatever the alignment, which picks mma_wide instead for rows off 16
  // bytes, so that the workspace depends on the layer and M alone.
  const size_t rounded = AlignBytes(sizeof(float) * l.N * l.K);
  if (!l.ieee && l.N > 2 * proj::kLogitGroup &&
      !(l.bf16 && l.N <= proj::kBf16WideLogits) && l.tokens > 0 &&
      (WideGroups(l) == 1 || WideUnits(l) >= kRoundPhiOnceUnits) &&
      FitsForwardShare(l, w.partials + w.phi_split, rounded)) {
    w.phi_rounded = rounded;
  }
  w.phi_split_offset = w.partials;
  w.phi_rounded_offset = w.phi_split_offset + w.phi_split;
  w.counter_offset = w.phi_rounded_offset + w.phi_rounded;
  w.total = w.counter_offset + proj::kUnitCounterBytes;
  return w;
}

// ---- Backward.

struct BackwardCase {
  Launch l;
  const ProjectionBackwardAlignment& a;
  DxTerms terms;
};

bool PowerOfTwoStreams(int n) {
  return n >= 1 && n <= 16 && (n & (n - 1)) == 0;
}

// The layers the register-resident mma.sync backward is built for: whole
// channels per CTA (128 / n columns of each stream), at most 80 logits.
bool MmaDxSuitsLayer(const LayerSpec& spec) {
  return spec.dynamic && PowerOfTwoStreams(spec.n) &&
         spec.NumLogits() <= proj::kDxMaxTiles * 8;
}

// The CTAs of a dx kernel that tiles the layer's channels by `channels` per
// stream and M tokens by `chunk`.
int64_t DxTileCtas(const LayerSpec& spec, int64_t tokens, int64_t channels,
                   int64_t chunk) {
  return (spec.hidden + channels - 1) / channels *
         ((tokens + chunk - 1) / chunk);
}

// The mma kernel's CTAs: channel tiles of 128 / n per stream.
int64_t MmaDxCtas(const LayerSpec& spec, int64_t tokens, int64_t chunk) {
  return DxTileCtas(spec, tokens, proj::kDxCols / spec.n, chunk);
}

// The warpgroup-mma kernels' shared conditions: one mHC layer shape,
// stream-major, 16-bit activations under TF32, whole 16-byte channel runs,
// x, dx and dh on 16 bytes. Every per-token run is a multiple of 16 bytes
// and dms is copied by elements, so M never matters.
bool WgmmaShape(const BackwardCase& c, int n, int64_t stage_tokens) {
  const LayerSpec& s = c.l.spec;
  return s.dynamic && s.kind == LayerKind::kMhc && s.n == n &&
         c.l.stream_major && !c.l.ieee && c.l.sixteen_bit &&
         s.hidden % proj::kWgmmaVec == 0 && c.l.tokens > 0 && c.a.x >= 16 &&
         c.a.dx >= 16 && c.a.dh >= 16 && c.l.K <= kInt32Max / stage_tokens;
}

// The mma kernel's grid (128 columns x a token chunk per CTA) below two
// CTAs per SM: there its walk of each chunk (or of dphi and dx apart) is
// latency bound and the warpgroup kernel with the terms is faster; above it
// the mma kernel is (docs/decisions.md). Both give a token the same dx bits,
// so a choice by M keeps dx batch invariant.
bool FewMmaDxTiles(const BackwardCase& c) {
  return MmaDxCtas(c.l.spec, c.l.tokens, proj::kTokenChunk) <
         2 * proj::kTunedSms;
}

bool WideDxOnWgmma(const Launch& l) {
  const int padded =
      (l.N + proj::kLogitPad - 1) / proj::kLogitPad * proj::kLogitPad;
  return !l.ieee && padded / proj::kLogitBlock >= proj::kWgmmaDxBlocks;
}

struct BackwardRule {
  ProjectionBackwardRow row;
  bool (*holds)(const BackwardCase& c);
};

// The backward table (dx and the dphi partials), first row that holds wins.
// Each warpgroup-mma row's requests are a subset of the mma row's, so which
// of the first four rows runs never changes the workspace.
const std::vector<BackwardRule>& BackwardRules() {
  static const auto* rules = new std::vector<BackwardRule>{
      {{BV::kWgmmaN4,
        "mHC `n = 4`, stream-major, TF32, bf16 / fp16, `C % 8 == 0`, `x`, "
        "`dx`, `dh` on 16 bytes, no fused terms",
        "kernels/cuda/projection/backward/wgmma_n4.cu",
        "64-token stages, `dx` as the `wgmma` result written over `x` in the "
        "staged tile and stored in whole rows, `dphi^T` on `wgmma`; while "
        "the chunks' CTAs leave SMs idle, a chunk's stages split over up "
        "to four CTAs, one or two per SM, the last to finish adding their "
        "`dphi` (`chunk_ctas`); with one token chunk (`M <= 1024`) the "
        "kernel adds `dphi` into the gradients itself (`grads_in_kernel`), "
        "with no reduction launch",
        Example(4, 256)},
       [](const BackwardCase& c) {
         return !c.terms.aggregate && !c.terms.residual &&
                WgmmaShape(c, 4, proj::kWgmmaN4StageTokens);
       }},
      {{BV::kWgmmaN4Terms,
        "mHC `n = 4`, stream-major, TF32, bf16 / fp16, `C % 8 == 0`, every "
        "tensor on 16 bytes, the aggregate term (the residual one optional), "
        "fewer than two `mma` CTAs per SM (`ceil(C / 32) x ceil(M / 1024) < "
        "264`)",
        "kernels/cuda/projection/backward/wgmma_n4_terms.cu",
        "`wgmma_n4`'s tiles with the terms' tiles in one buffer refilled a "
        "stage ahead; each warpgroup's `dx` covers 16 channels of all four "
        "streams, so a thread reads each `dx_next` pair once for four "
        "outputs; chunks split over up to four CTAs, and one chunk's `dphi` "
        "(with the overflow repair's pass) added in the kernel, as "
        "`wgmma_n4`'s",
        WithAggregate(Example(4, 256))},
       [](const BackwardCase& c) {
         const auto& a = c.a;
         return c.terms.aggregate && a.h_pre >= 16 && a.dy >= 16 &&
                (!c.terms.residual || (a.r >= 16 && a.dx_next >= 16)) &&
                WgmmaShape(c, 4, proj::kWgmmaN4StageTokens) && FewMmaDxTiles(c);
       }},
      {{BV::kWgmmaN8,
        "mHC `n = 8`, stream-major, TF32, bf16 / fp16, `C % 8 == 0`, every "
        "tensor on 16 bytes (residual term only with the aggregate one)",
        "kernels/cuda/projection/backward/wgmma_n8.cu",
        "128 columns x 32-token stages, `dx^T` and `dphi^T` on `wgmma`, "
        "`phi'^T` "
        "in registers, the epilogue beside the next stage's `wgmma`s",
        Example(8, 256)},
       [](const BackwardCase& c) {
         const auto& a = c.a;
         return (!c.terms.residual || c.terms.aggregate) && a.h_pre >= 16 &&
                a.dy >= 16 && a.r >= 16 && a.dx_next >= 16 &&
                WgmmaShape(c, 8, proj::kWgmmaN8StageTokens);
       }},
      {{BV::kMma,
        "dynamic, `n` a power of two, `N <= 80` (mHC `n <= 8`, HEAD any "
        "`n`), the tile fits shared memory",
        "kernels/cuda/projection/backward/mma.cu",
        "reads `x` once per token chunk on `mma.sync`, `phi'` and `dphi` in "
        "registers; the `n = 4` stream-major layer's stages (both terms, "
        "16-bit rows and runs on 16 bytes) by tensor copies into swizzled "
        "tiles, rows off 16 bytes on 16-byte bases (`M >= 8`) by tensor "
        "copies of each row residue, shifted on chip, else through realigned "
        "`cp.async` slots; "
        "fewer CTAs than SMs: `dphi` alone, then `dx` over chunks of 128 "
        "tokens or fewer (a CTA per SM where M allows)",
        Example(4, 256, DType::kF32)},
       [](const BackwardCase& c) {
         const bool summed = proj::DxSumsTerms(
             c.l.spec.n, c.l.stream_major, c.terms.aggregate, c.terms.residual);
         return MmaDxSuitsLayer(c.l.spec) &&
                c.l.K <= kInt32Max / proj::kDxStageTokens &&
                proj::DxSmemBytes(c.l.esize, c.l.spec.n, c.l.N, c.l.ieee,
                                  c.terms.aggregate, c.terms.residual,
                                  summed) <= proj::kMaxSmemPerBlock;
       }},
      {{BV::kWgmmaWide,
        "other dynamic layers, TF32, at least six 32-logit blocks (mHC `n >= "
        "12`)",
        "kernels/cuda/projection/backward/wide.cu",
        "operands rounded once into scratch, then `dx` as a GEMM on runs of K "
        "on `wgmma`, and `dphi` per token chunk",
        Example(12, 64)},
       [](const BackwardCase& c) {
         return c.l.spec.dynamic && c.l.K <= kInt32Max && WideDxOnWgmma(c.l);
       }},
      {{BV::kMmaWide,
        "other dynamic layers (mHC `n = 3, 5-7, 9-11`; IEEE; fp32 `n = 8` "
        "with the residual term)",
        "kernels/cuda/projection/backward/wide.cu",
        "as `wgmma_wide` with the `dx` GEMM on `mma.sync`", Example(3, 256)},
       [](const BackwardCase& c) {
         return c.l.spec.dynamic && c.l.K <= kInt32Max;
       }},
      {{BV::kFma, "no projection (static layers' fused terms), or `K > 2^31`",
        "kernels/cuda/projection/backward/fma.cu", "FFMA, a thread per `k`",
        WithAggregate(Static(Example(4, 256)))},
       [](const BackwardCase&) { return true; }},
  };
  return *rules;
}

bool IsWide(ProjectionBackwardVariant v) {
  return v == BV::kMmaWide || v == BV::kWgmmaWide;
}

ProjectionBackwardWorkspaceLayout BackwardWorkspace(const Launch& l, bool wide,
                                                    DxTerms terms) {
  ProjectionBackwardWorkspaceLayout w;
  w.phi_chunk_tokens = PhiChunkTokens(l.spec);
  w.phi_chunks = (l.tokens + w.phi_chunk_tokens - 1) / w.phi_chunk_tokens;
  w.dphi_partials = AlignBytes(sizeof(float) * w.phi_chunks * l.N * l.K);
  if (wide && l.tokens > 0) {
    const int64_t padded =
        (l.N + proj::kLogitPad - 1) / proj::kLogitPad * proj::kLogitPad;
    const int64_t padded_tokens = (l.tokens + 7) / 8 * 8;
    w.parts = l.ieee ? 2 : 1;
    w.part_dh = AlignBytes(sizeof(float) * l.tokens * padded);
    w.part_dh_t = AlignBytes(sizeof(float) * padded * padded_tokens);
    w.part_phi_t = AlignBytes(sizeof(float) * l.K * padded);
    if (terms.residual) {
      w.terms = AlignBytes(sizeof(float) * l.tokens * l.spec.n *
                           proj::TermsChunkChannels(l.spec.hidden));
    }
    w.wide_scratch =
        w.parts * (w.part_dh + w.part_dh_t + w.part_phi_t) + w.terms;
  }
  w.split_partials = SplitPartialBytes(l.spec, l.tokens);
  w.total = w.dphi_partials + w.split_partials + w.wide_scratch;
  return w;
}

}  // namespace

absl::string_view ToString(ProjectionForwardVariant variant) {
  switch (variant) {
    case FV::kNone:
      return "none";
    case FV::kMma:
      return "mma";
    case FV::kMmaWide:
      return "mma_wide";
    case FV::kWgmmaBf16:
      return "wgmma_bf16";
    case FV::kWgmmaBf16Wide:
      return "wgmma_bf16_wide";
    case FV::kWgmmaTf32Wide:
      return "wgmma_tf32_wide";
    case FV::kWgmmaTf32:
      return "wgmma_tf32";
  }
  return "unknown";
}

absl::string_view ToString(ProjectionBackwardVariant variant) {
  switch (variant) {
    case BV::kWgmmaN4:
      return "wgmma_n4";
    case BV::kWgmmaN4Terms:
      return "wgmma_n4_terms";
    case BV::kWgmmaN8:
      return "wgmma_n8";
    case BV::kMma:
      return "mma";
    case BV::kMmaWide:
      return "mma_wide";
    case BV::kWgmmaWide:
      return "wgmma_wide";
    case BV::kFma:
      return "fma";
  }
  return "unknown";
}

absl::string_view ToString(ProjectionDphiVariant variant) {
  switch (variant) {
    case ProjectionDphiVariant::kNone:
      return "none";
    case ProjectionDphiVariant::kWithDx:
      return "with_dx";
    case ProjectionDphiVariant::kMmaWide:
      return "mma_wide";
    case ProjectionDphiVariant::kWgmmaWide:
      return "wgmma_wide";
  }
  return "unknown";
}

int AddressAlignment(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  int alignment = 1;
  while (alignment < 16 && address % (2 * alignment) == 0) alignment *= 2;
  return alignment;
}

ProjectionForwardPlan PlanProjectionForward(
    const LayerSpec& spec, DType dtype, int64_t tokens,
    const ProjectionForwardAlignment& alignment) {
  const Launch l = LaunchOf(spec, dtype, tokens);
  const bool params16 = alignment.phi >= 16 && alignment.gamma >= 16;
  const ForwardCase c{
      l, alignment, XCopyBytes(l, alignment.x), l.K % 4 == 0 && params16,
      l.K % (16 / l.esize) == 0 && alignment.x >= 16 && params16};
  ProjectionForwardPlan plan;
  const auto& rules = ForwardRules();
  for (size_t i = 0; i < rules.size(); ++i) {
    if (!rules[i].holds(c)) continue;
    plan.variant = rules[i].row.variant;
    plan.row = static_cast<int>(i);
    break;
  }
  plan.x_copy_bytes = c.x_copy;
  plan.phi_vector = c.phi_vector;
  plan.vector_rows = c.vector_rows;
  if (plan.variant == FV::kMmaWide) {
    plan.tile_logits = proj::WideUnitLogits(proj::WideForwardTiles(l.N));
  } else if (plan.variant == FV::kWgmmaTf32Wide) {
    plan.tile_logits = proj::WgmmaWideTileLogits(l.N);
    // Fewer units than SMs: one CTA per SM walks a whole K chunk, its
    // copies in flight bounded by the ring (the same bits at any depth).
    // 16-bit x only: fp32's stages are larger, and its deeper ring measured
    // no faster (docs/decisions.md).
    plan.deep_ring = WideUnits(l) < proj::kTunedSms && l.esize == 2;
  }
  plan.workspace = ForwardWorkspace(l);
  plan.split_phi = plan.workspace.phi_split > 0;
  // Rows 8 bytes off 16 alternate with rows on 16 bytes, and two rows span
  // a multiple of 16 bytes: tensor maps over the even rows and over token
  // pairs reach them.
  plan.pair_rows = plan.variant == FV::kWgmmaBf16 && plan.x_copy_bytes == 8 &&
                   alignment.x >= 16 && tokens >= 2;
  // Fewer units than SMs hold one per SM: a deeper ring keeps the one CTA's
  // copies in flight (a stage's arithmetic never depends on the ring).
  if ((plan.variant == FV::kWgmmaBf16 || plan.variant == FV::kWgmmaTf32) &&
      plan.x_copy_bytes == 16) {
    const proj::ChunkPlan chunks = proj::PlanChunks(l.K, l.N);
    const int64_t units = (tokens + proj::kBf16UnitTokens - 1) /
                          proj::kBf16UnitTokens * chunks.chunks;
    plan.deep_ring = units < proj::kTunedSms;
    // bf16: the units' flush groups over clusters instead, as many CTAs
    // per unit as the split's slots hold, with no rank left idle.
    if (plan.deep_ring && plan.variant == FV::kWgmmaBf16 && units > 0) {
      const int groups = proj::FlushGroups(chunks.chunk);
      const int64_t fit = proj::kSplitCtasPerSm * proj::kTunedSms / units;
      const int most = static_cast<int>(
          std::min<int64_t>({fit, proj::kMaxUnitCtas, groups}));
      if (most > 1) {
        const int per_cta = proj::GroupsPerCta(chunks.chunk, most);
        plan.unit_ctas = (groups + per_cta - 1) / per_cta;
        plan.deep_ring = false;
      }
    }
  }
  return plan;
}

ProjectionForwardWorkspaceLayout PlanProjectionForwardWorkspace(
    const LayerSpec& spec, DType dtype, int64_t tokens) {
  return ForwardWorkspace(LaunchOf(spec, dtype, tokens));
}

ProjectionBackwardWorkspaceLayout PlanProjectionBackwardWorkspace(
    const LayerSpec& spec, DType dtype, int64_t tokens, DxTerms terms) {
  return PlanProjectionBackward(spec, dtype, tokens, {}, terms).workspace;
}

ProjectionBackwardPlan PlanProjectionBackward(
    const LayerSpec& spec, DType dtype, int64_t tokens,
    const ProjectionBackwardAlignment& alignment, DxTerms terms) {
  const Launch l = LaunchOf(spec, dtype, tokens);
  const BackwardCase c{l, alignment, terms};
  ProjectionBackwardPlan plan;
  const auto& rules = BackwardRules();
  for (size_t i = 0; i < rules.size(); ++i) {
    if (!rules[i].holds(c)) continue;
    plan.variant = rules[i].row.variant;
    plan.row = static_cast<int>(i);
    break;
  }
  plan.terms = terms.residual ? 2 : terms.aggregate ? 1 : 0;
  const auto& a = alignment;
  // mma: vector rows where every staged row segment is 16-byte aligned
  // (whole vectors per channel run, C and the CTA width, and aligned
  // bases); slots where tensors are aligned to their elements and, for
  // 16-bit stream-major tiles, the row pad holds a word per stream run.
  const int width = 16 / l.esize;
  const bool rows16 = a.x >= 16 && a.dx >= 16 && a.dy >= 16 && a.dx_next >= 16;
  const bool runs_fit = !l.stream_major || l.esize == 4 ||
                        spec.n <= proj::DxPadRuns(2, proj::DxTilesFor(l.N));
  if (spec.hidden % width == 0 && (proj::kDxCols / spec.n) % width == 0 &&
      rows16) {
    plan.row_copy = DxRowCopy::kVector;
  } else if (a.x >= l.esize && a.dy >= l.esize && a.dx_next >= l.esize &&
             runs_fit) {
    plan.row_copy = DxRowCopy::kSlots;
  }
  plan.runs16 = a.dh >= 16 && a.dms >= 16 && a.h_pre >= 16 && a.r >= 16;
  // The summed build's rows off 16 bytes: tensor copies of each row
  // residue where the bases allow the maps (dx leaves by elements).
  if (plan.row_copy == DxRowCopy::kSlots && plan.variant == BV::kMma &&
      l.esize == 2 && plan.runs16 && a.x >= 16 && a.dy >= 16 &&
      a.dx_next >= 16 && tokens >= proj::kDxRunMapMinTokens &&
      proj::DxSumsTerms(spec.n, l.stream_major, terms.aggregate,
                        terms.residual)) {
    plan.row_copy = DxRowCopy::kRunMaps;
  }
  // wide: with either term, stream major, vectors must not straddle
  // streams (nor, with the residual, chunks).
  plan.vector_x = l.K % width == 0 && a.x >= 16;
  const bool any_term = terms.aggregate || terms.residual;
  plan.vector_dx = plan.vector_x &&
                   (!l.stream_major || !any_term || spec.hidden % width == 0) &&
                   a.dx >= 16 && a.dy >= 16;
  plan.fma_vector =
      l.K % 2 == 0 && a.x >= 16 && a.dx >= 16 && a.phi >= 16 && a.gamma >= 16
          ? 2
          : 1;
  if (!spec.dynamic) {
    plan.dphi = ProjectionDphiVariant::kNone;
  } else if (IsWide(plan.variant)) {
    // TF32 with vector x rows: dphi on warpgroup mmas.
    plan.dphi = !l.ieee && plan.vector_x ? ProjectionDphiVariant::kWgmmaWide
                                         : ProjectionDphiVariant::kMmaWide;
  } else {
    plan.dphi = ProjectionDphiVariant::kWithDx;
  }
  // mma: each CTA walks its token chunk in order (that order is each
  // column's dphi sum), so with few chunks most SMs idle; dx alone then
  // takes finer chunks: the largest that gives every SM a CTA, down to one
  // stage.
  if (plan.variant == BV::kMma && tokens > proj::kDxApartTokens) {
    auto ctas = [&](int64_t chunk) { return MmaDxCtas(spec, tokens, chunk); };
    if (ctas(proj::kTokenChunk) < proj::kTunedSms) {
      int chunk = proj::kDxApartTokens;
      while (chunk > proj::kDxStageTokens &&
             ctas(chunk) < proj::kDxApartCtasPerSm * proj::kTunedSms) {
        chunk /= 2;
      }
      plan.dx_apart_tokens = chunk;
    }
  }
  if (plan.variant == BV::kWgmmaN4 || plan.variant == BV::kWgmmaN4Terms) {
    plan.chunk_ctas = ChunkCtasFor(spec, tokens);
  }
  plan.workspace = BackwardWorkspace(l, IsWide(plan.variant), terms);
  plan.grads_in_kernel =
      (plan.variant == BV::kWgmmaN4 || plan.variant == BV::kWgmmaN4Terms) &&
      plan.workspace.phi_chunks == 1;
  return plan;
}

// A CTA walks its chunk's stages one after another on one SM, so with fewer
// CTAs than the SMs hold most SMs idle: the chunk's stages split over
// several (one stage each at least).
int ChunkCtasFor(const LayerSpec& spec, int64_t tokens) {
  if (!spec.dynamic || spec.kind != LayerKind::kMhc || spec.n != 4 ||
      tokens <= 0) {
    return 1;
  }
  const int64_t ctas =
      DxTileCtas(spec, tokens, proj::kWgmmaN4Chans, proj::kTokenChunk);
  const int64_t stages =
      (std::min(tokens, proj::kTokenChunk) + proj::kWgmmaN4StageTokens - 1) /
      proj::kWgmmaN4StageTokens;
  const int64_t most = std::min<int64_t>(proj::kMaxChunkCtas, stages);
  const int64_t solo = std::min(most, proj::kTunedSms / ctas);
  const int64_t shared =
      std::min(most, proj::kWgmmaN4CtasPerSm * proj::kTunedSms / ctas);
  // Two per SM split only while ctas <= kTunedSms: the arrival counters.
  static_assert(proj::kWgmmaN4CtasPerSm * proj::kTunedSms / 2 ==
                proj::kSplitArrivals);
  return static_cast<int>(
      std::max<int64_t>(1, solo >= proj::kMinSoloChunkCtas ? solo : shared));
}

size_t SplitPartialBytes(const LayerSpec& spec, int64_t tokens) {
  const int chunk_ctas = ChunkCtasFor(spec, tokens);
  if (chunk_ctas == 1) return 0;
  const int64_t groups =
      DxTileCtas(spec, tokens, proj::kWgmmaN4Chans, proj::kTokenChunk);
  return AlignBytes(sizeof(float) * groups * chunk_ctas * spec.NumLogits() *
                    proj::kWgmmaN4Chans * spec.n);
}

int64_t PhiChunkTokens(const LayerSpec& spec) {
  const bool wide_only =
      spec.dynamic && spec.K() <= kInt32Max && !MmaDxSuitsLayer(spec);
  if (!wide_only) return proj::kTokenChunk;
  const int64_t N = spec.NumLogits();
  // Longer chunks only while one chunk's CTAs (128 columns x up to 144
  // logits each) still fill the GPU several times over, in powers of two so
  // that chunks end together.
  const int64_t ctas = (spec.K() + 127) / 128 * ((N + 143) / 144);
  int64_t most = N / 24;
  if (ctas / 128 < most) most = ctas / 128;
  if (8 < most) most = 8;
  int64_t multiple = 1;
  while (multiple * 2 <= most) multiple *= 2;
  return proj::kTokenChunk * multiple;
}

LayerSpec PlanExample::Spec() const {
  LayerSpec spec = PresetSpec("deepseek_v4", n, hidden).value();
  spec.kind = kind;
  spec.dynamic = dynamic;
  spec.matmul_precision = precision;
  return spec;
}

const std::vector<ProjectionForwardRow>& ProjectionForwardRows() {
  static const auto* rows = [] {
    auto* out = new std::vector<ProjectionForwardRow>;
    for (const ForwardRule& rule : ForwardRules()) out->push_back(rule.row);
    return out;
  }();
  return *rows;
}

const std::vector<ProjectionBackwardRow>& ProjectionBackwardRows() {
  static const auto* rows = [] {
    auto* out = new std::vector<ProjectionBackwardRow>;
    for (const BackwardRule& rule : BackwardRules()) out->push_back(rule.row);
    return out;
  }();
  return *rows;
}

}  // namespace mhc::cuda
