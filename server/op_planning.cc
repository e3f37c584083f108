// Planning: a request is validated completely, against its layers and the
// outputs of earlier ops of the batch, before anything runs (op_batch.h).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "convert/spec_convert.h"
#include "google/protobuf/reflection.h"
#include "mhc/status.h"
#include "server/op_batch.h"

namespace mhc::server::op_batch {
namespace {

using google::protobuf::Message;
using google::protobuf::Reflection;

constexpr size_t kMaxOpId = 64;

bool Participates(Need need, const LayerSpec& spec, RequestFlags flags) {
  switch (need) {
    case Need::kRequired:
    case Need::kOptional:
      return true;
    case Need::kIfDynamic:
    case Need::kKeptProjection:
      return spec.dynamic;
    case Need::kIfMhc:
      return spec.kind == LayerKind::kMhc;
    case Need::kUnlessSkipDx:
      return !flags.skip_dx;
    case Need::kIfKeepProjection:
      return spec.dynamic && flags.keep_projection;
  }
  return true;
}

absl::string_view WhyAbsent(Need need) {
  return need == Need::kIfDynamic || need == Need::kKeptProjection
             ? "a static layer"
             : "a HEAD layer";
}

absl::Status CheckLayerRule(const OpDef& def, const Layer& layer) {
  const LayerSpec& spec = layer.spec();
  switch (def.rule) {
    case LayerRule::kAny:
      return absl::OkStatus();
    case LayerRule::kMhc:
      if (spec.kind == LayerKind::kMhc) return absl::OkStatus();
      return absl::FailedPreconditionError(
          absl::StrCat("layer: ", def.rpc, " needs an MHC layer; ",
                       layer.Describe(), " is a HEAD layer (use Head)"));
    case LayerRule::kDynamic:
      if (spec.dynamic) return absl::OkStatus();
      return absl::FailedPreconditionError(
          absl::StrCat("layer: ", def.rpc, " needs a dynamic layer; ",
                       layer.Describe(), " is static (no phi)"));
    case LayerRule::kHead:
      if (spec.kind == LayerKind::kHead) return absl::OkStatus();
      return absl::FailedPreconditionError(
          absl::StrCat("layer: ", def.rpc, " needs a HEAD layer; ",
                       layer.Describe(), " is an MHC layer"));
  }
  return absl::OkStatus();
}

// An input naming an earlier output of the batch; its declared dtype and
// shape, when given, must agree with that output.
absl::Status ResolveRef(const v1::TensorRef& ref, absl::string_view field,
                        const Batch& batch, PlannedInput* input) {
  auto it = batch.by_name.find(ref.ref());
  if (it == batch.by_name.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".ref: '", absl::CEscape(ref.ref()),
        "' is not an output of an earlier op of this batch (expected "
        "\"<op id>.<output name>\")"));
  }
  const PlannedOutput& source = *batch.outputs[it->second];
  if (ref.dtype() != v1::DTYPE_UNSPECIFIED &&
      ref.dtype() != DTypeToProto(source.info.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".dtype: ", ref.ref(), " is ", DTypeLabel(source.info.dtype),
        ", but the reference declares ", v1::DType_Name(ref.dtype())));
  }
  std::vector<int64_t> declared(ref.shape().begin(), ref.shape().end());
  if (!declared.empty() && declared != source.info.shape) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".shape: ", ref.ref(), " has shape ",
                     ShapeString(source.info.shape),
                     ", but the reference declares ", ShapeString(declared)));
  }
  input->info = source.info;
  input->source = it->second;
  return absl::OkStatus();
}

// CUDA regions hold device memory, which a host backend cannot address;
// host regions reach a device backend through copies.
absl::Status CheckReachable(const RegionSpan& span, bool host,
                            absl::string_view field) {
  if (span.device && host) {
    return absl::FailedPreconditionError(absl::StrCat(
        field,
        ": the region is CUDA device memory, and this layer's device "
        "runs on the host; use a system shared-memory region"));
  }
  return absl::OkStatus();
}

}  // namespace

// Validates one op against its layer and the outputs of earlier ops, and
// adds its outputs to the arena. Runs nothing.
absl::Status PlanOp(const OpDef& def, const Message& request,
                    absl::string_view id, const LayerStore& store,
                    bool in_batch, Batch* batch, ByteBudget* budget,
                    RegionScope* regions) {
  const Reflection* refl = request.GetReflection();
  PlannedOp op;
  op.def = &def;
  MHC_ASSIGN_OR_RETURN(
      op.layer, store.Find(refl->GetString(request, def.layer_field), "layer"));
  const Layer& layer = *op.layer;
  const LayerSpec& spec = layer.spec();
  MHC_RETURN_IF_ERROR(CheckLayerRule(def, layer));
  const bool host = op.layer->executor()->HostAccessible();
  RequestFlags flags;
  flags.skip_dx =
      def.skip_dx_field != nullptr && refl->GetBool(request, def.skip_dx_field);
  flags.keep_projection = def.keep_projection_field != nullptr &&
                          refl->GetBool(request, def.keep_projection_field);
  if (flags.keep_projection && !spec.dynamic) {
    return absl::InvalidArgumentError(
        absl::StrCat("keep_projection: ", layer.Describe(),
                     " is static (it has no projection to keep)"));
  }
  op.accumulate =
      def.accumulates && !refl->GetBool(request, def.skip_grads_field);

  OpShapes shapes(layer.Describe());
  op.inputs.resize(def.inputs.size());
  std::vector<absl::string_view> kept_slots, kept_missing;
  for (const SlotDef& slot : def.inputs) {
    if (slot.need != Need::kKeptProjection) continue;
    kept_slots.push_back(slot.name);
    if (!refl->HasField(request, slot.field)) kept_missing.push_back(slot.name);
  }
  if (!kept_missing.empty() && kept_missing.size() != kept_slots.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(def.rpc, ": ", absl::StrJoin(kept_slots, " and "),
                     " (the projection Pre kept) go together; missing ",
                     absl::StrJoin(kept_missing, ", ")));
  }
  for (size_t i = 0; i < def.inputs.size(); ++i) {
    const SlotDef& slot = def.inputs[i];
    const bool wanted = Participates(slot.need, spec, flags);
    const bool has = refl->HasField(request, slot.field);
    if (!wanted) {
      if (has) {
        return absl::InvalidArgumentError(
            absl::StrCat(slot.name, ": must not be set for ",
                         WhyAbsent(slot.need), " (", layer.Describe(), ")"));
      }
      continue;
    }
    if (!has) {
      if (slot.need == Need::kOptional || slot.need == Need::kKeptProjection) {
        continue;
      }
      return absl::InvalidArgumentError(absl::StrCat(
          slot.name, ": required by ", def.rpc, " on ", layer.Describe()));
    }
    const auto& ref = static_cast<const v1::TensorRef&>(
        refl->GetMessage(request, slot.field));
    PlannedInput& input = op.inputs[i];
    input.present = true;
    if (ref.data_case() == v1::TensorRef::kRef) {
      if (!in_batch) {
        return absl::InvalidArgumentError(
            absl::StrCat(slot.name,
                         ".ref: only valid inside Execute (names an earlier "
                         "op's output)"));
      }
      MHC_RETURN_IF_ERROR(ResolveRef(ref, slot.name, *batch, &input));
    } else {
      MHC_ASSIGN_OR_RETURN(input.info, DeclaredInfo(ref, slot.name));
    }
    MHC_RETURN_IF_ERROR(shapes.Match(
        input.info, SlotShape{TrailingDims(slot.dims, spec), slot.activation},
        slot.name));
    if (input.source < 0) {
      if (ref.data_case() == v1::TensorRef::kShm) {
        MHC_ASSIGN_OR_RETURN(
            RegionSpan span,
            regions->Acquire(ref.shm(), input.info.bytes, /*output=*/false,
                             absl::StrCat(slot.name, ".shm")));
        MHC_RETURN_IF_ERROR(CheckReachable(span, host, slot.name));
        input.device = span.device;
        if (span.device) {
          input.data = span.data;
        } else {
          input.bytes = absl::string_view(static_cast<const char*>(span.data),
                                          span.bytes);
        }
      } else {
        // Only bytes that travel in the message count against the limits;
        // a region bounds its own tensors.
        MHC_RETURN_IF_ERROR(budget->Charge(input.info.bytes, slot.name));
        MHC_ASSIGN_OR_RETURN(input.bytes,
                             InlineBytes(ref, input.info, slot.name));
      }
    }
  }
  if (!shapes.has_lead() && def.lead_shape_field != nullptr) {
    const auto lead =
        refl->GetRepeatedFieldRef<int64_t>(request, def.lead_shape_field);
    if (lead.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("lead_shape: required for ", layer.Describe(),
                       ", which is static (no h gives the token shape)"));
    }
    MHC_RETURN_IF_ERROR(shapes.SetLead(
        std::vector<int64_t>(lead.begin(), lead.end()), "lead_shape"));
  }
  if (!shapes.has_lead()) {
    return absl::InvalidArgumentError("no input tensor gives the token shape");
  }
  op.tokens = shapes.tokens();
  op.act_dtype = shapes.act_dtype().value_or(DType::kF32);

  // By output name; entries left after the outputs are planned name none.
  absl::flat_hash_map<std::string, v1::SharedMemoryRef> output_regions;
  const google::protobuf::Descriptor* entry_type =
      def.regions_field->message_type();
  for (int k = 0; k < refl->FieldSize(request, def.regions_field); ++k) {
    const Message& entry =
        refl->GetRepeatedMessage(request, def.regions_field, k);
    const Reflection* entry_refl = entry.GetReflection();
    output_regions[entry_refl->GetString(entry, entry_type->map_key())] =
        static_cast<const v1::SharedMemoryRef&>(
            entry_refl->GetMessage(entry, entry_type->map_value()));
  }
  op.outputs.assign(def.outputs.size(), -1);
  for (size_t j = 0; j < def.outputs.size(); ++j) {
    const SlotDef& slot = def.outputs[j];
    if (!Participates(slot.need, spec, flags)) continue;
    auto out = std::make_unique<PlannedOutput>();
    out->name = id.empty() ? slot.name : absl::StrCat(id, ".", slot.name);
    out->info.dtype = slot.activation ? op.act_dtype : DType::kF32;
    out->info.shape = shapes.lead();
    for (int64_t d : TrailingDims(slot.dims, spec))
      out->info.shape.push_back(d);
    const int64_t size = static_cast<int64_t>(DTypeSize(out->info.dtype));
    absl::StatusOr<int64_t> elements =
        CheckedElementCount(out->info.shape, INT64_MAX / size);
    if (!elements.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(slot.name, ": output shape ",
                       ShapeString(out->info.shape), " is too large"));
    }
    out->info.elements = *elements;
    out->info.bytes = static_cast<uint64_t>(*elements) * size;
    auto it = output_regions.find(slot.name);
    if (it == output_regions.end()) {
      // Returned inline (or, in a batch, possibly not at all: counted all
      // the same, since fetch is resolved after planning).
      MHC_RETURN_IF_ERROR(
          budget->Charge(out->info.bytes, absl::StrCat("output ", slot.name)));
    } else {
      const std::string field =
          absl::StrCat("output_regions[\"", slot.name, "\"]");
      out->region = it->second;
      MHC_ASSIGN_OR_RETURN(out->span,
                           regions->Acquire(it->second, out->info.bytes,
                                            /*output=*/true, field));
      MHC_RETURN_IF_ERROR(CheckReachable(out->span, host, field));
      output_regions.erase(it);
    }
    op.outputs[j] = static_cast<int>(batch->outputs.size());
    batch->by_name[out->name] = op.outputs[j];
    batch->outputs.push_back(std::move(out));
  }
  if (!output_regions.empty()) {
    std::vector<std::string> names;
    for (const auto& [name, ref] : output_regions) names.push_back(name);
    std::sort(names.begin(), names.end());
    return absl::InvalidArgumentError(absl::StrCat(
        "output_regions: '", absl::CEscape(names.front()),
        "' is not an output ", def.rpc, " produces on ", layer.Describe()));
  }
  batch->ops.push_back(std::move(op));
  return absl::OkStatus();
}

absl::Status ValidateOpId(absl::string_view id, absl::string_view field) {
  bool ok = !id.empty() && id.size() <= kMaxOpId;
  for (char c : id) {
    ok = ok && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                (c >= '0' && c <= '9') || c == '_' || c == '-');
  }
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": expected 1..", kMaxOpId, " characters of [A-Za-z0-9_-], got '",
      absl::CEscape(id), "'"));
}

}  // namespace mhc::server::op_batch
