// Head (last-layer contraction): mix = sigmoid(s u + b_head) + eps_pre,
// y = sum_i mix[i] x[i][c], forward and backward. The head runs the fused
// pre kernels with the kHead kind (no post group, no Sinkhorn), so it has
// the same determinism / batch invariance: per-token results are independent
// of M, parameter gradients are fixed-order chunk sums (fused_pre.cu).
#include "launch.h"

namespace mhc::cuda {

absl::Status LaunchHeadForward(const HeadForwardParams& p, Workspace ws,
                               cudaStream_t stream) {
  FusedForwardArgs a;
  a.spec = p.spec;
  a.tokens = p.tokens;
  a.act_dtype = p.act_dtype;
  a.x = p.x;
  a.weights = p.weights;
  a.y = p.y;
  a.h_pre = p.mix;
  return LaunchFusedForward(a, ws, stream);
}

absl::Status LaunchHeadBackward(const HeadBackwardParams& p, Workspace ws,
                                cudaStream_t stream) {
  FusedBackwardArgs a;
  a.spec = p.spec;
  a.tokens = p.tokens;
  a.act_dtype = p.act_dtype;
  a.x = p.x;
  a.weights = p.weights;
  a.dy = p.dy;
  a.dx = p.dx;
  a.grads = p.grads;
  return LaunchFusedBackward(a, ws, stream);
}

}  // namespace mhc::cuda
