#include "fuzz/seed_requests.h"

#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "convert/spec_convert.h"
#include "fuzz/call_sequence.h"
#include "fuzz/in_process_daemon.h"
#include "google/protobuf/reflection.h"
#include "server/op_defs.h"

namespace mhc::fuzz {
namespace {

using google::protobuf::Message;
using server::Need;
using server::OpDef;

constexpr int64_t kTokens = 2;

// Deterministic values in [-0.5, 0.5): seeds are the same on every run.
float Value(uint32_t& state) {
  state = state * 1664525u + 1013904223u;
  return static_cast<float>(state >> 8) / static_cast<float>(1u << 24) - 0.5f;
}

v1::TensorRef Tensor(v1::DType dtype, std::vector<int64_t> shape,
                     uint32_t seed) {
  v1::TensorRef ref;
  ref.set_dtype(dtype);
  int64_t elements = 1;
  for (int64_t dim : shape) {
    ref.add_shape(dim);
    elements *= dim;
  }
  std::string bytes;
  for (int64_t i = 0; i < elements; ++i) {
    const float value = Value(seed);
    uint32_t bits = 0;
    std::memcpy(&bits, &value, sizeof(bits));
    if (dtype == v1::DTYPE_BF16) {
      const uint16_t half = static_cast<uint16_t>(bits >> 16);
      bytes.append(reinterpret_cast<const char*>(&half), sizeof(half));
    } else {
      bytes.append(reinterpret_cast<const char*>(&bits), sizeof(bits));
    }
  }
  ref.set_inline_data(std::move(bytes));
  return ref;
}

v1::TensorRef Ref(const std::string& output) {
  v1::TensorRef ref;
  ref.set_ref(output);
  return ref;
}

std::vector<int64_t> TokenShape(const std::vector<int64_t>& trailing) {
  std::vector<int64_t> shape = {kTokens};
  shape.insert(shape.end(), trailing.begin(), trailing.end());
  return shape;
}

bool Takes(Need need, const LayerSpec& spec, bool with_optional) {
  switch (need) {
    case Need::kRequired:
      return true;
    case Need::kOptional:
      return with_optional;
    case Need::kIfDynamic:
      return spec.dynamic;
    case Need::kIfMhc:
      return spec.kind == LayerKind::kMhc;
    case Need::kKeptProjection:
      return with_optional && spec.dynamic;
    case Need::kUnlessSkipDx:
    case Need::kIfKeepProjection:
      return true;
  }
  return true;
}

// `def`'s request on `layer`, every input it takes filled in.
std::shared_ptr<Message> OpRequest(const OpDef& def,
                                   const v1::CreateLayerRequest& layer,
                                   const LayerSpec& spec, v1::DType act,
                                   bool with_optional) {
  std::shared_ptr<Message> request(
      google::protobuf::MessageFactory::generated_factory()
          ->GetPrototype(def.request)
          ->New());
  const google::protobuf::Reflection& reflection = *request->GetReflection();
  reflection.SetString(request.get(), def.layer_field, layer.name());
  uint32_t seed = 1;
  for (const server::SlotDef& slot : def.inputs) {
    if (!Takes(slot.need, spec, with_optional)) continue;
    const v1::DType dtype = slot.activation ? act : v1::DTYPE_F32;
    reflection.MutableMessage(request.get(), slot.field)
        ->CopyFrom(Tensor(
            dtype, TokenShape(server::TrailingDims(slot.dims, spec)), ++seed));
  }
  if (def.lead_shape_field != nullptr && !spec.dynamic) {
    reflection.AddInt64(request.get(), def.lead_shape_field, kTokens);
  }
  if (def.keep_projection_field != nullptr && with_optional) {
    reflection.SetBool(request.get(), def.keep_projection_field, true);
  }
  return request;
}

template <typename T>
SeedRequest Seed(std::string label, std::string rpc, T request) {
  return {std::move(label),
          std::move(rpc),
          std::make_shared<T>(std::move(request)),
          {}};
}

// head's beta in two pieces, the second at the first's end.
SeedRequest ParameterStreamSeed() {
  const v1::TensorRef beta = Tensor(v1::DTYPE_F32, {4}, 5);
  SeedRequest seed{"SetParametersStream", "SetParametersStream", nullptr, {}};
  for (uint64_t offset : {0, 8}) {
    auto piece = std::make_shared<v1::ParameterChunk>();
    if (offset == 0) piece->set_layer("head");
    piece->set_name("beta");
    piece->add_shape(4);
    piece->set_dtype(v1::DTYPE_F32);
    piece->set_offset(offset);
    piece->set_data(beta.inline_data().substr(offset, 8));
    seed.pieces.push_back(std::move(piece));
  }
  return seed;
}

v1::TensorRef X(v1::DType act = v1::DTYPE_F32) {
  return Tensor(act, {kTokens, 4, 8}, 11);
}

// One forward and backward step of an MHC layer, op by op, every
// intermediate passed by reference. `x_dims`: the trailing dimensions of
// its activations ([n, C] or [C, n]).
v1::ExecuteRequest LayerStep(v1::DType act, const std::string& layer = "l0",
                             const std::vector<int64_t>& x_dims = {4, 8}) {
  const std::vector<int64_t> x_shape = TokenShape(x_dims);
  auto activations = [&] { return Tensor(act, x_shape, 11); };
  v1::ExecuteRequest batch;
  v1::Op* op = batch.add_ops();
  op->set_id("pre");
  op->mutable_pre()->set_layer(layer);
  *op->mutable_pre()->mutable_x() = activations();
  op = batch.add_ops();
  op->set_id("post");
  v1::PostRequest* post = op->mutable_post();
  post->set_layer(layer);
  *post->mutable_f() = Ref("pre.y");
  *post->mutable_x() = activations();
  *post->mutable_h_post() = Ref("pre.h_post");
  *post->mutable_h_res() = Ref("pre.h_res");
  op = batch.add_ops();
  op->set_id("post_bwd");
  v1::PostBackwardRequest* post_bwd = op->mutable_post_backward();
  post_bwd->set_layer(layer);
  *post_bwd->mutable_dx_next() = Tensor(act, x_shape, 12);
  *post_bwd->mutable_f() = Ref("pre.y");
  *post_bwd->mutable_x() = activations();
  *post_bwd->mutable_h_post() = Ref("pre.h_post");
  *post_bwd->mutable_h_res() = Ref("pre.h_res");
  op = batch.add_ops();
  op->set_id("pre_bwd");
  v1::PreBackwardRequest* pre_bwd = op->mutable_pre_backward();
  pre_bwd->set_layer(layer);
  *pre_bwd->mutable_x() = activations();
  *pre_bwd->mutable_dy() = Ref("post_bwd.df");
  *pre_bwd->mutable_dh_post() = Ref("post_bwd.dh_post");
  *pre_bwd->mutable_dh_res() = Ref("post_bwd.dh_res");
  *pre_bwd->mutable_dx_next() = Ref("post_bwd.dx");
  batch.add_fetch("post.x_next");
  batch.add_fetch("pre_bwd.dx");
  return batch;
}

// Pre of l0 taken apart: projection, scale, Sinkhorn, aggregate, then post.
v1::ExecuteRequest PrePieces() {
  v1::ExecuteRequest batch;
  v1::Op* op = batch.add_ops();
  op->set_id("proj");
  op->mutable_projection()->set_layer("l0");
  *op->mutable_projection()->mutable_x() = X();
  op = batch.add_ops();
  op->set_id("scale");
  op->mutable_scale()->set_layer("l0");
  *op->mutable_scale()->mutable_h() = Ref("proj.h");
  *op->mutable_scale()->mutable_mean_square() = Ref("proj.mean_square");
  op = batch.add_ops();
  op->set_id("sk");
  op->mutable_sinkhorn()->set_layer("l0");
  *op->mutable_sinkhorn()->mutable_logits() = Ref("scale.logits");
  op = batch.add_ops();
  op->set_id("agg");
  op->mutable_aggregate()->set_layer("l0");
  *op->mutable_aggregate()->mutable_x() = X();
  *op->mutable_aggregate()->mutable_h_pre() = Ref("scale.h_pre");
  op = batch.add_ops();
  op->set_id("post");
  v1::PostRequest* post = op->mutable_post();
  post->set_layer("l0");
  *post->mutable_f() = Ref("agg.y");
  *post->mutable_x() = X();
  *post->mutable_h_post() = Ref("scale.h_post");
  *post->mutable_h_res() = Ref("sk.h_res");
  return batch;
}

// Expand into streams, the head's contraction and its backward.
v1::ExecuteRequest HeadStep() {
  v1::ExecuteRequest batch;
  v1::Op* op = batch.add_ops();
  op->set_id("expand");
  op->mutable_expand()->set_layer("head");
  *op->mutable_expand()->mutable_e() = Tensor(v1::DTYPE_F32, {kTokens, 8}, 3);
  op = batch.add_ops();
  op->set_id("head");
  op->mutable_head()->set_layer("head");
  *op->mutable_head()->mutable_x() = Ref("expand.x");
  op = batch.add_ops();
  op->set_id("head_bwd");
  op->mutable_head_backward()->set_layer("head");
  *op->mutable_head_backward()->mutable_x() = Ref("expand.x");
  *op->mutable_head_backward()->mutable_dy() = Ref("head.y");
  op = batch.add_ops();
  op->set_id("expand_bwd");
  op->mutable_expand_backward()->set_layer("head");
  *op->mutable_expand_backward()->mutable_dx() = Ref("head_bwd.dx");
  batch.add_fetch("expand_bwd.de");
  return batch;
}

}  // namespace

std::vector<SeedRequest> OpSeedCandidates() {
  std::vector<SeedRequest> seeds;
  for (int field = 2;; ++field) {
    const OpDef* def = server::FindOpDefByOpField(field);
    if (def == nullptr) break;
    for (const v1::CreateLayerRequest& layer : FixtureLayers()) {
      absl::StatusOr<LayerSpec> spec =
          ResolveSpec(layer.preset(), layer.spec());
      if (!spec.ok()) continue;
      for (v1::DType act : {v1::DTYPE_F32, v1::DTYPE_BF16}) {
        for (bool with_optional : {false, true}) {
          seeds.push_back({absl::StrCat(def->rpc, "-", layer.name(), "-",
                                        act == v1::DTYPE_F32 ? "f32" : "bf16",
                                        with_optional ? "-optional" : ""),
                           def->rpc,
                           OpRequest(*def, layer, *spec, act, with_optional),
                           {}});
        }
      }
    }
  }
  return seeds;
}

std::vector<SeedRequest> BatchSeeds() {
  return {
      Seed("layer-step-f32", "Execute", LayerStep(v1::DTYPE_F32)),
      Seed("layer-step-bf16", "Execute", LayerStep(v1::DTYPE_BF16)),
      Seed("pre-pieces", "Execute", PrePieces()),
      Seed("head-step", "Execute", HeadStep()),
  };
}

std::vector<SeedSequence> SequenceSeeds() {
  std::vector<SeedSequence> sequences;
  // n = 3, C = 5, stream-minor, every option away from the preset.
  v1::CreateLayerRequest odd;
  odd.set_name("odd");
  v1::LayerSpec& spec = *odd.mutable_spec();
  spec.set_n(3);
  spec.set_hidden(5);
  spec.set_layout(v1::LAYOUT_STREAM_MINOR);
  spec.set_orientation(v1::ORIENTATION_DEST_ROWS);
  spec.set_sinkhorn_mode(v1::SINKHORN_MODE_LOG);
  spec.set_sinkhorn_iterations(3);
  spec.set_eps_placement(v1::EPS_PLACEMENT_OUTSIDE);
  spec.set_has_gamma(true);
  spec.set_has_post_bias(true);
  spec.set_matmul_precision(v1::MATMUL_PRECISION_IEEE);
  sequences.push_back(
      {"create-odd-then-step",
       {Seed("CreateLayer", "CreateLayer", odd),
        Seed("Execute", "Execute", LayerStep(v1::DTYPE_BF16, "odd", {5, 3}))}});

  v1::ConvertLayoutRequest convert;
  convert.set_layer("l0");
  convert.set_layout(v1::LAYOUT_STREAM_MINOR);
  sequences.push_back(
      {"convert-then-step",
       {Seed("ConvertLayout", "ConvertLayout", convert),
        Seed("Execute", "Execute", LayerStep(v1::DTYPE_F32, "l0", {8, 4}))}});

  v1::SaveCheckpointRequest save;
  save.set_name("c");
  save.set_include_gradients(true);
  v1::DeleteLayerRequest remove;
  remove.set_name("l1");
  v1::LoadCheckpointRequest load;
  load.set_name("c");
  load.add_layers("l1");
  sequences.push_back({"save-delete-load",
                       {Seed("SaveCheckpoint", "SaveCheckpoint", save),
                        Seed("DeleteLayer", "DeleteLayer", remove),
                        Seed("LoadCheckpoint", "LoadCheckpoint", load)}});

  v1::OptimizerStepRequest step;
  step.add_layers("l0");
  step.set_learning_rate(0.1f);
  step.mutable_adamw();
  step.set_zero_gradients(true);
  v1::GetParametersRequest params;
  params.set_layer("l0");
  sequences.push_back({"step-then-optimize",
                       {Seed("Execute", "Execute", LayerStep(v1::DTYPE_F32)),
                        Seed("OptimizerStep", "OptimizerStep", step),
                        Seed("GetParameters", "GetParameters", params)}});
  return sequences;
}

std::string RequestBytes(const SeedRequest& seed) {
  if (seed.request != nullptr) return seed.request->SerializeAsString();
  std::vector<std::string> pieces;
  for (const auto& piece : seed.pieces) {
    pieces.push_back(piece->SerializeAsString());
  }
  return EncodeStream(pieces);
}

std::vector<SeedRequest> ManagementSeeds() {
  std::vector<SeedRequest> seeds;
  seeds.push_back(
      Seed("GetServerInfo", "GetServerInfo", v1::GetServerInfoRequest()));
  seeds.push_back(Seed("ListLayers", "ListLayers", v1::ListLayersRequest()));
  v1::CreateLayerRequest create = FixtureLayers().front();
  create.set_name("new");
  create.set_preset("deepseek_v4");
  seeds.push_back(Seed("CreateLayer", "CreateLayer", create));
  v1::GetLayerRequest get;
  get.set_name("l1");
  seeds.push_back(Seed("GetLayer", "GetLayer", get));
  v1::DeleteLayerRequest remove;
  remove.set_name("l0");
  seeds.push_back(Seed("DeleteLayer", "DeleteLayer", remove));
  v1::GetParametersRequest params;
  params.set_layer("l0");
  params.add_names("beta");
  seeds.push_back(Seed("GetParameters", "GetParameters", params));
  v1::SetParametersRequest set;
  set.set_layer("head");
  (*set.mutable_parameters()->mutable_tensors())["beta"] =
      Tensor(v1::DTYPE_F32, {4}, 5);
  seeds.push_back(Seed("SetParameters", "SetParameters", set));
  seeds.push_back(ParameterStreamSeed());
  v1::GetGradientsRequest grads;
  grads.set_layer("l1");
  seeds.push_back(Seed("GetGradients", "GetGradients", grads));
  v1::ZeroGradientsRequest zero;
  zero.set_layer("l0");
  seeds.push_back(Seed("ZeroGradients", "ZeroGradients", zero));
  v1::ConvertLayoutRequest convert;
  convert.set_layer("l0");
  convert.set_layout(v1::LAYOUT_STREAM_MINOR);
  seeds.push_back(Seed("ConvertLayout", "ConvertLayout", convert));
  v1::OptimizerStepRequest step;
  step.add_layers("l0");
  step.add_layers("head");
  step.set_learning_rate(0.01f);
  step.mutable_adamw()->set_weight_decay(0.1f);
  step.set_max_grad_norm(1.0f);
  step.set_compute_grad_norm(true);
  seeds.push_back(Seed("OptimizerStep-adamw", "OptimizerStep", step));
  step.mutable_sgd()->set_momentum(0.9f);
  step.mutable_sgd()->set_nesterov(true);
  seeds.push_back(Seed("OptimizerStep-sgd", "OptimizerStep", step));
  v1::SaveCheckpointRequest save;
  save.set_name("ckpt");
  save.set_include_gradients(true);
  seeds.push_back(Seed("SaveCheckpoint", "SaveCheckpoint", save));
  seeds.push_back(
      Seed("ListCheckpoints", "ListCheckpoints", v1::ListCheckpointsRequest()));
  return seeds;
}

}  // namespace mhc::fuzz
