// Host launchers of the CUDA kernels, one per op and direction, all enqueued
// on the given stream. Params are validated by the Backend entry points;
// tokens >= 1 here. Workspace sizes are exact and match *WorkspaceBytes.
#ifndef MHC_KERNELS_CUDA_LAUNCH_H_
#define MHC_KERNELS_CUDA_LAUNCH_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "mhc/ops/aggregate.h"
#include "mhc/ops/expand.h"
#include "mhc/ops/fused.h"
#include "mhc/ops/optimizer.h"
#include "mhc/ops/post.h"
#include "mhc/ops/projection.h"
#include "mhc/ops/scale.h"
#include "mhc/ops/sinkhorn.h"
#include "mhc/ops/weights.h"
#include "mhc/types.h"
#include "plans/fused.h"
#include "plans/post.h"
#include "plans/row_access.h"
#include "plans/scale.h"
#include "plans/sinkhorn.h"
#include "projection/geometry.h"
#include "projection/plan.h"

namespace mhc::cuda {

// Rounds a byte count up so that every workspace slice stays 256-B aligned.
using proj::AlignBytes;

// The projection's chunk partials (0 for static layers).
size_t MmaProjectionWorkspace(const LayerSpec& spec, int64_t tokens,
                              DType dtype);
size_t ProjectionForwardWorkspace(const LayerSpec& spec, int64_t tokens,
                                  DType dtype);
size_t ProjectionBackwardWorkspace(const LayerSpec& spec, int64_t tokens,
                                   DType dtype);
size_t ScaleBackwardWorkspace(const LayerSpec& spec, int64_t tokens);
size_t PostBackwardWorkspace(const LayerSpec& spec, int64_t tokens);
size_t FusedForwardWorkspace(const LayerSpec& spec, int64_t tokens,
                             DType dtype);
size_t FusedBackwardWorkspace(const LayerSpec& spec, int64_t tokens,
                              DType dtype);

// The plan an op's launch follows, from its tensors' alignment (its
// variant names the kernel metrics' label). The fused ops' plan needs only
// the layer (PlanFusedForward / Backward).
ProjectionForwardPlan PlanOf(const ProjectionForwardParams& p);
ProjectionBackwardPlan PlanOf(const ProjectionBackwardParams& p);
ScalePlan PlanOf(const ScaleForwardParams& p);
ScalePlan PlanOf(const ScaleBackwardParams& p);
SinkhornPlan PlanOf(const SinkhornForwardParams& p);
SinkhornPlan PlanOf(const SinkhornBackwardParams& p);
RowAccessPlan PlanOf(const AggregateForwardParams& p);
RowAccessPlan PlanOf(const AggregateBackwardParams& p);
RowAccessPlan PlanOf(const ExpandForwardParams& p);
RowAccessPlan PlanOf(const ExpandBackwardParams& p);
PostPlan PlanOf(const PostForwardParams& p);
PostPlan PlanOf(const PostBackwardParams& p);

absl::Status LaunchProjectionForward(const ProjectionForwardParams& p,
                                     Workspace ws, cudaStream_t stream);
// arrivals: proj::kSplitArrivals device counters, 0 between launches (the
// backend owns them and its stream serialises the users), for the dx
// kernels that split a token chunk over several CTAs.
absl::Status LaunchProjectionBackward(const ProjectionBackwardParams& p,
                                      Workspace ws, unsigned* arrivals,
                                      cudaStream_t stream);
// `repair` (overflow_repair.h): the overflow repair of the SplitMix path in
// the fused ops, which alone have x (n != 4); null for the single op.
struct ScaleRepair;
struct RepairBackwardArgs;  // overflow_repair.h
absl::Status LaunchScaleForward(const ScaleForwardParams& p,
                                cudaStream_t stream,
                                const ScaleRepair* repair = nullptr);
// arrivals: a device counter that is 0 between launches (the backend owns
// it and its stream serialises the users); the kernel that sums the
// parameter gradients counts its finished CTAs there and its last CTA
// resets it.
absl::Status LaunchScaleBackward(const ScaleBackwardParams& p, Workspace ws,
                                 unsigned* arrivals, cudaStream_t stream,
                                 const ScaleRepair* repair = nullptr);
absl::Status LaunchSinkhornForward(const SinkhornForwardParams& p,
                                   cudaStream_t stream);
absl::Status LaunchSinkhornBackward(const SinkhornBackwardParams& p,
                                    cudaStream_t stream);
// The lane kernels' reverse mode for the fused backward: dlogits as
// LaunchSinkhornBackward and, when r is given, the forward's H_res in
// source-rows form ([M, n, n], R[i][j] at i n + j) from the same forward.
// For layers whose Sinkhorn plan picks the lane kernels (SplitMix layers).
absl::Status LaunchSinkhornLanesBackward(const LayerSpec& spec, int64_t tokens,
                                         const float* logits,
                                         const float* dh_res, float* dlogits,
                                         float* r, cudaStream_t stream);
// The aggregate's chunk-partial source of H_pre, for the fused pre / head
// forward (PreGate in mix.cuh).
struct PreGateSource {
  const float* partial;  // the projection's chunk partials (MmaProjection)
  int chunks;
  const float* alpha;
  const float* beta;
};
// With beside_mixing (the fused pre / head forward, launched right after its
// mixing kernel), each CTA sums its token's logits from the partials and
// gates H_pre itself (the mixing kernel's bits), so it runs beside the
// mixing kernel's Sinkhorn instead of after it: p.h_pre, the mixing kernel's
// output, is read only for a token that kernel repairs (after waiting for
// it), and every CTA waits for it before it ends.
absl::Status LaunchAggregateForward(
    const AggregateForwardParams& p, cudaStream_t stream,
    const PreGateSource* beside_mixing = nullptr);
absl::Status LaunchAggregateBackward(const AggregateBackwardParams& p,
                                     cudaStream_t stream);
absl::Status LaunchPostForward(const PostForwardParams& p, cudaStream_t stream);
absl::Status LaunchPostBackward(const PostBackwardParams& p, Workspace ws,
                                cudaStream_t stream);
// The tensor-core post kernels (post_mma.cu), which LaunchPost* run where
// the post plan (plans/post.h) picks `mma`.
absl::Status LaunchPostForwardMma(const PostForwardParams& p,
                                  cudaStream_t stream);
// Everything but the bias gradient.
absl::Status LaunchPostBackwardMma(const PostBackwardParams& p,
                                   cudaStream_t stream);
absl::Status LaunchExpandForward(const ExpandForwardParams& p,
                                 cudaStream_t stream);
absl::Status LaunchExpandBackward(const ExpandBackwardParams& p,
                                  cudaStream_t stream);
absl::Status LaunchPreForward(const PreForwardParams& p, Workspace ws,
                              cudaStream_t stream);
absl::Status LaunchPreBackward(const PreBackwardParams& p, Workspace ws,
                               cudaStream_t stream);
absl::Status LaunchHeadForward(const HeadForwardParams& p, Workspace ws,
                               cudaStream_t stream);
absl::Status LaunchHeadBackward(const HeadBackwardParams& p, Workspace ws,
                                cudaStream_t stream);
// The optimizer step (optimizer.cu); `ws` as
// Backend::OptimizerWorkspaceBytes.
absl::Status LaunchOptimizerStep(const OptimizerStepParams& p, Workspace ws,
                                 cudaStream_t stream);

// The fused layer ops for both layer kinds (fused_pre.cu): projection,
// scale, Sinkhorn (kMhc) and aggregate per token tile.
struct FusedForwardArgs {
  const LayerSpec* spec = nullptr;
  int64_t tokens = 0;
  DType act_dtype = DType::kBF16;
  const void* x = nullptr;
  LayerWeights weights;
  void* y = nullptr;
  float* h_pre = nullptr;        // optional (kHead: the mix)
  float* h_post = nullptr;       // kMhc
  float* h_res = nullptr;        // kMhc
  float* h = nullptr;            // optional [M, N], dynamic: the projection
  float* mean_square = nullptr;  // with h [M]
};
struct FusedBackwardArgs {
  const LayerSpec* spec = nullptr;
  int64_t tokens = 0;
  DType act_dtype = DType::kBF16;
  const void* x = nullptr;
  LayerWeights weights;
  const void* dy = nullptr;
  const float* dh_post = nullptr;  // kMhc
  const float* dh_res = nullptr;   // kMhc
  const void* dx_next = nullptr;   // optional (kMhc)
  void* dx = nullptr;
  LayerGrads grads;
  const float* h = nullptr;  // optional [M, N]: the forward's projection
  const float* mean_square = nullptr;  // with h [M]
};
absl::Status LaunchFusedForward(const FusedForwardArgs& a, Workspace ws,
                                cudaStream_t stream);
absl::Status LaunchFusedBackward(const FusedBackwardArgs& a, Workspace ws,
                                 cudaStream_t stream);

// Shared pieces (projection/launch.cu) used by the fused launchers.

// The projection of a dynamic layer (the plan's variant), in workspace of
// MmaProjectionWorkspace bytes: the chunk partials (at its start; SumChunks
// reads them), then h [M, N] and mean_square [M].
absl::Status LaunchProjectionPartials(const LayerSpec& spec, int64_t tokens,
                                      DType dtype, const void* x,
                                      const float* phi, const float* gamma,
                                      void* workspace, cudaStream_t stream);
absl::Status LaunchMmaProjection(const LayerSpec& spec, int64_t tokens,
                                 DType dtype, const void* x, const float* phi,
                                 const float* gamma, void* workspace, float* h,
                                 float* mean_square, cudaStream_t stream);

// Where dphi goes: the phi / gamma gradients (null: not asked for) and, in
// the fused backward of a dynamic layer, the overflow repair's pass.
struct PhiGradArgs {
  const float* phi = nullptr;
  const float* gamma = nullptr;  // null without gamma
  float* grads_phi = nullptr;
  float* grads_gamma = nullptr;
  const RepairBackwardArgs* repair = nullptr;
};

// Per token: dx[m][k] = (aggregate + residual terms, when given) + sum_g
// dh[m][g] phi'[g][k] + dms[m] 2 v_k / K, rounded once; and, when
// dphi_partial is given, the per-chunk partial sums of dh v over fixed token
// chunks ([NumChunks(M)][N][K] fp32).
struct DxArgs {
  const LayerSpec* spec = nullptr;
  int64_t tokens = 0;
  DType act_dtype = DType::kBF16;
  const void* x = nullptr;
  const float* phi = nullptr;     // null for static layers
  const float* gamma = nullptr;   // optional
  const float* dh = nullptr;      // [M, N], null for static layers
  const float* dms = nullptr;     // [M]
  const float* h_pre = nullptr;   // [M, n] optional (aggregate term)
  const void* dy = nullptr;       // [M, C] with h_pre
  const float* r = nullptr;       // [M, n, n] optional, R in source-rows form
  const void* dx_next = nullptr;  // [M, K] with r
  void* dx = nullptr;
  float* dphi_partial = nullptr;  // optional
  // For plans with chunk_ctas > 1 that sum dphi: the workspace's
  // split_partials bytes and proj::kSplitArrivals counters, 0 between
  // launches (the kernel's last CTAs leave them 0).
  float* split_partials = nullptr;
  unsigned* split_arrivals = nullptr;
  // WideDxScratchBytes of scratch, for the plan's wide variants
  // (projection/backward/wide.h).
  void* wide_scratch = nullptr;
  // Set by LaunchDxAndPhiGrads for plans with grads_in_kernel.
  const PhiGradArgs* grads = nullptr;
  // Set by LaunchDxAndPhiGrads where column sums run beside the dx kernel
  // (wgmma_n4_terms alone): the kernel lets them launch once past its wait.
  bool dependents_beside = false;
};
// Sums rows [M, W] over tokens (LaunchColumnSum): out_a[w] += total[w] for
// w < split and out_b[w - split] += total[w] for w >= split (null outputs
// are skipped). partial: [NumChunks(M), W] scratch; arrivals: a device
// counter that is 0 at launch, and is left 0.
struct ColumnSumArgs {
  const float* rows = nullptr;
  int64_t tokens = 0;
  int width = 0;
  int split = 0;
  float* partial = nullptr;
  unsigned* arrivals = nullptr;
  float* out_a = nullptr;
  float* out_b = nullptr;
};

// dx, then the phi / gamma gradients from the chunk partials in
// a.dphi_partial (null: no gradient asked for) by LaunchPhiGradReduce; or,
// where the plan has the dx kernel add a single chunk itself
// (grads_in_kernel), that kernel alone. Without partials, g.repair's pass
// runs as a kernel of its own. column_sums (optional): sums of rows written
// before the stream's last kernel (LaunchColumnSum's rows_before_previous),
// launched beside the dx kernel where its variant allows dependents past
// its wait, else beside the dphi reduction, else after the last kernel.
absl::Status LaunchDxAndPhiGrads(const DxArgs& a, const PhiGradArgs& g,
                                 cudaStream_t stream,
                                 const ColumnSumArgs* column_sums = nullptr);
// The mma variant (projection/backward/mma.cu), with the plan's row copies.
absl::Status LaunchMmaDxAndPhiPartials(const DxArgs& a,
                                       const ProjectionBackwardPlan& plan,
                                       cudaStream_t stream);

// grads_phi[g][k] += sum_chunks partial * gamma[k] (or without gamma);
// grads_gamma[k] += sum_g (sum_chunks partial[g][k]) phi[g][k]. With
// `repair` (the fused backward of a dynamic layer), then the overflow
// repair's pass for the tokens the mixing kernel repaired, in the same
// launch (or in its own when there is nothing to reduce).
// dependents_beside: the kernel lets the next launch start once past its
// wait (column sums of rows it does not touch, LaunchDxAndPhiGrads).
absl::Status LaunchPhiGradReduce(const LayerSpec& spec, int64_t tokens,
                                 const float* partial, const float* phi,
                                 const float* gamma, float* grads_phi,
                                 float* grads_gamma, cudaStream_t stream,
                                 const RepairBackwardArgs* repair = nullptr,
                                 bool dependents_beside = false);

// The column sums of c in fixed token chunks, in one launch: the last CTA
// adds the chunks in order. rows_before_previous: the rows were written
// before the stream's previous kernel passed its WaitForPrerequisiteGrid,
// and that kernel allows its dependents (if at all) only past it; the sums
// then run beside it and wait for it only before they finish.
absl::Status LaunchColumnSum(const ColumnSumArgs& c, cudaStream_t stream,
                             bool rows_before_previous = false);
// out[w] += sum over chunks of partial[chunk][w], chunks in order.
absl::Status LaunchChunkSum(const float* partial, int64_t chunks, int64_t width,
                            float* out, cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_LAUNCH_H_
