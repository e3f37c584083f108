#include "server/op_defs.h"

#include <cstdlib>
#include <iostream>
#include <utility>

#include "mhc/v1/ops.pb.h"
#include "mhc/v1/service.pb.h"

namespace mhc::server {

namespace {

using google::protobuf::Descriptor;

const float* F(const void* p) { return static_cast<const float*>(p); }
float* F(void* p) { return static_cast<float*>(p); }

absl::Status LaunchProjection(Backend& b, const BoundOp& op, Workspace ws) {
  ProjectionForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.x = op.in[0];
  p.weights = op.weights;
  p.h = F(op.out[0]);
  p.mean_square = F(op.out[1]);
  return b.ProjectionForward(p, ws);
}

absl::Status LaunchProjectionBackward(Backend& b, const BoundOp& op,
                                      Workspace ws) {
  ProjectionBackwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.x = op.in[0];
  p.weights = op.weights;
  p.dh = F(op.in[1]);
  p.dmean_square = F(op.in[2]);
  p.dx = op.out[0];
  p.grads = op.grads;
  return b.ProjectionBackward(p, ws);
}

absl::Status LaunchScale(Backend& b, const BoundOp& op, Workspace ws) {
  ScaleForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.h = F(op.in[0]);
  p.mean_square = F(op.in[1]);
  p.weights = op.weights;
  p.h_pre = F(op.out[0]);
  p.h_post = F(op.out[1]);
  p.logits = F(op.out[2]);
  return b.ScaleForward(p, ws);
}

absl::Status LaunchScaleBackward(Backend& b, const BoundOp& op, Workspace ws) {
  ScaleBackwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.h = F(op.in[0]);
  p.mean_square = F(op.in[1]);
  p.weights = op.weights;
  p.dh_pre = F(op.in[2]);
  p.dh_post = F(op.in[3]);
  p.dlogits = F(op.in[4]);
  p.dh = F(op.out[0]);
  p.dmean_square = F(op.out[1]);
  p.grads = op.grads;
  return b.ScaleBackward(p, ws);
}

absl::Status LaunchSinkhorn(Backend& b, const BoundOp& op, Workspace ws) {
  SinkhornForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.logits = F(op.in[0]);
  p.h_res = F(op.out[0]);
  return b.SinkhornForward(p, ws);
}

absl::Status LaunchSinkhornBackward(Backend& b, const BoundOp& op,
                                    Workspace ws) {
  SinkhornBackwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.logits = F(op.in[0]);
  p.dh_res = F(op.in[1]);
  p.dlogits = F(op.out[0]);
  return b.SinkhornBackward(p, ws);
}

absl::Status LaunchAggregate(Backend& b, const BoundOp& op, Workspace ws) {
  AggregateForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.x = op.in[0];
  p.h_pre = F(op.in[1]);
  p.y = op.out[0];
  return b.AggregateForward(p, ws);
}

absl::Status LaunchAggregateBackward(Backend& b, const BoundOp& op,
                                     Workspace ws) {
  AggregateBackwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.x = op.in[0];
  p.h_pre = F(op.in[1]);
  p.dy = op.in[2];
  p.dx = op.out[0];
  p.dh_pre = F(op.out[1]);
  return b.AggregateBackward(p, ws);
}

absl::Status LaunchPost(Backend& b, const BoundOp& op, Workspace ws) {
  PostForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.f = op.in[0];
  p.x = op.in[1];
  p.h_post = F(op.in[2]);
  p.h_res = F(op.in[3]);
  p.weights = op.weights;
  p.x_next = op.out[0];
  return b.PostForward(p, ws);
}

absl::Status LaunchPostBackward(Backend& b, const BoundOp& op, Workspace ws) {
  PostBackwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.dx_next = op.in[0];
  p.f = op.in[1];
  p.x = op.in[2];
  p.h_post = F(op.in[3]);
  p.h_res = F(op.in[4]);
  p.weights = op.weights;
  p.df = op.out[0];
  p.dx = op.out[1];
  p.dh_post = F(op.out[2]);
  p.dh_res = F(op.out[3]);
  p.grads = op.grads;
  return b.PostBackward(p, ws);
}

absl::Status LaunchExpand(Backend& b, const BoundOp& op, Workspace ws) {
  ExpandForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.e = op.in[0];
  p.x = op.out[0];
  return b.ExpandForward(p, ws);
}

absl::Status LaunchExpandBackward(Backend& b, const BoundOp& op, Workspace ws) {
  ExpandBackwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.dx = op.in[0];
  p.de = op.out[0];
  return b.ExpandBackward(p, ws);
}

absl::Status LaunchPre(Backend& b, const BoundOp& op, Workspace ws) {
  PreForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.x = op.in[0];
  p.weights = op.weights;
  p.y = op.out[0];
  p.h_pre = F(op.out[1]);
  p.h_post = F(op.out[2]);
  p.h_res = F(op.out[3]);
  p.h = F(op.out[4]);
  p.mean_square = F(op.out[5]);
  return b.PreForward(p, ws);
}

absl::Status LaunchPreBackward(Backend& b, const BoundOp& op, Workspace ws) {
  PreBackwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.x = op.in[0];
  p.weights = op.weights;
  p.dy = op.in[1];
  p.dh_post = F(op.in[2]);
  p.dh_res = F(op.in[3]);
  p.dx_next = op.in[4];
  p.h = F(op.in[5]);
  p.mean_square = F(op.in[6]);
  p.dx = op.out[0];
  p.grads = op.grads;
  return b.PreBackward(p, ws);
}

absl::Status LaunchHead(Backend& b, const BoundOp& op, Workspace ws) {
  HeadForwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.x = op.in[0];
  p.weights = op.weights;
  p.y = op.out[0];
  p.mix = F(op.out[1]);
  return b.HeadForward(p, ws);
}

absl::Status LaunchHeadBackward(Backend& b, const BoundOp& op, Workspace ws) {
  HeadBackwardParams p;
  p.spec = op.spec;
  p.tokens = op.tokens;
  p.act_dtype = op.act_dtype;
  p.x = op.in[0];
  p.weights = op.weights;
  p.dy = op.in[1];
  p.dx = op.out[0];
  p.grads = op.grads;
  return b.HeadBackward(p, ws);
}

SlotDef Act(const char* name, Dims dims, Need need = Need::kRequired) {
  return SlotDef{name, dims, true, need};
}
SlotDef F32(const char* name, Dims dims, Need need = Need::kRequired) {
  return SlotDef{name, dims, false, need};
}

// A table inconsistent with the generated messages is a build defect, found
// at the first start, never a request error.
const google::protobuf::FieldDescriptor* FieldOrDie(const Descriptor* message,
                                                    const std::string& name,
                                                    bool required = true) {
  const google::protobuf::FieldDescriptor* field =
      message->FindFieldByName(name);
  if (field == nullptr && required) {
    std::cerr << "mhcd: op table names missing field " << message->full_name()
              << "." << name << std::endl;
    std::abort();
  }
  return field;
}

OpDef Make(const char* op_field, const char* rpc, OpKind kind, LayerRule rule,
           const Descriptor* request, const Descriptor* response,
           std::vector<SlotDef> inputs, std::vector<SlotDef> outputs,
           LaunchFn launch, bool accumulates = false,
           bool counts_tokens = false) {
  OpDef def;
  def.op_field = op_field;
  def.rpc = rpc;
  def.kind = kind;
  def.rule = rule;
  def.request = request;
  def.response = response;
  def.inputs = std::move(inputs);
  def.outputs = std::move(outputs);
  def.launch = launch;
  def.accumulates = accumulates;
  def.counts_tokens = counts_tokens;
  for (SlotDef& slot : def.inputs) slot.field = FieldOrDie(request, slot.name);
  for (SlotDef& slot : def.outputs) {
    slot.field = FieldOrDie(response, slot.name);
  }
  def.layer_field = FieldOrDie(request, "layer");
  def.regions_field = FieldOrDie(request, "output_regions");
  def.skip_grads_field =
      FieldOrDie(request, "skip_parameter_gradients", accumulates);
  def.skip_dx_field = FieldOrDie(request, "skip_dx", false);
  def.keep_projection_field = FieldOrDie(request, "keep_projection", false);
  def.lead_shape_field = FieldOrDie(request, "lead_shape", false);
  return def;
}

std::vector<OpDef> BuildTable() {
  using K = OpKind;
  using R = LayerRule;
  using D = Dims;
  namespace v1 = ::mhc::v1;
  std::vector<OpDef> t;
  t.push_back(Make("projection", "Projection", K::kProjectionForward,
                   R::kDynamic, v1::ProjectionRequest::descriptor(),
                   v1::ProjectionResponse::descriptor(), {Act("x", D::kX)},
                   {F32("h", D::kLogits), F32("mean_square", D::kToken)},
                   LaunchProjection));
  t.push_back(Make(
      "projection_backward", "ProjectionBackward", K::kProjectionBackward,
      R::kDynamic, v1::ProjectionBackwardRequest::descriptor(),
      v1::ProjectionBackwardResponse::descriptor(),
      {Act("x", D::kX), F32("dh", D::kLogits), F32("dmean_square", D::kToken)},
      {Act("dx", D::kX)}, LaunchProjectionBackward, true));
  t.push_back(
      Make("scale", "Scale", K::kScaleForward, R::kAny,
           v1::ScaleRequest::descriptor(), v1::ScaleResponse::descriptor(),
           {F32("h", D::kLogits, Need::kIfDynamic),
            F32("mean_square", D::kToken, Need::kIfDynamic)},
           {F32("h_pre", D::kStreams), F32("h_post", D::kStreams, Need::kIfMhc),
            F32("logits", D::kMatrix, Need::kIfMhc)},
           LaunchScale));
  t.push_back(Make(
      "scale_backward", "ScaleBackward", K::kScaleBackward, R::kAny,
      v1::ScaleBackwardRequest::descriptor(),
      v1::ScaleBackwardResponse::descriptor(),
      {F32("h", D::kLogits, Need::kIfDynamic),
       F32("mean_square", D::kToken, Need::kIfDynamic),
       F32("dh_pre", D::kStreams), F32("dh_post", D::kStreams, Need::kIfMhc),
       F32("dlogits", D::kMatrix, Need::kIfMhc)},
      {F32("dh", D::kLogits, Need::kIfDynamic),
       F32("dmean_square", D::kToken, Need::kIfDynamic)},
      LaunchScaleBackward, true, true));
  t.push_back(Make(
      "sinkhorn", "Sinkhorn", K::kSinkhornForward, R::kMhc,
      v1::SinkhornRequest::descriptor(), v1::SinkhornResponse::descriptor(),
      {F32("logits", D::kMatrix)}, {F32("h_res", D::kMatrix)}, LaunchSinkhorn));
  t.push_back(Make("sinkhorn_backward", "SinkhornBackward",
                   K::kSinkhornBackward, R::kMhc,
                   v1::SinkhornBackwardRequest::descriptor(),
                   v1::SinkhornBackwardResponse::descriptor(),
                   {F32("logits", D::kMatrix), F32("dh_res", D::kMatrix)},
                   {F32("dlogits", D::kMatrix)}, LaunchSinkhornBackward));
  t.push_back(Make("aggregate", "Aggregate", K::kAggregateForward, R::kAny,
                   v1::AggregateRequest::descriptor(),
                   v1::AggregateResponse::descriptor(),
                   {Act("x", D::kX), F32("h_pre", D::kStreams)},
                   {Act("y", D::kHidden)}, LaunchAggregate));
  t.push_back(Make(
      "aggregate_backward", "AggregateBackward", K::kAggregateBackward, R::kAny,
      v1::AggregateBackwardRequest::descriptor(),
      v1::AggregateBackwardResponse::descriptor(),
      {Act("x", D::kX), F32("h_pre", D::kStreams), Act("dy", D::kHidden)},
      {Act("dx", D::kX), F32("dh_pre", D::kStreams)}, LaunchAggregateBackward));
  t.push_back(Make("post", "Post", K::kPostForward, R::kMhc,
                   v1::PostRequest::descriptor(),
                   v1::PostResponse::descriptor(),
                   {Act("f", D::kHidden), Act("x", D::kX),
                    F32("h_post", D::kStreams), F32("h_res", D::kMatrix)},
                   {Act("x_next", D::kX)}, LaunchPost));
  t.push_back(
      Make("post_backward", "PostBackward", K::kPostBackward, R::kMhc,
           v1::PostBackwardRequest::descriptor(),
           v1::PostBackwardResponse::descriptor(),
           {Act("dx_next", D::kX), Act("f", D::kHidden), Act("x", D::kX),
            F32("h_post", D::kStreams), F32("h_res", D::kMatrix)},
           {Act("df", D::kHidden), Act("dx", D::kX, Need::kUnlessSkipDx),
            F32("dh_post", D::kStreams), F32("dh_res", D::kMatrix)},
           LaunchPostBackward, true));
  t.push_back(Make("expand", "Expand", K::kExpandForward, R::kAny,
                   v1::ExpandRequest::descriptor(),
                   v1::ExpandResponse::descriptor(), {Act("e", D::kHidden)},
                   {Act("x", D::kX)}, LaunchExpand));
  t.push_back(Make("expand_backward", "ExpandBackward", K::kExpandBackward,
                   R::kAny, v1::ExpandBackwardRequest::descriptor(),
                   v1::ExpandBackwardResponse::descriptor(), {Act("dx", D::kX)},
                   {Act("de", D::kHidden)}, LaunchExpandBackward));
  t.push_back(Make("pre", "Pre", K::kPreForward, R::kMhc,
                   v1::PreRequest::descriptor(), v1::PreResponse::descriptor(),
                   {Act("x", D::kX)},
                   {Act("y", D::kHidden), F32("h_pre", D::kStreams),
                    F32("h_post", D::kStreams), F32("h_res", D::kMatrix),
                    F32("h", D::kLogits, Need::kIfKeepProjection),
                    F32("mean_square", D::kToken, Need::kIfKeepProjection)},
                   LaunchPre));
  t.push_back(
      Make("pre_backward", "PreBackward", K::kPreBackward, R::kMhc,
           v1::PreBackwardRequest::descriptor(),
           v1::PreBackwardResponse::descriptor(),
           {Act("x", D::kX), Act("dy", D::kHidden), F32("dh_post", D::kStreams),
            F32("dh_res", D::kMatrix), Act("dx_next", D::kX, Need::kOptional),
            F32("h", D::kLogits, Need::kKeptProjection),
            F32("mean_square", D::kToken, Need::kKeptProjection)},
           {Act("dx", D::kX)}, LaunchPreBackward, true, true));
  t.push_back(Make(
      "head", "Head", K::kHeadForward, R::kHead, v1::HeadRequest::descriptor(),
      v1::HeadResponse::descriptor(), {Act("x", D::kX)},
      {Act("y", D::kHidden), F32("mix", D::kStreams)}, LaunchHead));
  t.push_back(Make("head_backward", "HeadBackward", K::kHeadBackward, R::kHead,
                   v1::HeadBackwardRequest::descriptor(),
                   v1::HeadBackwardResponse::descriptor(),
                   {Act("x", D::kX), Act("dy", D::kHidden)}, {Act("dx", D::kX)},
                   LaunchHeadBackward, true, true));
  // The table is indexed by OpKind and by the Op oneof's field number.
  for (size_t i = 0; i < t.size(); ++i) {
    const auto* field = v1::Op::descriptor()->FindFieldByName(t[i].op_field);
    if (static_cast<int>(t[i].kind) != static_cast<int>(i) ||
        field == nullptr || field->number() != static_cast<int>(i) + 2) {
      std::cerr << "mhcd: op table out of order at " << t[i].op_field
                << std::endl;
      std::abort();
    }
  }
  return t;
}

const std::vector<OpDef>& Table() {
  static const auto* table = new std::vector<OpDef>(BuildTable());
  return *table;
}

}  // namespace

const OpDef& GetOpDef(OpKind kind) {
  return Table()[static_cast<size_t>(kind)];
}

const OpDef* FindOpDefByOpField(int field_number) {
  const int index = field_number - 2;
  if (index < 0 || index >= static_cast<int>(Table().size())) return nullptr;
  return &Table()[index];
}

std::vector<int64_t> TrailingDims(Dims dims, const LayerSpec& spec) {
  const int64_t n = spec.n;
  switch (dims) {
    case Dims::kX:
      return spec.layout == Layout::kStreamMajor
                 ? std::vector<int64_t>{n, spec.hidden}
                 : std::vector<int64_t>{spec.hidden, n};
    case Dims::kHidden:
      return {spec.hidden};
    case Dims::kLogits:
      return {spec.NumLogits()};
    case Dims::kStreams:
      return {n};
    case Dims::kMatrix:
      return {n, n};
    case Dims::kToken:
      return {};
  }
  return {};
}

}  // namespace mhc::server
