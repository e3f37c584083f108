// The kernel plan of the post op (post.cu, post_mma.cu): for a layer, the
// dtype and where its tensors start, whether the stream mixing runs on the
// tensor cores or as the FFMA row kernels, and how those touch their rows
// (plans/row_access.h). One table for both directions, first row that
// holds wins. The bias gradient's workspace is the same for every variant.
// Nothing depends on M.
#ifndef MHC_KERNELS_CUDA_PLANS_POST_H_
#define MHC_KERNELS_CUDA_PLANS_POST_H_

#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "mhc/types.h"
#include "plans/row_access.h"
#include "plans/table.h"

namespace mhc::cuda {

enum class PostVariant : uint8_t {
  kMma,      // tensor cores (post_mma.cu)
  kVector,   // FFMA row kernels (post.cu), RowAccess::kVector
  kStrided,  // FFMA, RowAccess::kStrided
  kElement,  // FFMA, RowAccess::kElement
};
inline constexpr int kNumPostVariants = 4;

// "mma", "vector", "strided", "element", as the metrics label and the docs
// spell them.
absl::string_view ToString(PostVariant variant);

// Per kind of tensor, the least AddressAlignment: the activations (f, x,
// x_next; backward dx_next, f, x, df, dx) and the bias the kernels read
// (none without has_post_bias).
struct PostAlignment {
  int rows = 16;
  int bias = 16;
};

struct PostPlan {
  PostVariant variant = PostVariant::kElement;
  int row = -1;  // of PostRows()
  // The FFMA variants' row access (RowKernel::kPost).
  RowAccessPlan rows;
};

PostPlan PlanPost(const LayerSpec& spec, DType dtype,
                  const PostAlignment& alignment);

using PostRow = PlanRow<PostVariant>;
const std::vector<PostRow>& PostRows();

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PLANS_POST_H_
