// How a column's summed dphi' becomes the phi and gamma gradients, shared by
// the chunk reduction (dphi_reduce.cu) and the dx kernels that add a single
// chunk themselves (wgmma_tile.cuh), so that both give the same bits:
//   grads_phi[g][k] += dphi'[g][k] gamma[k]   (one rounding; gamma 1 without)
//   grads_gamma[k]  += sum over rows r of (sum over g = r mod kPhiGradRows,
//                      in order, of dphi'[g][k] phi[g][k]), rows in order.
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_DPHI_GRADS_CUH_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_DPHI_GRADS_CUH_

#include "launch.h"
#include "overflow_repair.h"

namespace mhc::cuda {

// The rows the dgamma sum is grouped in (the reduction's threads per column).
inline constexpr int kPhiGradRows = 8;

__device__ __forceinline__ float PhiGradAfter(float grad, float dphi_folded,
                                              float gamma_k) {
  return fmaf(dphi_folded, gamma_k, grad);
}

// A dx kernel's kernel-side copy of PhiGradArgs (launch.h) when it adds the
// gradients itself; all null otherwise.
struct DphiGrads {
  float* grads_phi = nullptr;    // null: not asked for
  float* grads_gamma = nullptr;  // null: not asked for, or no gamma
  const float* phi = nullptr;
  const float* gamma = nullptr;  // null without gamma
  RepairBackwardArgs repair;     // count null: no repair pass

  __host__ __device__ bool InKernel() const {
    return grads_phi != nullptr || grads_gamma != nullptr;
  }
};

inline DphiGrads DphiGradsOf(const DxArgs& a,
                             const ProjectionBackwardPlan& plan) {
  DphiGrads d;
  if (!plan.grads_in_kernel || a.grads == nullptr) return d;
  const PhiGradArgs& g = *a.grads;
  d.grads_phi = g.grads_phi;
  d.grads_gamma = a.spec->has_gamma ? g.grads_gamma : nullptr;
  d.phi = g.phi;
  d.gamma = a.spec->has_gamma ? g.gamma : nullptr;
  if (g.repair != nullptr) d.repair = *g.repair;
  return d;
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_DPHI_GRADS_CUH_
