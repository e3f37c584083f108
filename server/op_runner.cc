#include "server/op_runner.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
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
#include "server/determinism_audit.h"
#include "server/op_defs.h"
#include "server/status_util.h"

namespace mhc::server {

namespace {

using google::protobuf::Message;
using google::protobuf::Reflection;

constexpr size_t kAlignment = 16;
constexpr size_t kMaxOpId = 64;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using HostBuffer = std::unique_ptr<void, FreeDeleter>;

absl::StatusOr<HostBuffer> AllocateHost(size_t bytes) {
  if (bytes == 0) return HostBuffer();
  constexpr size_t kLine = 64;
  void* p = std::aligned_alloc(kLine, (bytes + kLine - 1) / kLine * kLine);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes of host memory"));
  }
  return HostBuffer(p);
}

bool Aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % kAlignment == 0;
}

struct PlannedInput {
  bool present = false;
  TensorInfo info;
  absl::string_view bytes;  // inline data of the request
  int source = -1;          // an earlier output of the batch (Execute refs)
  const void* data = nullptr;
  bool device = false;  // data is device memory of a CUDA region
  HostBuffer scratch;
};

struct PlannedOutput {
  std::string name;  // "<op id>.<field>", or the field for single RPCs
  TensorInfo info;
  v1::TensorRef* dest = nullptr;  // set when the client gets it back
  void* data = nullptr;           // where the op writes, backend memory
  HostBuffer scratch;
  bool copy_to_dest = false;  // data is not dest's own bytes
  // An output_regions destination: written in place, returned as shm.
  std::optional<v1::SharedMemoryRef> region;
  RegionSpan span;
  bool copy_to_region = false;  // data is not the region's bytes
};

struct PlannedOp {
  const OpDef* def = nullptr;
  std::string context;  // message prefix, "ops[2] (pre1): " in a batch
  std::shared_ptr<Layer> layer;
  int64_t tokens = 0;
  DType act_dtype = DType::kF32;
  std::vector<PlannedInput> inputs;  // by input slot
  std::vector<int> outputs;          // by output slot; -1: not produced
  bool accumulate = false;
  // Device backends: the last upload of its host inputs, which it waits for.
  CopyTicket upload = kNoCopy;
};

// Everything one request runs: its ops in order and the arena of their
// outputs. Outputs are held by pointer so their addresses stay put.
struct Batch {
  std::vector<PlannedOp> ops;
  std::vector<std::unique_ptr<PlannedOutput>> outputs;
  absl::flat_hash_map<std::string, int> by_name;
};

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

// Sets dest's dtype and shape; a region output is returned as its shm
// reference, without bytes.
void DescribeDest(const PlannedOutput& out) {
  out.dest->set_dtype(DTypeToProto(out.info.dtype));
  out.dest->clear_shape();
  for (int64_t d : out.info.shape) out.dest->add_shape(d);
  if (out.region.has_value()) {
    *out.dest->mutable_shm() = *out.region;
  } else {
    out.dest->mutable_inline_data()->resize(out.info.bytes);
  }
}

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

// Sets dest's dtype and shape and chooses where the op writes: into dest's
// bytes when the backend can address them, else into scratch.
absl::Status PrepareHostOutput(PlannedOutput& out) {
  if (out.dest != nullptr) DescribeDest(out);
  if (out.region.has_value()) {
    if (out.info.bytes == 0 || Aligned(out.span.data)) {
      out.data = out.span.data;
      return absl::OkStatus();
    }
    out.copy_to_region = true;
  } else if (out.dest != nullptr) {
    std::string* bytes = out.dest->mutable_inline_data();
    if (out.info.bytes == 0 || Aligned(bytes->data())) {
      out.data = bytes->data();
      return absl::OkStatus();
    }
    out.copy_to_dest = true;
  }
  MHC_ASSIGN_OR_RETURN(out.scratch, AllocateHost(out.info.bytes));
  out.data = out.scratch.get();
  return absl::OkStatus();
}

absl::Status PrepareHostInput(PlannedInput& in) {
  if (in.bytes.empty() || Aligned(in.bytes.data())) {
    in.data = in.bytes.data();
    return absl::OkStatus();
  }
  MHC_ASSIGN_OR_RETURN(in.scratch, AllocateHost(in.bytes.size()));
  std::memcpy(in.scratch.get(), in.bytes.data(), in.bytes.size());
  in.data = in.scratch.get();
  return absl::OkStatus();
}

// What the executor records about one launch of `op`.
KernelSample SampleOf(const Batch& batch, const PlannedOp& op) {
  KernelSample sample;
  sample.kind = op.def->kind;
  sample.dtype = op.act_dtype;
  sample.layout = op.layer->spec().layout;
  sample.n = op.layer->spec().n;
  sample.tokens = op.tokens;
  for (const PlannedInput& in : op.inputs) {
    if (in.present) sample.bytes += in.info.bytes;
  }
  for (int index : op.outputs) {
    if (index >= 0) sample.bytes += batch.outputs[index]->info.bytes;
  }
  return sample;
}

void Audit(DeterminismAudit& audit, Backend& backend, Workspace ws,
           const Batch& batch, const PlannedOp& op, const BoundOp& bound) {
  AuditedLaunch launch;
  launch.kind = op.def->kind;
  launch.launch = op.def->launch;
  launch.bound = &bound;
  launch.layer = op.layer->Describe();
  for (const PlannedInput& in : op.inputs) {
    launch.input_bytes.push_back(in.present ? in.info.bytes : 0);
  }
  for (size_t j = 0; j < op.outputs.size(); ++j) {
    AuditedLaunch::Output out;
    out.name = op.def->outputs[j].name;
    if (op.outputs[j] >= 0) {
      const PlannedOutput& planned = *batch.outputs[op.outputs[j]];
      out.dtype = planned.info.dtype;
      out.bytes = planned.info.bytes;
    }
    launch.outputs.push_back(std::move(out));
  }
  audit.MaybeAudit(backend, ws, launch);
}

// Runs `op`, whose tensors are bound to backend memory: checks that its
// layer is still current, launches it through the executor (which times
// it), audits it when sampled and counts its gradient tokens.
absl::Status LaunchOp(Executor& executor, Backend& backend, Workspace ws,
                      const Batch& batch, const PlannedOp& op) {
  MHC_RETURN_IF_ERROR(Annotate(op.layer->CheckCurrent(), op.context));
  BoundOp bound;
  bound.spec = &op.layer->spec();
  bound.tokens = op.tokens;
  bound.act_dtype = op.act_dtype;
  bound.weights = op.layer->Weights();
  if (op.accumulate) bound.grads = op.layer->Grads();
  for (const PlannedInput& in : op.inputs) {
    bound.in.push_back(!in.present      ? nullptr
                       : in.source >= 0 ? batch.outputs[in.source]->data
                                        : in.data);
  }
  for (int index : op.outputs) {
    bound.out.push_back(index < 0 ? nullptr : batch.outputs[index]->data);
  }
  absl::Status status = executor.Launch(
      SampleOf(batch, op), [&] { return op.def->launch(backend, bound, ws); });
  if (!status.ok()) {
    absl::StatusCode code =
        status.code() == absl::StatusCode::kResourceExhausted
            ? status.code()
            : absl::StatusCode::kInternal;
    return absl::Status(
        code, absl::StrCat(op.context, op.def->rpc, " on ",
                           op.layer->Describe(), " failed in the ",
                           backend.Name(), " backend: ", status.message()));
  }
  DeterminismAudit* audit = executor.audit();
  if (audit != nullptr && audit->active()) {
    Audit(*audit, backend, ws, batch, op, bound);
  }
  if (op.accumulate && op.def->counts_tokens) {
    op.layer->AddGradientTokens(op.tokens);
  }
  return absl::OkStatus();
}

// Host backends: the ops read and write the request's memory in place
// (PrepareHostInput/Output); only misaligned tensors are copied.
absl::Status RunOnHost(Batch& batch, Executor& executor, Backend& backend,
                       Workspace ws) {
  for (const PlannedOp& op : batch.ops) {
    MHC_RETURN_IF_ERROR(LaunchOp(executor, backend, ws, batch, op));
    for (int index : op.outputs) {
      if (index < 0) continue;
      const PlannedOutput& out = *batch.outputs[index];
      if (out.info.bytes == 0) continue;
      if (out.copy_to_region) {
        std::memcpy(out.span.data, out.data, out.info.bytes);
      } else if (out.copy_to_dest) {
        std::memcpy(out.dest->mutable_inline_data()->data(), out.data,
                    out.info.bytes);
      }
    }
  }
  return absl::OkStatus();
}

// Kernels write a CUDA-region output in place; every other output of a
// device backend lives in staging memory first.
bool WrittenInPlace(const PlannedOutput& out) {
  return out.region.has_value() && out.span.device;
}

bool Staged(const PlannedInput& in) {
  return in.present && in.source < 0 && !in.device;
}

// The staging memory `batch` takes on a backend without host access.
uint64_t StagingBytes(const Batch& batch) {
  uint64_t bytes = 0;
  for (const PlannedOp& op : batch.ops) {
    for (const PlannedInput& in : op.inputs) {
      if (Staged(in)) bytes += StagingArena::Footprint(in.info.bytes);
    }
  }
  for (const auto& out : batch.outputs) {
    if (!WrittenInPlace(*out)) {
      bytes += StagingArena::Footprint(out->info.bytes);
    }
  }
  return bytes;
}

// Where the client reads `out` on the host, or null when it stays on the
// device (a CUDA region, or an output of the batch nobody fetches).
void* HostDestination(PlannedOutput& out) {
  if (out.region.has_value()) return out.span.device ? nullptr : out.span.data;
  if (out.dest != nullptr) return out.dest->mutable_inline_data()->data();
  return nullptr;
}

// Backends without host access: binds every tensor to device memory and
// queues the batch's copies and ops, without waiting for any of them.
//
// Every host input is uploaded up front, in op order, and each op waits
// only for its own inputs' uploads: with page-locked sources (pinned
// regions) the copy calls return at once, so the uploads of later ops run
// while earlier ops compute. (Up front, because the executor's kernel timer
// waits for each op before the next is issued: only work queued before an
// op can overlap it.) An output bound for page-locked memory is
// downloaded as soon as its op is issued, overlapping the ops after it; one
// bound for pageable memory (inline bytes, an unpinned region) only after
// the last op, since such a copy holds the host until it is done and would
// delay issuing the rest.
absl::Status IssueOnDevice(Batch& batch, Executor& executor, Backend& backend,
                           Workspace ws, StagingArena& staging,
                           bool* host_copies) {
  for (PlannedOp& op : batch.ops) {
    for (size_t i = 0; i < op.inputs.size(); ++i) {
      PlannedInput& in = op.inputs[i];
      if (!Staged(in)) continue;
      *host_copies = true;
      MHC_ASSIGN_OR_RETURN(void* device, staging.Take(in.info.bytes));
      in.data = device;
      absl::StatusOr<CopyTicket> ticket =
          backend.CopyToDeviceAsync(device, in.bytes.data(), in.bytes.size());
      if (!ticket.ok()) {
        return Annotate(ticket.status(),
                        absl::StrCat(op.context, op.def->inputs[i].name,
                                     ": copy to the device: "));
      }
      // Tickets grow in queue order: the op waits for its last one.
      if (*ticket != kNoCopy) op.upload = *ticket;
    }
  }
  for (auto& out : batch.outputs) {
    if (WrittenInPlace(*out)) {
      out->data = out->span.data;
    } else {
      MHC_ASSIGN_OR_RETURN(out->data, staging.Take(out->info.bytes));
    }
  }
  std::vector<std::pair<const PlannedOp*, PlannedOutput*>> deferred;
  auto download = [&](const PlannedOp& op, PlannedOutput& out) {
    *host_copies = true;
    return Annotate(
        backend.CopyToHostAsync(HostDestination(out), out.data, out.info.bytes),
        absl::StrCat(op.context, out.name, ": copy to the host: "));
  };
  for (const PlannedOp& op : batch.ops) {
    MHC_RETURN_IF_ERROR(
        Annotate(backend.OpsWaitForCopy(op.upload), op.context));
    MHC_RETURN_IF_ERROR(LaunchOp(executor, backend, ws, batch, op));
    for (int index : op.outputs) {
      if (index < 0) continue;
      PlannedOutput& out = *batch.outputs[index];
      if (out.info.bytes == 0 || HostDestination(out) == nullptr) continue;
      if (out.region.has_value() && out.span.pinned) {
        MHC_RETURN_IF_ERROR(download(op, out));
      } else {
        deferred.emplace_back(&op, &out);
      }
    }
  }
  for (auto [op, out] : deferred) MHC_RETURN_IF_ERROR(download(*op, *out));
  return absl::OkStatus();
}

absl::Status RunBatch(Batch& batch, Executor& executor, RegionScope& regions) {
  const bool host = executor.HostAccessible();
  MHC_ASSIGN_OR_RETURN(StreamOrder order,
                       regions.Events(executor.cuda_ordinal()));
  if (host) {
    for (PlannedOp& op : batch.ops) {
      for (PlannedInput& in : op.inputs) {
        if (in.present && in.source < 0) {
          MHC_RETURN_IF_ERROR(PrepareHostInput(in));
        }
      }
    }
    for (auto& out : batch.outputs) {
      MHC_RETURN_IF_ERROR(PrepareHostOutput(*out));
    }
  } else {
    for (auto& out : batch.outputs) {
      if (out->dest != nullptr) DescribeDest(*out);
    }
  }
  auto workspace_bytes = [&](const Backend& backend) {
    size_t bytes = 0;
    for (const PlannedOp& op : batch.ops) {
      bytes =
          std::max(bytes, backend.WorkspaceBytes(op.def->kind, op.layer->spec(),
                                                 op.tokens, op.act_dtype));
    }
    return bytes;
  };
  return executor.Run(
      workspace_bytes, host ? 0 : StagingBytes(batch),
      [&](Backend& backend, Workspace ws, StagingArena& staging) {
        if (host) return RunOnHost(batch, executor, backend, ws);
        absl::Status issued = absl::OkStatus();
        if (order.wait != nullptr) issued = backend.WaitForEvent(order.wait);
        bool host_copies = false;
        if (issued.ok()) {
          issued = IssueOnDevice(batch, executor, backend, ws, staging,
                                 &host_copies);
        }
        if (issued.ok() && order.signal != nullptr) {
          issued = backend.RecordEvent(order.signal);
        }
        // Answered once queued only when the client orders its stream after
        // the signal event and nothing touches host memory: host copies
        // read the request's memory and write the client's, and the next
        // request reuses the staging memory the uploads write. Work on
        // device memory alone is ordered by the stream. A failure waits
        // too, so that nothing still runs on the request's memory.
        if (issued.ok() && order.signal != nullptr && !host_copies) {
          return absl::OkStatus();
        }
        absl::Status synced = executor.Synchronize(backend, "request");
        if (!issued.ok()) return issued;
        if (!synced.ok()) {
          return absl::InternalError(absl::StrCat(
              "the ", backend.Name(),
              " backend failed to finish the request: ", synced.message()));
        }
        return absl::OkStatus();
      });
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

}  // namespace

OpRunner::OpRunner(LayerStore* store, RequestLimits limits)
    : store_(store), limits_(limits) {}

absl::Status OpRunner::RunSingle(OpKind kind, const Message& request,
                                 Message* response, RegionScope* regions) {
  const OpDef& def = GetOpDef(kind);
  Batch batch;
  ByteBudget budget(limits_);
  MHC_RETURN_IF_ERROR(PlanOp(def, request, "", *store_, /*in_batch=*/false,
                             &batch, &budget, regions));
  const Reflection* refl = response->GetReflection();
  const PlannedOp& op = batch.ops.front();
  for (size_t j = 0; j < def.outputs.size(); ++j) {
    if (op.outputs[j] < 0) continue;
    batch.outputs[op.outputs[j]]->dest = static_cast<v1::TensorRef*>(
        refl->MutableMessage(response, def.outputs[j].field));
  }
  MHC_RETURN_IF_ERROR(RunBatch(batch, *op.layer->executor(), *regions));
  return regions->CheckIntact();
}

absl::Status OpRunner::Execute(const v1::ExecuteRequest& request,
                               v1::ExecuteResponse* response,
                               RegionScope* regions) {
  if (request.ops_size() > limits_.max_batch_ops) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ops: at most ", limits_.max_batch_ops,
        " ops per batch (--max_batch_ops), got ", request.ops_size()));
  }
  Batch batch;
  ByteBudget budget(limits_);
  absl::flat_hash_map<std::string, int> ids;
  Executor* executor = nullptr;
  for (int i = 0; i < request.ops_size(); ++i) {
    const v1::Op& op = request.ops(i);
    std::string context = absl::StrCat("ops[", i, "]");
    MHC_RETURN_IF_ERROR(ValidateOpId(op.id(), absl::StrCat(context, ".id")));
    auto [it, inserted] = ids.emplace(op.id(), i);
    if (!inserted) {
      return absl::InvalidArgumentError(
          absl::StrCat(context, ".id: '", op.id(), "' is already used by ops[",
                       it->second, "]"));
    }
    absl::StrAppend(&context, " (", op.id(), "): ");
    const OpDef* def = FindOpDefByOpField(op.op_case());
    if (def == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(context,
                       "op: not set (expected one of projection, "
                       "projection_backward, scale, ..., head_backward)"));
    }
    const Message& sub = op.GetReflection()->GetMessage(
        op, v1::Op::descriptor()->FindFieldByNumber(op.op_case()));
    MHC_RETURN_IF_ERROR(
        Annotate(PlanOp(*def, sub, op.id(), *store_, /*in_batch=*/true, &batch,
                        &budget, regions),
                 context));
    PlannedOp& planned = batch.ops.back();
    planned.context = context;
    if (executor == nullptr) executor = planned.layer->executor();
    if (planned.layer->executor() != executor) {
      return absl::InvalidArgumentError(
          absl::StrCat(context, "layer: ", planned.layer->Describe(), " is on ",
                       planned.layer->executor()->device(),
                       "; every op of a batch must use layers of one device (",
                       executor->device(), ")"));
    }
  }
  std::vector<int> returned;
  if (request.fetch().empty()) {
    for (size_t k = 0; k < batch.outputs.size(); ++k) {
      returned.push_back(static_cast<int>(k));
    }
  }
  for (int i = 0; i < request.fetch_size(); ++i) {
    auto it = batch.by_name.find(request.fetch(i));
    if (it == batch.by_name.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fetch[", i, "]: '", absl::CEscape(request.fetch(i)),
          "' is not an output of this batch (expected \"<op id>.<output "
          "name>\" with an output field of that op's response)"));
    }
    returned.push_back(it->second);
  }
  if (batch.ops.empty()) return absl::OkStatus();
  // All entries first, then pointers: the map never moves them afterwards.
  auto& outputs = *response->mutable_outputs();
  for (int k : returned) outputs[batch.outputs[k]->name];
  for (int k : returned) {
    batch.outputs[k]->dest = &outputs[batch.outputs[k]->name];
  }
  MHC_RETURN_IF_ERROR(RunBatch(batch, *executor, *regions));
  return regions->CheckIntact();
}

}  // namespace mhc::server
