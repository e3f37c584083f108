// How each op's tensor slots reach its Backend call: the slots of every op
// by name, the launch function the op table names for it, and the kernel
// variant the backend picks for it.
#ifndef MHC_SERVER_OP_LAUNCH_H_
#define MHC_SERVER_OP_LAUNCH_H_

#include "absl/status/status.h"
#include "mhc/backend.h"
#include "server/op_defs.h"

namespace mhc::server {

// Each op's tensor slots by name: the index of an input in BoundOp::in and
// OpDef::inputs (outputs likewise). The table places every slot at its
// index, so the order of an op's slots is written here only.
namespace slot {
struct Projection {
  enum In { kX };
  enum Out { kH, kMeanSquare };
};
struct ProjectionBackward {
  enum In { kX, kDh, kDmeanSquare };
  enum Out { kDx };
};
struct Scale {
  enum In { kH, kMeanSquare };
  enum Out { kHPre, kHPost, kLogits };
};
struct ScaleBackward {
  enum In { kH, kMeanSquare, kDhPre, kDhPost, kDlogits };
  enum Out { kDh, kDmeanSquare };
};
struct Sinkhorn {
  enum In { kLogits };
  enum Out { kHRes };
};
struct SinkhornBackward {
  enum In { kLogits, kDhRes };
  enum Out { kDlogits };
};
struct Aggregate {
  enum In { kX, kHPre };
  enum Out { kY };
};
struct AggregateBackward {
  enum In { kX, kHPre, kDy };
  enum Out { kDx, kDhPre };
};
struct Post {
  enum In { kF, kX, kHPost, kHRes };
  enum Out { kXNext };
};
struct PostBackward {
  enum In { kDxNext, kF, kX, kHPost, kHRes };
  enum Out { kDf, kDx, kDhPost, kDhRes };
};
struct Expand {
  enum In { kE };
  enum Out { kX };
};
struct ExpandBackward {
  enum In { kDx };
  enum Out { kDe };
};
struct Pre {
  enum In { kX };
  enum Out { kY, kHPre, kHPost, kHRes, kH, kMeanSquare };
};
struct PreBackward {
  enum In { kX, kDy, kDhPost, kDhRes, kDxNext, kH, kMeanSquare };
  enum Out { kDx };
};
struct Head {
  enum In { kX };
  enum Out { kY, kMix };
};
struct HeadBackward {
  enum In { kX, kDy };
  enum Out { kDx };
};
}  // namespace slot

absl::Status LaunchProjection(Backend& b, const BoundOp& op, Workspace ws);
absl::Status LaunchProjectionBackward(Backend& b, const BoundOp& op,
                                      Workspace ws);
absl::Status LaunchScale(Backend& b, const BoundOp& op, Workspace ws);
absl::Status LaunchScaleBackward(Backend& b, const BoundOp& op, Workspace ws);
absl::Status LaunchSinkhorn(Backend& b, const BoundOp& op, Workspace ws);
absl::Status LaunchSinkhornBackward(Backend& b, const BoundOp& op,
                                    Workspace ws);
absl::Status LaunchAggregate(Backend& b, const BoundOp& op, Workspace ws);
absl::Status LaunchAggregateBackward(Backend& b, const BoundOp& op,
                                     Workspace ws);
absl::Status LaunchPost(Backend& b, const BoundOp& op, Workspace ws);
absl::Status LaunchPostBackward(Backend& b, const BoundOp& op, Workspace ws);
absl::Status LaunchExpand(Backend& b, const BoundOp& op, Workspace ws);
absl::Status LaunchExpandBackward(Backend& b, const BoundOp& op, Workspace ws);
absl::Status LaunchPre(Backend& b, const BoundOp& op, Workspace ws);
absl::Status LaunchPreBackward(Backend& b, const BoundOp& op, Workspace ws);
absl::Status LaunchHead(Backend& b, const BoundOp& op, Workspace ws);
absl::Status LaunchHeadBackward(Backend& b, const BoundOp& op, Workspace ws);

// The kernel variant the backend picks for launching `op` as `kind`
// (Backend::KernelVariant): the `variant` label of the kernel metrics.
absl::string_view KernelVariant(const Backend& b, OpKind kind,
                                const BoundOp& op);

}  // namespace mhc::server

#endif  // MHC_SERVER_OP_LAUNCH_H_
