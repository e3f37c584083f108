#include "server/op_launch.h"

namespace mhc::server {

namespace {

const float* F(const void* p) { return static_cast<const float*>(p); }
float* F(void* p) { return static_cast<float*>(p); }

// Each op's params from its slots.
ProjectionForwardParams ProjectionParamsOf(const BoundOp& op) {
  using S = slot::Projection;
  ProjectionForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.x = op.in[S::kX];
  p.weights = op.weights;
  p.h = F(op.out[S::kH]);
  p.mean_square = F(op.out[S::kMeanSquare]);
  return p;
}

ProjectionBackwardParams ProjectionBackwardParamsOf(const BoundOp& op) {
  using S = slot::ProjectionBackward;
  ProjectionBackwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.x = op.in[S::kX];
  p.weights = op.weights;
  p.dh = F(op.in[S::kDh]);
  p.dmean_square = F(op.in[S::kDmeanSquare]);
  p.dx = op.out[S::kDx];
  p.grads = op.grads;
  return p;
}

ScaleForwardParams ScaleParamsOf(const BoundOp& op) {
  using S = slot::Scale;
  ScaleForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.h = F(op.in[S::kH]);
  p.mean_square = F(op.in[S::kMeanSquare]);
  p.weights = op.weights;
  p.h_pre = F(op.out[S::kHPre]);
  p.h_post = F(op.out[S::kHPost]);
  p.logits = F(op.out[S::kLogits]);
  return p;
}

ScaleBackwardParams ScaleBackwardParamsOf(const BoundOp& op) {
  using S = slot::ScaleBackward;
  ScaleBackwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.h = F(op.in[S::kH]);
  p.mean_square = F(op.in[S::kMeanSquare]);
  p.weights = op.weights;
  p.dh_pre = F(op.in[S::kDhPre]);
  p.dh_post = F(op.in[S::kDhPost]);
  p.dlogits = F(op.in[S::kDlogits]);
  p.dh = F(op.out[S::kDh]);
  p.dmean_square = F(op.out[S::kDmeanSquare]);
  p.grads = op.grads;
  return p;
}

SinkhornForwardParams SinkhornParamsOf(const BoundOp& op) {
  using S = slot::Sinkhorn;
  SinkhornForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.logits = F(op.in[S::kLogits]);
  p.h_res = F(op.out[S::kHRes]);
  return p;
}

SinkhornBackwardParams SinkhornBackwardParamsOf(const BoundOp& op) {
  using S = slot::SinkhornBackward;
  SinkhornBackwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.logits = F(op.in[S::kLogits]);
  p.dh_res = F(op.in[S::kDhRes]);
  p.dlogits = F(op.out[S::kDlogits]);
  return p;
}

AggregateForwardParams AggregateParamsOf(const BoundOp& op) {
  using S = slot::Aggregate;
  AggregateForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.x = op.in[S::kX];
  p.h_pre = F(op.in[S::kHPre]);
  p.y = op.out[S::kY];
  return p;
}

AggregateBackwardParams AggregateBackwardParamsOf(const BoundOp& op) {
  using S = slot::AggregateBackward;
  AggregateBackwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.x = op.in[S::kX];
  p.h_pre = F(op.in[S::kHPre]);
  p.dy = op.in[S::kDy];
  p.dx = op.out[S::kDx];
  p.dh_pre = F(op.out[S::kDhPre]);
  return p;
}

PostForwardParams PostParamsOf(const BoundOp& op) {
  using S = slot::Post;
  PostForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.f = op.in[S::kF];
  p.x = op.in[S::kX];
  p.h_post = F(op.in[S::kHPost]);
  p.h_res = F(op.in[S::kHRes]);
  p.weights = op.weights;
  p.x_next = op.out[S::kXNext];
  return p;
}

PostBackwardParams PostBackwardParamsOf(const BoundOp& op) {
  using S = slot::PostBackward;
  PostBackwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.dx_next = op.in[S::kDxNext];
  p.f = op.in[S::kF];
  p.x = op.in[S::kX];
  p.h_post = F(op.in[S::kHPost]);
  p.h_res = F(op.in[S::kHRes]);
  p.weights = op.weights;
  p.df = op.out[S::kDf];
  p.dx = op.out[S::kDx];
  p.dh_post = F(op.out[S::kDhPost]);
  p.dh_res = F(op.out[S::kDhRes]);
  p.grads = op.grads;
  return p;
}

ExpandForwardParams ExpandParamsOf(const BoundOp& op) {
  using S = slot::Expand;
  ExpandForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.e = op.in[S::kE];
  p.x = op.out[S::kX];
  return p;
}

ExpandBackwardParams ExpandBackwardParamsOf(const BoundOp& op) {
  using S = slot::ExpandBackward;
  ExpandBackwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.dx = op.in[S::kDx];
  p.de = op.out[S::kDe];
  return p;
}

PreForwardParams PreParamsOf(const BoundOp& op) {
  using S = slot::Pre;
  PreForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.x = op.in[S::kX];
  p.weights = op.weights;
  p.y = op.out[S::kY];
  p.h_pre = F(op.out[S::kHPre]);
  p.h_post = F(op.out[S::kHPost]);
  p.h_res = F(op.out[S::kHRes]);
  p.h = F(op.out[S::kH]);
  p.mean_square = F(op.out[S::kMeanSquare]);
  return p;
}

PreBackwardParams PreBackwardParamsOf(const BoundOp& op) {
  using S = slot::PreBackward;
  PreBackwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.x = op.in[S::kX];
  p.weights = op.weights;
  p.dy = op.in[S::kDy];
  p.dh_post = F(op.in[S::kDhPost]);
  p.dh_res = F(op.in[S::kDhRes]);
  p.dx_next = op.in[S::kDxNext];
  p.h = F(op.in[S::kH]);
  p.mean_square = F(op.in[S::kMeanSquare]);
  p.dx = op.out[S::kDx];
  p.grads = op.grads;
  return p;
}

HeadForwardParams HeadParamsOf(const BoundOp& op) {
  using S = slot::Head;
  HeadForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.x = op.in[S::kX];
  p.weights = op.weights;
  p.y = op.out[S::kY];
  p.mix = F(op.out[S::kMix]);
  return p;
}

HeadBackwardParams HeadBackwardParamsOf(const BoundOp& op) {
  using S = slot::HeadBackward;
  HeadBackwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.x = op.in[S::kX];
  p.weights = op.weights;
  p.dy = op.in[S::kDy];
  p.dx = op.out[S::kDx];
  p.grads = op.grads;
  return p;
}

}  // namespace

absl::Status LaunchProjection(Backend& b, const BoundOp& op, Workspace ws) {
  return b.ProjectionForward(ProjectionParamsOf(op), ws);
}

absl::Status LaunchProjectionBackward(Backend& b, const BoundOp& op,
                                      Workspace ws) {
  return b.ProjectionBackward(ProjectionBackwardParamsOf(op), ws);
}

absl::Status LaunchScale(Backend& b, const BoundOp& op, Workspace ws) {
  return b.ScaleForward(ScaleParamsOf(op), ws);
}

absl::Status LaunchScaleBackward(Backend& b, const BoundOp& op, Workspace ws) {
  return b.ScaleBackward(ScaleBackwardParamsOf(op), ws);
}

absl::Status LaunchSinkhorn(Backend& b, const BoundOp& op, Workspace ws) {
  return b.SinkhornForward(SinkhornParamsOf(op), ws);
}

absl::Status LaunchSinkhornBackward(Backend& b, const BoundOp& op,
                                    Workspace ws) {
  return b.SinkhornBackward(SinkhornBackwardParamsOf(op), ws);
}

absl::Status LaunchAggregate(Backend& b, const BoundOp& op, Workspace ws) {
  return b.AggregateForward(AggregateParamsOf(op), ws);
}

absl::Status LaunchAggregateBackward(Backend& b, const BoundOp& op,
                                     Workspace ws) {
  return b.AggregateBackward(AggregateBackwardParamsOf(op), ws);
}

absl::Status LaunchPost(Backend& b, const BoundOp& op, Workspace ws) {
  return b.PostForward(PostParamsOf(op), ws);
}

absl::Status LaunchPostBackward(Backend& b, const BoundOp& op, Workspace ws) {
  return b.PostBackward(PostBackwardParamsOf(op), ws);
}

absl::Status LaunchExpand(Backend& b, const BoundOp& op, Workspace ws) {
  return b.ExpandForward(ExpandParamsOf(op), ws);
}

absl::Status LaunchExpandBackward(Backend& b, const BoundOp& op, Workspace ws) {
  return b.ExpandBackward(ExpandBackwardParamsOf(op), ws);
}

absl::Status LaunchPre(Backend& b, const BoundOp& op, Workspace ws) {
  return b.PreForward(PreParamsOf(op), ws);
}

absl::Status LaunchPreBackward(Backend& b, const BoundOp& op, Workspace ws) {
  return b.PreBackward(PreBackwardParamsOf(op), ws);
}

absl::Status LaunchHead(Backend& b, const BoundOp& op, Workspace ws) {
  return b.HeadForward(HeadParamsOf(op), ws);
}

absl::Status LaunchHeadBackward(Backend& b, const BoundOp& op, Workspace ws) {
  return b.HeadBackward(HeadBackwardParamsOf(op), ws);
}

absl::string_view KernelVariant(const Backend& b, OpKind kind,
                                const BoundOp& op) {
  switch (kind) {
    case OpKind::kProjectionForward:
      return b.KernelVariant(ProjectionParamsOf(op));
    case OpKind::kProjectionBackward:
      return b.KernelVariant(ProjectionBackwardParamsOf(op));
    case OpKind::kScaleForward:
      return b.KernelVariant(ScaleParamsOf(op));
    case OpKind::kScaleBackward:
      return b.KernelVariant(ScaleBackwardParamsOf(op));
    case OpKind::kSinkhornForward:
      return b.KernelVariant(SinkhornParamsOf(op));
    case OpKind::kSinkhornBackward:
      return b.KernelVariant(SinkhornBackwardParamsOf(op));
    case OpKind::kAggregateForward:
      return b.KernelVariant(AggregateParamsOf(op));
    case OpKind::kAggregateBackward:
      return b.KernelVariant(AggregateBackwardParamsOf(op));
    case OpKind::kPostForward:
      return b.KernelVariant(PostParamsOf(op));
    case OpKind::kPostBackward:
      return b.KernelVariant(PostBackwardParamsOf(op));
    case OpKind::kExpandForward:
      return b.KernelVariant(ExpandParamsOf(op));
    case OpKind::kExpandBackward:
      return b.KernelVariant(ExpandBackwardParamsOf(op));
    case OpKind::kPreForward:
      return b.KernelVariant(PreParamsOf(op));
    case OpKind::kPreBackward:
      return b.KernelVariant(PreBackwardParamsOf(op));
    case OpKind::kHeadForward:
      return b.KernelVariant(HeadParamsOf(op));
    case OpKind::kHeadBackward:
      return b.KernelVariant(HeadBackwardParamsOf(op));
  }
  return Backend::kDefaultVariant;
}

}  // namespace mhc::server
