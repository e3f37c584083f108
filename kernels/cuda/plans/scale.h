// The kernel plan of the scale op (scale.cu): for a layer and where its
// tensors start, which kernel turns the logits into gates (and back) and
// how it touches its rows. One table for both directions, first row that
// holds wins. The op's tensors are fp32 whatever the activation dtype, so
// the dtype changes nothing; nothing depends on M.
#ifndef MHC_KERNELS_CUDA_PLANS_SCALE_H_
#define MHC_KERNELS_CUDA_PLANS_SCALE_H_

#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "mhc/types.h"
#include "plans/table.h"

namespace mhc::cuda {

enum class ScaleVariant : uint8_t {
  kN4Vector,  // n = 4: a thread per (token, quarter), 16-byte accesses
  kN4Scalar,  // n = 4, the same threads, each quarter by 4-byte accesses
  kThread,    // everything else: one thread per token (scale.cu)
};
inline constexpr int kNumScaleVariants = 3;

// "n4_vector", "n4_scalar", "thread", as the metrics label and the docs
// spell them.
absl::string_view ToString(ScaleVariant variant);

struct ScalePlan {
  ScaleVariant variant = ScaleVariant::kThread;
  int row = -1;  // of ScaleRows()
  // The n = 4 kernels: quarters of a token's logits, one thread each (N / 4:
  // 6 for mHC, 1 for HEAD).
  int quarters = 0;
};

// `alignment`: the least of the rows the n = 4 kernels move by quarters
// (forward h, h_pre, h_post, logits; backward h, dh, dh_pre, dh_post,
// dlogits). Both directions take the same row.
ScalePlan PlanScale(const LayerSpec& spec, int alignment);

using ScaleRow = PlanRow<ScaleVariant>;
const std::vector<ScaleRow>& ScaleRows();

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PLANS_SCALE_H_
