// The kernel plan of the Sinkhorn op (sinkhorn.cu): for a layer and where
// its tensors start, which kernel runs and its launch shape. One table,
// first row that holds wins; the direction changes one condition (the
// n = 4 kernel keeps every step's denominators for its reverse mode). The
// launchers, the fused ops (through SinkhornLanesCover), the kernel
// metrics and the docs read it. The logits are fp32 whatever the
// activation dtype; nothing depends on M.
#ifndef MHC_KERNELS_CUDA_PLANS_SINKHORN_H_
#define MHC_KERNELS_CUDA_PLANS_SINKHORN_H_

#include <cfloat>
#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "mhc/types.h"
#include "plans/table.h"

// The n = 4 condition is evaluated on the device too (sinkhorn4.cuh).
#ifdef __CUDACC__
#define MHC_PLAN_HOST_DEVICE __host__ __device__
#else
#define MHC_PLAN_HOST_DEVICE
#endif

namespace mhc::cuda {

enum class SinkhornVariant : uint8_t {
  kN4,      // n = 4 LINEAR: one thread per token (sinkhorn4.cuh)
  kLanes,   // LINEAR, short: lanes per token (sinkhorn_lanes.cuh)
  kThread,  // everything else: one thread per token (sinkhorn.cu)
};
inline constexpr int kNumSinkhornVariants = 3;

// "n4", "lanes", "thread", as the metrics label and the docs spell them.
absl::string_view ToString(SinkhornVariant variant);

// Iterations whose denominators the lane kernels and the n = 4 reverse
// mode keep in shared memory; longer runs take the one-thread path.
inline constexpr int kLaneMaxIterations = 20;

// The fields of a layer the n = 4 condition reads, named as the device's
// DevSpec (common.cuh) names them.
struct SinkhornShape {
  int n;
  bool log_mode;
  int iterations;
  float eps_sk;
};

inline SinkhornShape SinkhornShapeOf(const LayerSpec& s) {
  return {s.n, s.sinkhorn_mode == SinkhornMode::kLog, s.sinkhorn_iterations,
          s.eps_sk};
}

// n = 4 LINEAR with denominators that stay normal (eps_sk >= FLT_MIN: the
// kernel replaces each division by one approximate reciprocal); the reverse
// mode keeps at most kLaneMaxIterations steps. Of a SinkhornShape here, of
// a DevSpec in the fused mixing kernels (sk4::Applies): read field by
// field, so that the device code is the condition as written.
template <typename Spec>
MHC_PLAN_HOST_DEVICE inline bool SinkhornN4Applies(const Spec& s,
                                                   bool backward) {
  return s.n == 4 && !s.log_mode && s.iterations >= 1 && s.eps_sk >= FLT_MIN &&
         (!backward || s.iterations <= kLaneMaxIterations);
}

// Lanes per token in an N x N block: rows are split N / 2 ways (one lane
// for the 2 x 2 block).
constexpr int SinkhornLanesPerToken(int block) {
  return block == 2 ? 1 : block / 2;
}

struct SinkhornPlan {
  SinkhornVariant variant = SinkhornVariant::kThread;
  int row = -1;  // of SinkhornRows()
  // n4: a warp's 32 tokens moved by 16-byte accesses through a shared tile
  // (every tensor on 16 bytes), else each thread's own row by floats.
  bool vector_rows = false;
  int block = 0;        // lanes: the N x N block holding the n x n matrix
  bool padded = false;  // lanes: n < N, the rest held at exact zeros
  int streams = 0;      // thread: per-thread arrays for 4 or kMaxStreams
};

// `alignment`: the least of the op's tensors (logits, h_res; backward also
// dh_res, dlogits).
SinkhornPlan PlanSinkhornForward(const LayerSpec& spec, int alignment);
SinkhornPlan PlanSinkhornBackward(const LayerSpec& spec, int alignment);

// Whether the lane kernels take this layer's Sinkhorn (LINEAR, at most
// kLaneMaxIterations iterations, n from 2 to 16), in either direction: what
// the fused ops' SplitMix layers need (plans/fused.h).
bool SinkhornLanesCover(const LayerSpec& spec);

using SinkhornRow = PlanRow<SinkhornVariant>;
const std::vector<SinkhornRow>& SinkhornRows();

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PLANS_SINKHORN_H_
