#include "server/op_launch.h"

namespace mhc::server {

namespace {

const float* F(const void* p) { return static_cast<const float*>(p); }
float* F(void* p) { return static_cast<float*>(p); }

}  // namespace

namespace {

ProjectionForwardParams ProjectionParams(const BoundOp& op) {
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

}  // namespace

absl::Status LaunchProjection(Backend& b, const BoundOp& op, Workspace ws) {
  return b.ProjectionForward(ProjectionParams(op), ws);
}

absl::string_view ProjectionVariant(const Backend& b, const BoundOp& op) {
  return b.ProjectionVariant(ProjectionParams(op));
}

absl::Status LaunchProjectionBackward(Backend& b, const BoundOp& op,
                                      Workspace ws) {
  return b.ProjectionBackward(ProjectionBackwardParamsOf(op), ws);
}

absl::string_view ProjectionBackwardVariant(const Backend& b,
                                            const BoundOp& op) {
  return b.ProjectionVariant(ProjectionBackwardParamsOf(op));
}

absl::Status LaunchScale(Backend& b, const BoundOp& op, Workspace ws) {
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
  return b.ScaleForward(p, ws);
}

absl::Status LaunchScaleBackward(Backend& b, const BoundOp& op, Workspace ws) {
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
  return b.ScaleBackward(p, ws);
}

absl::Status LaunchSinkhorn(Backend& b, const BoundOp& op, Workspace ws) {
  using S = slot::Sinkhorn;
  SinkhornForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.logits = F(op.in[S::kLogits]);
  p.h_res = F(op.out[S::kHRes]);
  return b.SinkhornForward(p, ws);
}

absl::Status LaunchSinkhornBackward(Backend& b, const BoundOp& op,
                                    Workspace ws) {
  using S = slot::SinkhornBackward;
  SinkhornBackwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.logits = F(op.in[S::kLogits]);
  p.dh_res = F(op.in[S::kDhRes]);
  p.dlogits = F(op.out[S::kDlogits]);
  return b.SinkhornBackward(p, ws);
}

absl::Status LaunchAggregate(Backend& b, const BoundOp& op, Workspace ws) {
  using S = slot::Aggregate;
  AggregateForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.x = op.in[S::kX];
  p.h_pre = F(op.in[S::kHPre]);
  p.y = op.out[S::kY];
  return b.AggregateForward(p, ws);
}

absl::Status LaunchAggregateBackward(Backend& b, const BoundOp& op,
                                     Workspace ws) {
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
  return b.AggregateBackward(p, ws);
}

absl::Status LaunchPost(Backend& b, const BoundOp& op, Workspace ws) {
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
  return b.PostForward(p, ws);
}

absl::Status LaunchPostBackward(Backend& b, const BoundOp& op, Workspace ws) {
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
  return b.PostBackward(p, ws);
}

absl::Status LaunchExpand(Backend& b, const BoundOp& op, Workspace ws) {
  using S = slot::Expand;
  ExpandForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.e = op.in[S::kE];
  p.x = op.out[S::kX];
  return b.ExpandForward(p, ws);
}

absl::Status LaunchExpandBackward(Backend& b, const BoundOp& op, Workspace ws) {
  using S = slot::ExpandBackward;
  ExpandBackwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.dx = op.in[S::kDx];
  p.de = op.out[S::kDe];
  return b.ExpandBackward(p, ws);
}

absl::Status LaunchPre(Backend& b, const BoundOp& op, Workspace ws) {
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
  return b.PreForward(p, ws);
}

absl::Status LaunchPreBackward(Backend& b, const BoundOp& op, Workspace ws) {
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
  return b.PreBackward(p, ws);
}

absl::Status LaunchHead(Backend& b, const BoundOp& op, Workspace ws) {
  using S = slot::Head;
  HeadForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.x = op.in[S::kX];
  p.weights = op.weights;
  p.y = op.out[S::kY];
  p.mix = F(op.out[S::kMix]);
  return b.HeadForward(p, ws);
}

absl::Status LaunchHeadBackward(Backend& b, const BoundOp& op, Workspace ws) {
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
  return b.HeadBackward(p, ws);
}

}  // namespace mhc::server
