#include "server/op_defs.h"

#include <cstdlib>
#include <iostream>

#include "mhc/v1/ops.pb.h"
#include "mhc/v1/service.pb.h"
#include "server/op_launch.h"

namespace mhc::server {

namespace {

using google::protobuf::Descriptor;

// A slot and the index its op's slot enum gives it.
struct PlacedSlot {
  int index;
  SlotDef def;
};

PlacedSlot Act(int index, const char* name, Dims dims,
               Need need = Need::kRequired) {
  return {index, SlotDef{name, dims, true, need}};
}
PlacedSlot F32(int index, const char* name, Dims dims,
               Need need = Need::kRequired) {
  return {index, SlotDef{name, dims, false, need}};
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

// The slots at their indices; every index from 0 must be given once.
std::vector<SlotDef> Ordered(const char* op_field,
                             const std::vector<PlacedSlot>& placed) {
  std::vector<SlotDef> slots(placed.size());
  std::vector<bool> seen(placed.size(), false);
  for (const PlacedSlot& slot : placed) {
    const auto index = static_cast<size_t>(slot.index);
    if (slot.index < 0 || index >= placed.size() || seen[index]) {
      std::cerr << "mhcd: op table places " << op_field << "." << slot.def.name
                << " at index " << slot.index << std::endl;
      std::abort();
    }
    seen[index] = true;
    slots[index] = slot.def;
  }
  return slots;
}

OpDef Make(const char* op_field, const char* rpc, OpKind kind, LayerRule rule,
           const Descriptor* request, const Descriptor* response,
           const std::vector<PlacedSlot>& inputs,
           const std::vector<PlacedSlot>& outputs, LaunchFn launch,
           bool accumulates = false, bool counts_tokens = false) {
  OpDef def;
  def.op_field = op_field;
  def.rpc = rpc;
  def.kind = kind;
  def.rule = rule;
  def.request = request;
  def.response = response;
  def.inputs = Ordered(op_field, inputs);
  def.outputs = Ordered(op_field, outputs);
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
  t.push_back(Make(
      "projection", "Projection", K::kProjectionForward, R::kDynamic,
      v1::ProjectionRequest::descriptor(), v1::ProjectionResponse::descriptor(),
      {Act(slot::Projection::kX, "x", D::kX)},
      {F32(slot::Projection::kH, "h", D::kLogits),
       F32(slot::Projection::kMeanSquare, "mean_square", D::kToken)},
      LaunchProjection));
  t.push_back(Make(
      "projection_backward", "ProjectionBackward", K::kProjectionBackward,
      R::kDynamic, v1::ProjectionBackwardRequest::descriptor(),
      v1::ProjectionBackwardResponse::descriptor(),
      {Act(slot::ProjectionBackward::kX, "x", D::kX),
       F32(slot::ProjectionBackward::kDh, "dh", D::kLogits),
       F32(slot::ProjectionBackward::kDmeanSquare, "dmean_square", D::kToken)},
      {Act(slot::ProjectionBackward::kDx, "dx", D::kX)},
      LaunchProjectionBackward, true));
  t.push_back(
      Make("scale", "Scale", K::kScaleForward, R::kAny,
           v1::ScaleRequest::descriptor(), v1::ScaleResponse::descriptor(),
           {F32(slot::Scale::kH, "h", D::kLogits, Need::kIfDynamic),
            F32(slot::Scale::kMeanSquare, "mean_square", D::kToken,
                Need::kIfDynamic)},
           {F32(slot::Scale::kHPre, "h_pre", D::kStreams),
            F32(slot::Scale::kHPost, "h_post", D::kStreams, Need::kIfMhc),
            F32(slot::Scale::kLogits, "logits", D::kMatrix, Need::kIfMhc)},
           LaunchScale));
  t.push_back(Make(
      "scale_backward", "ScaleBackward", K::kScaleBackward, R::kAny,
      v1::ScaleBackwardRequest::descriptor(),
      v1::ScaleBackwardResponse::descriptor(),
      {F32(slot::ScaleBackward::kH, "h", D::kLogits, Need::kIfDynamic),
       F32(slot::ScaleBackward::kMeanSquare, "mean_square", D::kToken,
           Need::kIfDynamic),
       F32(slot::ScaleBackward::kDhPre, "dh_pre", D::kStreams),
       F32(slot::ScaleBackward::kDhPost, "dh_post", D::kStreams, Need::kIfMhc),
       F32(slot::ScaleBackward::kDlogits, "dlogits", D::kMatrix, Need::kIfMhc)},
      {F32(slot::ScaleBackward::kDh, "dh", D::kLogits, Need::kIfDynamic),
       F32(slot::ScaleBackward::kDmeanSquare, "dmean_square", D::kToken,
           Need::kIfDynamic)},
      LaunchScaleBackward, true, true));
  t.push_back(Make(
      "sinkhorn", "Sinkhorn", K::kSinkhornForward, R::kMhc,
      v1::SinkhornRequest::descriptor(), v1::SinkhornResponse::descriptor(),
      {F32(slot::Sinkhorn::kLogits, "logits", D::kMatrix)},
      {F32(slot::Sinkhorn::kHRes, "h_res", D::kMatrix)}, LaunchSinkhorn));
  t.push_back(
      Make("sinkhorn_backward", "SinkhornBackward", K::kSinkhornBackward,
           R::kMhc, v1::SinkhornBackwardRequest::descriptor(),
           v1::SinkhornBackwardResponse::descriptor(),
           {F32(slot::SinkhornBackward::kLogits, "logits", D::kMatrix),
            F32(slot::SinkhornBackward::kDhRes, "dh_res", D::kMatrix)},
           {F32(slot::SinkhornBackward::kDlogits, "dlogits", D::kMatrix)},
           LaunchSinkhornBackward));
  t.push_back(Make(
      "aggregate", "Aggregate", K::kAggregateForward, R::kAny,
      v1::AggregateRequest::descriptor(), v1::AggregateResponse::descriptor(),
      {Act(slot::Aggregate::kX, "x", D::kX),
       F32(slot::Aggregate::kHPre, "h_pre", D::kStreams)},
      {Act(slot::Aggregate::kY, "y", D::kHidden)}, LaunchAggregate));
  t.push_back(
      Make("aggregate_backward", "AggregateBackward", K::kAggregateBackward,
           R::kAny, v1::AggregateBackwardRequest::descriptor(),
           v1::AggregateBackwardResponse::descriptor(),
           {Act(slot::AggregateBackward::kX, "x", D::kX),
            F32(slot::AggregateBackward::kHPre, "h_pre", D::kStreams),
            Act(slot::AggregateBackward::kDy, "dy", D::kHidden)},
           {Act(slot::AggregateBackward::kDx, "dx", D::kX),
            F32(slot::AggregateBackward::kDhPre, "dh_pre", D::kStreams)},
           LaunchAggregateBackward));
  t.push_back(Make(
      "post", "Post", K::kPostForward, R::kMhc, v1::PostRequest::descriptor(),
      v1::PostResponse::descriptor(),
      {Act(slot::Post::kF, "f", D::kHidden), Act(slot::Post::kX, "x", D::kX),
       F32(slot::Post::kHPost, "h_post", D::kStreams),
       F32(slot::Post::kHRes, "h_res", D::kMatrix)},
      {Act(slot::Post::kXNext, "x_next", D::kX)}, LaunchPost));
  t.push_back(
      Make("post_backward", "PostBackward", K::kPostBackward, R::kMhc,
           v1::PostBackwardRequest::descriptor(),
           v1::PostBackwardResponse::descriptor(),
           {Act(slot::PostBackward::kDxNext, "dx_next", D::kX),
            Act(slot::PostBackward::kF, "f", D::kHidden),
            Act(slot::PostBackward::kX, "x", D::kX),
            F32(slot::PostBackward::kHPost, "h_post", D::kStreams),
            F32(slot::PostBackward::kHRes, "h_res", D::kMatrix)},
           {Act(slot::PostBackward::kDf, "df", D::kHidden),
            Act(slot::PostBackward::kDx, "dx", D::kX, Need::kUnlessSkipDx),
            F32(slot::PostBackward::kDhPost, "dh_post", D::kStreams),
            F32(slot::PostBackward::kDhRes, "dh_res", D::kMatrix)},
           LaunchPostBackward, true));
  t.push_back(Make("expand", "Expand", K::kExpandForward, R::kAny,
                   v1::ExpandRequest::descriptor(),
                   v1::ExpandResponse::descriptor(),
                   {Act(slot::Expand::kE, "e", D::kHidden)},
                   {Act(slot::Expand::kX, "x", D::kX)}, LaunchExpand));
  t.push_back(Make("expand_backward", "ExpandBackward", K::kExpandBackward,
                   R::kAny, v1::ExpandBackwardRequest::descriptor(),
                   v1::ExpandBackwardResponse::descriptor(),
                   {Act(slot::ExpandBackward::kDx, "dx", D::kX)},
                   {Act(slot::ExpandBackward::kDe, "de", D::kHidden)},
                   LaunchExpandBackward));
  t.push_back(
      Make("pre", "Pre", K::kPreForward, R::kMhc, v1::PreRequest::descriptor(),
           v1::PreResponse::descriptor(), {Act(slot::Pre::kX, "x", D::kX)},
           {Act(slot::Pre::kY, "y", D::kHidden),
            F32(slot::Pre::kHPre, "h_pre", D::kStreams),
            F32(slot::Pre::kHPost, "h_post", D::kStreams),
            F32(slot::Pre::kHRes, "h_res", D::kMatrix),
            F32(slot::Pre::kH, "h", D::kLogits, Need::kIfKeepProjection),
            F32(slot::Pre::kMeanSquare, "mean_square", D::kToken,
                Need::kIfKeepProjection)},
           LaunchPre));
  t.push_back(
      Make("pre_backward", "PreBackward", K::kPreBackward, R::kMhc,
           v1::PreBackwardRequest::descriptor(),
           v1::PreBackwardResponse::descriptor(),
           {Act(slot::PreBackward::kX, "x", D::kX),
            Act(slot::PreBackward::kDy, "dy", D::kHidden),
            F32(slot::PreBackward::kDhPost, "dh_post", D::kStreams),
            F32(slot::PreBackward::kDhRes, "dh_res", D::kMatrix),
            Act(slot::PreBackward::kDxNext, "dx_next", D::kX, Need::kOptional),
            F32(slot::PreBackward::kH, "h", D::kLogits, Need::kKeptProjection),
            F32(slot::PreBackward::kMeanSquare, "mean_square", D::kToken,
                Need::kKeptProjection)},
           {Act(slot::PreBackward::kDx, "dx", D::kX)}, LaunchPreBackward, true,
           true));
  t.push_back(Make(
      "head", "Head", K::kHeadForward, R::kHead, v1::HeadRequest::descriptor(),
      v1::HeadResponse::descriptor(), {Act(slot::Head::kX, "x", D::kX)},
      {Act(slot::Head::kY, "y", D::kHidden),
       F32(slot::Head::kMix, "mix", D::kStreams)},
      LaunchHead));
  t.push_back(Make("head_backward", "HeadBackward", K::kHeadBackward, R::kHead,
                   v1::HeadBackwardRequest::descriptor(),
                   v1::HeadBackwardResponse::descriptor(),
                   {Act(slot::HeadBackward::kX, "x", D::kX),
                    Act(slot::HeadBackward::kDy, "dy", D::kHidden)},
                   {Act(slot::HeadBackward::kDx, "dx", D::kX)},
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
