// The projection's dispatch: a launch measures its tensors' alignment, asks
// the plan (plan.h) for its variant, launch shape and workspace layout, and
// hands the plan to that variant's launcher; the workspace queries read the
// same plan. Also used by the fused pre / head ops for their projection and
// their dx.
//
// Determinism / batch invariance: the forward reduces each token over k in
// an order fixed by K and N (tensor-core units over a K split, added in
// chunk order); the backward computes dx per element with sums over g in
// order; phi / gamma gradients are partial sums over fixed chunks of tokens
// (token order) in workspace, added over chunks in order by a second
// kernel. No floating-point atomics (an integer counter hands out the
// forward's units).
#include "absl/strings/str_cat.h"
#include "common.cuh"
#include "dispatch.cuh"
#include "launch.h"
#include "overflow_repair.h"
#include "projection/backward/fma.h"
#include "projection/backward/wgmma_n4.h"
#include "projection/backward/wgmma_n4_terms.h"
#include "projection/backward/wgmma_n8.h"
#include "projection/backward/wide.h"
#include "projection/forward/mma.h"
#include "projection/forward/mma_wide.h"
#include "projection/forward/wgmma_bf16.h"
#include "projection/forward/wgmma_tf32.h"
#include "projection/forward/wgmma_tf32_wide.h"
#include "projection/plan.h"

namespace mhc::cuda {
namespace {

static_assert(proj::kTokenChunk == kTokenChunk,
              "the plan's token chunk is the kernels'");

// gamma as the kernels read it: none without has_gamma.
const float* GammaOf(const LayerSpec& spec, const float* gamma) {
  return spec.has_gamma ? gamma : nullptr;
}

ProjectionForwardAlignment ForwardAlignmentOf(const void* x, const float* phi,
                                              const float* gamma) {
  ProjectionForwardAlignment a;
  a.x = AddressAlignment(x);
  a.phi = AddressAlignment(phi);
  a.gamma = AddressAlignment(gamma);
  return a;
}

ProjectionBackwardAlignment BackwardAlignmentOf(const DxArgs& d) {
  ProjectionBackwardAlignment a;
  a.x = AddressAlignment(d.x);
  a.dx = AddressAlignment(d.dx);
  a.dh = AddressAlignment(d.dh);
  a.dms = AddressAlignment(d.dms);
  a.phi = AddressAlignment(d.phi);
  a.gamma = AddressAlignment(d.gamma);
  a.h_pre = AddressAlignment(d.h_pre);
  a.dy = AddressAlignment(d.dy);
  a.r = AddressAlignment(d.r);
  a.dx_next = AddressAlignment(d.dx_next);
  return a;
}

DxTerms TermsOf(const DxArgs& a) {
  DxTerms terms;
  terms.aggregate = a.h_pre != nullptr;
  terms.residual = a.r != nullptr;
  return terms;
}

std::string Label(absl::string_view direction, absl::string_view variant,
                  const LayerSpec& spec, int64_t tokens, DType dtype) {
  return absl::StrCat("cuda projection ", direction, " ", variant, " ",
                      ShapeText(LaunchShape(spec, tokens, dtype)));
}

ProjectionForwardPlan PlanForward(const LayerSpec& spec, int64_t tokens,
                                  DType dtype, const void* x, const float* phi,
                                  const float* gamma) {
  return PlanProjectionForward(
      spec, dtype, tokens, ForwardAlignmentOf(x, phi, GammaOf(spec, gamma)));
}

// The chunk partials of the plan's variant into `workspace`.
absl::Status LaunchPartials(const LayerSpec& spec, int64_t tokens, DType dtype,
                            const void* x, const float* phi, const float* gamma,
                            const ProjectionForwardPlan& plan, void* workspace,
                            cudaStream_t stream) {
  gamma = GammaOf(spec, gamma);
  switch (plan.variant) {
    case ProjectionForwardVariant::kWgmmaBf16:
      return LaunchBf16WgmmaProjectionPartials(spec, tokens, x, phi, gamma,
                                               plan, workspace, stream);
    case ProjectionForwardVariant::kWgmmaBf16Wide:
      return LaunchBf16WideProjectionPartials(spec, tokens, x, phi, gamma, plan,
                                              workspace, stream);
    case ProjectionForwardVariant::kWgmmaTf32:
      return LaunchTf32WgmmaProjectionPartials(spec, tokens, dtype, x, phi,
                                               gamma, plan, workspace, stream);
    case ProjectionForwardVariant::kWgmmaTf32Wide:
      return LaunchWgmmaProjectionPartials(spec, tokens, dtype, x, phi, gamma,
                                           plan, workspace, stream);
    case ProjectionForwardVariant::kMmaWide:
      return LaunchWideProjectionPartials(spec, tokens, dtype, x, phi, gamma,
                                          plan, workspace, stream);
    case ProjectionForwardVariant::kMma:
      return LaunchMmaForwardPartials(spec, tokens, dtype, x, phi, gamma, plan,
                                      workspace, stream);
    case ProjectionForwardVariant::kNone:
      break;
  }
  return absl::InternalError(absl::StrCat(
      Label("forward", ToString(plan.variant), spec, tokens, dtype),
      ": a static layer has no projection"));
}

absl::Status LaunchDxAndPhiPartials(const DxArgs& a,
                                    const ProjectionBackwardPlan& plan,
                                    cudaStream_t stream) {
  if (a.spec->dynamic != (a.dh != nullptr)) {
    return absl::InternalError(
        absl::StrCat(Label("backward", ToString(plan.variant), *a.spec,
                           a.tokens, a.act_dtype),
                     ": dh must be given exactly for dynamic layers"));
  }
  switch (plan.variant) {
    case ProjectionBackwardVariant::kWgmmaN4:
      return LaunchRowsWgmmaDxAndPhiPartials(a, plan, stream);
    case ProjectionBackwardVariant::kWgmmaN4Terms:
      return LaunchTermsWgmmaDxAndPhiPartials(a, plan, stream);
    case ProjectionBackwardVariant::kWgmmaN8:
      return LaunchWgmmaDxAndPhiPartials(a, plan, stream);
    case ProjectionBackwardVariant::kMma:
      return LaunchMmaDxAndPhiPartials(a, plan, stream);
    case ProjectionBackwardVariant::kMmaWide:
    case ProjectionBackwardVariant::kWgmmaWide:
      return LaunchWideDxAndPhiPartials(a, plan, stream);
    case ProjectionBackwardVariant::kFma:
      return LaunchFmaDxAndPhiPartials(a, plan, stream);
  }
  return absl::InternalError("unknown projection backward variant");
}

}  // namespace

size_t MmaProjectionWorkspace(const LayerSpec& spec, int64_t tokens,
                              DType dtype) {
  return PlanProjectionForwardWorkspace(spec, dtype, tokens).total;
}

size_t ProjectionForwardWorkspace(const LayerSpec& spec, int64_t tokens,
                                  DType dtype) {
  return MmaProjectionWorkspace(spec, tokens, dtype);
}

// The dphi chunk partials, then the wide variants' scratch.
size_t ProjectionBackwardWorkspace(const LayerSpec& spec, int64_t tokens,
                                   DType dtype) {
  return PlanProjectionBackwardWorkspace(spec, dtype, tokens, DxTerms{}).total;
}

size_t WideDxScratchBytes(const LayerSpec& spec, int64_t tokens, DType dtype,
                          bool terms) {
  DxTerms t;
  t.aggregate = terms;
  t.residual = terms;
  return PlanProjectionBackwardWorkspace(spec, dtype, tokens, t).wide_scratch;
}

ProjectionForwardPlan PlanOf(const ProjectionForwardParams& p) {
  return PlanForward(*p.spec, p.tokens, p.act_dtype, p.x, p.weights.phi,
                     p.weights.gamma);
}

ProjectionBackwardPlan PlanOf(const ProjectionBackwardParams& p) {
  DxArgs a;
  a.x = p.x;
  a.phi = p.weights.phi;
  a.gamma = p.weights.gamma;
  a.dh = p.dh;
  a.dms = p.dmean_square;
  a.dx = p.dx;
  return PlanProjectionBackward(*p.spec, p.act_dtype, p.tokens,
                                BackwardAlignmentOf(a), DxTerms{});
}

absl::Status LaunchProjectionPartials(const LayerSpec& spec, int64_t tokens,
                                      DType dtype, const void* x,
                                      const float* phi, const float* gamma,
                                      void* workspace, cudaStream_t stream) {
  return LaunchPartials(spec, tokens, dtype, x, phi, gamma,
                        PlanForward(spec, tokens, dtype, x, phi, gamma),
                        workspace, stream);
}

absl::Status LaunchMmaProjection(const LayerSpec& spec, int64_t tokens,
                                 DType dtype, const void* x, const float* phi,
                                 const float* gamma, void* workspace, float* h,
                                 float* mean_square, cudaStream_t stream) {
  MHC_RETURN_IF_ERROR(LaunchProjectionPartials(spec, tokens, dtype, x, phi,
                                               gamma, workspace, stream));
  return LaunchProjectionFinish(spec, tokens, dtype,
                                static_cast<const float*>(workspace), h,
                                mean_square, /*repair=*/nullptr, stream);
}

// The op is defined for dynamic layers only (the Backend checks it).
absl::Status LaunchProjectionForward(const ProjectionForwardParams& p,
                                     Workspace ws, cudaStream_t stream) {
  const ProjectionForwardPlan plan = PlanOf(p);
  if (ws.bytes < plan.workspace.total) {
    return absl::InvalidArgumentError(
        absl::StrCat(Label("forward", ToString(plan.variant), *p.spec, p.tokens,
                           p.act_dtype),
                     ": workspace too small"));
  }
  MHC_RETURN_IF_ERROR(LaunchPartials(*p.spec, p.tokens, p.act_dtype, p.x,
                                     p.weights.phi, p.weights.gamma, plan,
                                     ws.data, stream));
  const RepairSource repair{p.x, p.act_dtype, p.weights.phi,
                            GammaOf(*p.spec, p.weights.gamma)};
  return LaunchProjectionFinish(*p.spec, p.tokens, p.act_dtype,
                                static_cast<const float*>(ws.data), p.h,
                                p.mean_square, &repair, stream);
}

namespace {

// LaunchDxAndPhiGrads for the plan of a's tensors.
absl::Status LaunchPlannedDxAndPhiGrads(const DxArgs& args,
                                        const ProjectionBackwardPlan& plan,
                                        const PhiGradArgs& g,
                                        const ColumnSumArgs* column_sums,
                                        cudaStream_t stream) {
  // Only the wgmma_n4_terms kernel (a wave at most) lets dependents launch
  // past its wait: beside the multi-wave mma kernel, whose last wave they
  // would share, they cost more than they save (docs/decisions.md). After
  // any other dx kernel the sums run beside the dphi reduction where one
  // follows, else after the last kernel.
  const bool sums = column_sums != nullptr && (column_sums->out_a != nullptr ||
                                               column_sums->out_b != nullptr);
  const bool beside_dx =
      sums && plan.variant == ProjectionBackwardVariant::kWgmmaN4Terms;
  const bool reduce = args.dphi_partial != nullptr && !plan.grads_in_kernel;
  DxArgs a = args;
  a.dependents_beside = beside_dx;
  if (a.dphi_partial != nullptr && plan.grads_in_kernel) a.grads = &g;
  MHC_RETURN_IF_ERROR(LaunchDxAndPhiPartials(a, plan, stream));
  if (beside_dx) {
    MHC_RETURN_IF_ERROR(
        LaunchColumnSum(*column_sums, stream, /*rows_before_previous=*/true));
  }
  if (reduce) {
    MHC_RETURN_IF_ERROR(
        LaunchPhiGradReduce(*a.spec, a.tokens, a.dphi_partial, g.phi, g.gamma,
                            g.grads_phi, g.grads_gamma, stream, g.repair,
                            /*dependents_beside=*/sums && !beside_dx));
  } else if (a.dphi_partial == nullptr && g.repair != nullptr) {
    MHC_RETURN_IF_ERROR(
        LaunchRepairBackward(*a.spec, a.tokens, *g.repair, stream));
  }
  if (!sums || beside_dx) return absl::OkStatus();
  return LaunchColumnSum(*column_sums, stream, /*rows_before_previous=*/true);
}

}  // namespace

absl::Status LaunchDxAndPhiGrads(const DxArgs& a, const PhiGradArgs& g,
                                 cudaStream_t stream,
                                 const ColumnSumArgs* column_sums) {
  return LaunchPlannedDxAndPhiGrads(
      a,
      PlanProjectionBackward(*a.spec, a.act_dtype, a.tokens,
                             BackwardAlignmentOf(a), TermsOf(a)),
      g, column_sums, stream);
}

absl::Status LaunchProjectionBackward(const ProjectionBackwardParams& p,
                                      Workspace ws, unsigned* arrivals,
                                      cudaStream_t stream) {
  const ProjectionBackwardPlan plan = PlanOf(p);
  const bool want_grads =
      p.grads.phi != nullptr || (p.spec->has_gamma && p.grads.gamma != nullptr);
  const size_t scratch = plan.workspace.wide_scratch;
  // The dphi partials, the split chunks' partials, the wide scratch.
  const size_t partial_bytes =
      plan.workspace.dphi_partials + plan.workspace.split_partials;
  if ((want_grads || scratch > 0) && ws.bytes < partial_bytes + scratch) {
    return absl::InvalidArgumentError(
        absl::StrCat(Label("backward", ToString(plan.variant), *p.spec,
                           p.tokens, p.act_dtype),
                     ": workspace too small"));
  }
  DxArgs a;
  a.spec = p.spec;
  a.tokens = p.tokens;
  a.act_dtype = p.act_dtype;
  a.x = p.x;
  a.phi = p.weights.phi;
  a.gamma = p.weights.gamma;
  a.dh = p.dh;
  a.dms = p.dmean_square;
  a.dx = p.dx;
  a.dphi_partial = want_grads ? static_cast<float*>(ws.data) : nullptr;
  a.split_partials =
      want_grads ? reinterpret_cast<float*>(static_cast<char*>(ws.data) +
                                            plan.workspace.dphi_partials)
                 : nullptr;
  a.split_arrivals = arrivals;
  a.wide_scratch =
      scratch > 0 ? static_cast<char*>(ws.data) + partial_bytes : nullptr;
  PhiGradArgs g;
  g.phi = p.weights.phi;
  g.gamma = p.weights.gamma;
  g.grads_phi = p.grads.phi;
  g.grads_gamma = p.grads.gamma;
  return LaunchPlannedDxAndPhiGrads(a, plan, g, /*column_sums=*/nullptr,
                                    stream);
}

}  // namespace mhc::cuda
