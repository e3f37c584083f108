// Launch of the mma variant of the projection backward (mma.cuh): the
// plan's row copies, and the build of the request's dtype.
#include <cstdint>

#include "common.cuh"
#include "dispatch.cuh"
#include "launch.h"
#include "projection/backward/mma_run_maps.cuh"
#include "projection/backward/mma_tiles.cuh"

namespace mhc::cuda {

using namespace dx_mma;  // NOLINT: this file launches the kernel of those tiles

namespace {

// The plan's shared-memory check, pinned to the kernel's own plan for
// every layer shape the variant takes, each dtype, terms case and build.
template <typename T>
constexpr bool PlanSmemAgrees() {
  for (int n = 1; n <= 16; n *= 2) {
    for (int N = 1; N <= kMaxTiles * 8; ++N) {
      for (int c = 0; c < 8; ++c) {
        const bool ieee = c & 1, aggregate = c & 2, residual = c & 4;
        if (PlanSmem<T, false>(n, N, ieee, aggregate, residual).total !=
                proj::DxSmemBytes(sizeof(T), n, N, ieee, aggregate, residual,
                                  false) ||
            PlanSmem<T, true>(n, N, ieee, aggregate, residual).total !=
                proj::DxSmemBytes(sizeof(T), n, N, ieee, aggregate, residual,
                                  true)) {
          return false;
        }
      }
    }
  }
  return true;
}
static_assert(PlanSmemAgrees<float>() && PlanSmemAgrees<__half>() &&
                  PlanSmemAgrees<__nv_bfloat16>(),
              "the plan's shared memory is the kernel's");
// The tensor-copy form of the summed build fits wherever the plan puts the
// cp.async one.
template <typename T>
constexpr bool TensorCopiesFitTheirPlan() {
  for (int c = 0; c < 2; ++c) {
    if (PlanSmem<T, true, true>(4, kSummedLogits, c, true, true).total >
        PlanSmem<T, true>(4, kSummedLogits, c, true, true).total) {
      return false;
    }
  }
  return true;
}
static_assert(TensorCopiesFitTheirPlan<__half>() &&
                  TensorCopiesFitTheirPlan<__nv_bfloat16>(),
              "the tensor-copy build fits the plan's shared memory");
// So does the run-map build, with two CTAs per SM (each with the 1 KB the
// SM reserves per CTA) in an sm_90 SM's 228 KB.
template <typename T>
constexpr bool RunMapsFitTwoPerSm() {
  for (int c = 0; c < 2; ++c) {
    const int total =
        PlanSmem<T, true, false, true>(4, kSummedLogits, c, true, true).total;
    if (total > PlanSmem<T, true>(4, kSummedLogits, c, true, true).total ||
        2 * (total + kMaxRunBoxes * sizeof(RunBox) + 1024) > 228 * 1024) {
      return false;
    }
  }
  return true;
}
static_assert(RunMapsFitTwoPerSm<__half>() &&
                  RunMapsFitTwoPerSm<__nv_bfloat16>(),
              "the run-map build fits the plan, two CTAs per SM");
static_assert(proj::kDxStageTokens == kStageTokens &&
                  proj::kDxMaxTiles == kMaxTiles &&
                  proj::kMaxSmemPerBlock == kMaxSmemPerBlock &&
                  proj::kDxCols == kCols,
              "the plan's geometry is the kernel's");

}  // namespace

absl::Status LaunchMmaDxAndPhiPartials(const DxArgs& a,
                                       const ProjectionBackwardPlan& plan,
                                       cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*a.spec);
  const MmaDxDev d{a.phi,
                   s.has_gamma ? a.gamma : nullptr,
                   a.dh,
                   a.dms,
                   a.h_pre,
                   a.dy,
                   a.r,
                   a.dx_next,
                   a.dx,
                   a.dphi_partial,
                   plan.row_copy,
                   plan.runs16,
                   plan.dx_apart_tokens};
  const bool ieee = a.spec->matmul_precision == MatmulPrecision::kIeee;
  cudaError_t err = cudaSuccess;
  DispatchDType(a.act_dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    err = LaunchDxMmaFor<T>(s, a.tokens, a.x, d, ieee, stream);
  });
  MHC_CUDA_RETURN_IF_ERROR(err, "projection backward mma",
                           LaunchShape(*a.spec, a.tokens, a.act_dtype));
  return absl::OkStatus();
}

}  // namespace mhc::cuda
