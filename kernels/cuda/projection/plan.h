// The kernel plan of the CUDA projection: for a launch's layer, dtype,
// token count and tensor alignment, which kernel variant runs, its launch
// shape and its workspace layout. Each direction has one table of ordered
// rows (condition -> variant), the first that holds wins; the launchers,
// the workspace queries, the error messages, the kernel metrics and the
// benchmark all read the plan, and nothing else decides. Plain C++ without
// CUDA, so that tests and the docs generator can enumerate it anywhere.
//
// Alignment is an input: the same (n, dtype, C, M) may take a different
// variant when a tensor starts off 16 bytes. M never picks a variant; it
// sizes the workspace, leaves a single token's odd-C row to the pieces
// rather than the tensor copies of token pairs (pair_rows: the same bits)
// and, where the tiles would leave SMs idle, sets the launch shape
// (deep_ring, unit_ctas, dx_apart_tokens: the same bits either way;
// chunk_ctas: the same dx bits, dphi added in another grouping).
#ifndef MHC_KERNELS_CUDA_PROJECTION_PLAN_H_
#define MHC_KERNELS_CUDA_PROJECTION_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "mhc/types.h"

namespace mhc::cuda {

// Names read instruction, then shape class: "mma" is mma.sync, "wgmma" the
// warpgroup mma; "wide" is more than two logit groups (N > 48, forward) or
// a layer the register-resident backward does not take; n4 / n8 are the
// backward kernels built for one layer shape.
enum class ProjectionForwardVariant : uint8_t {
  kNone,           // static layer: no projection
  kMma,            // mma.sync units of up to 24 logits (N <= 48)
  kMmaWide,        // mma.sync GEMM tiles (N > 48)
  kWgmmaBf16,      // bf16 wgmma units of one logit group (N <= 24)
  kWgmmaBf16Wide,  // bf16 wgmma units of 80 logits (48 < N <= 80)
  kWgmmaTf32Wide,  // TF32 wgmma GEMM tiles (N > 48)
  kWgmmaTf32,      // fp16 / fp32 TF32 wgmma units of one logit group
};
inline constexpr int kNumProjectionForwardVariants = 7;

enum class ProjectionBackwardVariant : uint8_t {
  kWgmmaN4,       // n = 4 mHC layers, no fused terms: dx rows from wgmma
  kWgmmaN4Terms,  // n = 4 mHC layers with the fused terms, small batches
  kWgmmaN8,       // n = 8 mHC layers: dx^T and dphi^T on wgmma
  kMma,           // register-resident mma.sync tiles, x read once
  kMmaWide,       // wide layers: dx GEMM on mma.sync
  kWgmmaWide,     // wide layers: dx GEMM on wgmma
  kFma,           // CUDA cores, a thread per k (static layers' terms)
};
inline constexpr int kNumProjectionBackwardVariants = 7;

// Where the dphi partials come from: the dx kernel itself, or (wide
// layers) a second kernel.
enum class ProjectionDphiVariant : uint8_t {
  kNone,       // static layer: no dphi
  kWithDx,     // the dx kernel writes them
  kMmaWide,    // dphi_mma.cu
  kWgmmaWide,  // dphi_wgmma.cu
};

// "mma", "wgmma_bf16", ... as the metrics label and the docs spell them.
absl::string_view ToString(ProjectionForwardVariant variant);
absl::string_view ToString(ProjectionBackwardVariant variant);
absl::string_view ToString(ProjectionDphiVariant variant);

// The largest power of two up to 16 that divides a tensor's address; 16 for
// a tensor not given (it constrains nothing).
int AddressAlignment(const void* pointer);

// Per tensor, AddressAlignment of the pointer the launch gets.
struct ProjectionForwardAlignment {
  int x = 16;
  int phi = 16;
  int gamma = 16;  // of the gamma the kernels read (none without has_gamma)
};
struct ProjectionBackwardAlignment {
  int x = 16;
  int dx = 16;
  int dh = 16;
  int dms = 16;
  int phi = 16;
  int gamma = 16;
  int h_pre = 16;    // aggregate term
  int dy = 16;       // with h_pre
  int r = 16;        // residual term
  int dx_next = 16;  // with r
};

// The fused pre / head backward's extra dx terms: the aggregate term H_pre
// dy, and the residual term R dx_next (only with the aggregate one).
struct DxTerms {
  bool aggregate = false;
  bool residual = false;
};

// ---- Forward.

// Workspace: the chunk partials, the phi' split (one logit group, bf16 or
// TF32, M > 0), phi' rounded to TF32 as [N][K] (the wide TF32 rows, M > 0),
// the unit counter; byte offsets from the start.
struct ProjectionForwardWorkspaceLayout {
  size_t partials = 0;  // at 0
  size_t phi_split = 0;
  size_t phi_split_offset = 0;
  size_t phi_rounded = 0;
  size_t phi_rounded_offset = 0;
  size_t counter_offset = 0;
  size_t total = 0;
};

struct ProjectionForwardPlan {
  ProjectionForwardVariant variant = ProjectionForwardVariant::kNone;
  int row = -1;  // of ProjectionForwardRows()
  // Widest copy every x row takes (16, 8, 4; 0: element copies): mma and
  // the bf16 wgmma units.
  int x_copy_bytes = 0;
  bool phi_vector = false;  // phi and gamma by 16-byte loads (mma)
  // phi' split (bf16) or rounded (wgmma_tf32) once per launch: one logit
  // group.
  bool split_phi = false;
  // wgmma_bf16 with x by tensor copies, wgmma_tf32, or wgmma_tf32_wide
  // with 16-bit x, fewer units than SMs: a ring of kBf16DeepStages stages
  // (the wide units: as many as one CTA's shared memory holds; the same
  // bits).
  bool deep_ring = false;
  // wgmma_bf16 with rows 8 bytes off 16 on a 16-byte x, at least two
  // tokens: x by tensor copies of the even rows and of token pairs
  // (projection/forward/bf16_unit.cuh).
  bool pair_rows = false;
  // wgmma_bf16 with tensor copies, fewer units than SMs: CTAs per unit, one
  // cluster, each with its share of the unit's flush groups (geometry.h:
  // the same bits as one CTA per unit, which 1 means).
  int unit_ctas = 1;
  // mma_wide: 16-byte x, phi and gamma rows (IEEE only: TF32 ones go to
  // wgmma_tf32_wide).
  bool vector_rows = false;
  // Logits per unit of the GEMM-tiled variants: mma_wide 64 or 96,
  // wgmma_tf32_wide 96 or 144; 0 for the others.
  int tile_logits = 0;
  ProjectionForwardWorkspaceLayout workspace;
};

ProjectionForwardPlan PlanProjectionForward(
    const LayerSpec& spec, DType dtype, int64_t tokens,
    const ProjectionForwardAlignment& alignment);
// The workspace before the tensors exist: every variant's is the same.
ProjectionForwardWorkspaceLayout PlanProjectionForwardWorkspace(
    const LayerSpec& spec, DType dtype, int64_t tokens);

// ---- Backward.

// How the mma.sync backward stages activation rows and stores dx.
enum class DxRowCopy : uint8_t {
  kVector,    // 16-byte copies: C and the tile width whole vectors, aligned
  kSlots,     // realigned slots (staged_slots.cuh): tensors on their elements
  kElements,  // element copies: what the slots cannot take
  // Tensor copies per row residue (run_maps.h): the summed n = 4 build's
  // 16-bit rows off 16 bytes on 16-byte bases, at least kDxRunMapMinTokens
  // tokens; launches without the summed terms take the slots.
  kRunMaps,
};

// Workspace: the dphi chunk partials at 0, then for the wide variants the
// rounded operands (parts of dh, dh^T and phi'^T) and, with the residual
// term, one channel chunk's summed terms.
struct ProjectionBackwardWorkspaceLayout {
  int64_t phi_chunk_tokens = 0;
  int64_t phi_chunks = 0;
  size_t dphi_partials = 0;
  // The split chunks' per-CTA dphi (chunk_ctas > 1): [chunks][tiles]
  // [chunk_ctas][N x kWgmmaN4Chans n], summed by the last CTA of each.
  size_t split_partials = 0;
  int parts = 0;  // wide: tf32 high part, and low part under IEEE
  size_t part_dh = 0, part_dh_t = 0, part_phi_t = 0;  // bytes of each
  size_t terms = 0;
  size_t wide_scratch = 0;  // parts and terms
  size_t total = 0;
};

struct ProjectionBackwardPlan {
  ProjectionBackwardVariant variant = ProjectionBackwardVariant::kFma;
  ProjectionDphiVariant dphi = ProjectionDphiVariant::kNone;
  int row = -1;   // of ProjectionBackwardRows()
  int terms = 0;  // 0, 1 (aggregate) or 2 (and residual)
  // mma: row staging, and 16-byte copies of dh, dms, H_pre and R.
  DxRowCopy row_copy = DxRowCopy::kElements;
  bool runs16 = false;
  // wide: 16-byte vectors of x rows, and of dx (and dy) rows.
  bool vector_x = false;
  bool vector_dx = false;
  int fma_vector = 1;  // fma: k per thread (1 or 2)
  // mma: 0, or (small batches) dphi alone over each token chunk, then dx
  // alone over chunks of this many tokens (the same bits).
  int dx_apart_tokens = 0;
  // wgmma_n4 / wgmma_n4_terms: the CTAs that split each token chunk's
  // stages, 1 to kMaxChunkCtas (ChunkCtasFor); the last of them to finish
  // adds their dphi in rank order (dx keeps its bits). A launch whose CTAs
  // all fit one per SM pads its shared memory so that no SM holds two.
  int chunk_ctas = 1;
  // wgmma_n4 / wgmma_n4_terms with one dphi chunk: the dx kernel adds that
  // chunk's dphi into the phi / gamma gradients itself (and runs the fused
  // backward's repair pass), as the reduction would, so no second launch.
  bool grads_in_kernel = false;
  ProjectionBackwardWorkspaceLayout workspace;
};

ProjectionBackwardPlan PlanProjectionBackward(
    const LayerSpec& spec, DType dtype, int64_t tokens,
    const ProjectionBackwardAlignment& alignment, DxTerms terms = {});
// The workspace before the tensors exist: alignment only ever chooses
// between variants of the same workspace (the warpgroup-mma rows take a
// subset of the mma row's launches), so this is every plan's.
ProjectionBackwardWorkspaceLayout PlanProjectionBackwardWorkspace(
    const LayerSpec& spec, DType dtype, int64_t tokens, DxTerms terms = {});

// The n = 4 warpgroup dx kernels' CTAs per token chunk (the plan's
// chunk_ctas) for this layer and M, whichever variant runs: 1 for other
// layers.
int ChunkCtasFor(const LayerSpec& spec, int64_t tokens);
// The split chunks' per-CTA dphi (ProjectionBackwardWorkspaceLayout::
// split_partials): 0 unless ChunkCtasFor > 1.
size_t SplitPartialBytes(const LayerSpec& spec, int64_t tokens);

// Tokens per dphi partial (a function of the layer alone, so the order of
// the sum over tokens never depends on M): kTokenChunk, or for the layers
// only the wide backward takes (n not a power of two, n = 16) up to
// kTokenChunk times N / 24.
int64_t PhiChunkTokens(const LayerSpec& spec);
inline int64_t NumPhiChunks(const LayerSpec& spec, int64_t tokens) {
  const int64_t chunk = PhiChunkTokens(spec);
  return (tokens + chunk - 1) / chunk;
}

// ---- The tables, for tests and the docs.

// A launch the row's condition holds for, first in the table.
struct PlanExample {
  LayerKind kind = LayerKind::kMhc;
  int n = 4;
  int64_t hidden = 0;
  DType dtype = DType::kBF16;
  MatmulPrecision precision = MatmulPrecision::kTf32;
  bool dynamic = true;
  int x_alignment = 16;  // of x (and dx); every other tensor on 16 bytes
  DxTerms terms;         // backward
  LayerSpec Spec() const;
};

struct ProjectionForwardRow {
  ProjectionForwardVariant variant;
  const char* when;  // the condition, in the docs' words
  const char* code;  // where the kernel is
  const char* what;  // how it works, in a line
  PlanExample example;
};
struct ProjectionBackwardRow {
  ProjectionBackwardVariant variant;
  const char* when;
  const char* code;
  const char* what;
  PlanExample example;
};

const std::vector<ProjectionForwardRow>& ProjectionForwardRows();
const std::vector<ProjectionBackwardRow>& ProjectionBackwardRows();

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_PLAN_H_
