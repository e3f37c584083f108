// CheckpointStore::Load: check the file and every selected layer's record
// (spec, tensors, name, device, memory) first, then read, verify and upload
// one layer at a time into layers nobody sees yet, and install them all at
// once. Any error on the way drops them: the daemon is as before.
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "convert/spec_convert.h"
#include "google/protobuf/util/message_differencer.h"
#include "mhc/status.h"
#include "server/checkpoint_file.h"
#include "server/checkpoint_format.h"
#include "server/checkpoint_layer.h"
#include "server/checkpoint_store.h"
#include "server/tensor_resolver.h"

namespace mhc::server {

namespace {

struct LayerToLoad {
  const v1::CheckpointLayer* record = nullptr;
  std::shared_ptr<Layer> layer;  // not in the store until all are built
  std::vector<std::string> sections;
  std::optional<v1::CheckpointOptimizerState> optimizer;
};

absl::StatusOr<std::vector<const v1::CheckpointLayer*>> SelectRecords(
    const v1::CheckpointManifest& manifest,
    const google::protobuf::RepeatedPtrField<std::string>& names) {
  absl::flat_hash_map<std::string, const v1::CheckpointLayer*> by_name;
  std::vector<std::string> held;
  for (const v1::CheckpointLayer& record : manifest.layers()) {
    if (!by_name.emplace(record.name(), &record).second) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint is corrupt: layer '", record.name(), "' appears twice"));
    }
    held.push_back(record.name());
  }
  std::vector<const v1::CheckpointLayer*> selected;
  if (names.empty()) {
    for (const v1::CheckpointLayer& record : manifest.layers()) {
      selected.push_back(&record);
    }
    return selected;
  }
  absl::flat_hash_set<std::string> seen;
  for (int i = 0; i < names.size(); ++i) {
    if (!seen.insert(names[i]).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layers[", i, "]: layer '", names[i], "' is listed twice"));
    }
    auto it = by_name.find(names[i]);
    if (it == by_name.end()) {
      return absl::NotFoundError(absl::StrCat(
          "layers[", i, "]: the checkpoint has no layer '", names[i],
          "'; it holds ", held.empty() ? "none" : absl::StrJoin(held, ", ")));
    }
    selected.push_back(it->second);
  }
  return selected;
}

// Everything about one record that can be checked without reading tensor
// data: name, spec, device, and that each tensor is there with its shape.
absl::StatusOr<LayerToLoad> CheckRecord(
    const v1::CheckpointLayer& record, const CheckpointHeader& header,
    const LayerStore& store, const v1::LoadCheckpointRequest& request) {
  const std::string what =
      absl::StrCat("checkpoint layer '", record.name(), "'");
  MHC_RETURN_IF_ERROR(ValidateLayerName(record.name(), what));
  absl::StatusOr<LayerSpec> spec = ResolveSpec(record.preset(), record.spec());
  if (!spec.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", spec.status().message()));
  }
  // The stored spec is fully resolved: it must come back unchanged, or this
  // mhcd would build a different layer from it.
  if (!google::protobuf::util::MessageDifferencer::Equals(SpecToProto(*spec),
                                                          record.spec())) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": its spec does not resolve to itself under preset '",
        record.preset(), "' in this mhcd; the layer cannot be recreated"));
  }
  const std::string& device =
      request.device().empty() ? record.device() : request.device();
  absl::StatusOr<Executor*> executor = store.DeviceFor(device);
  if (!executor.ok() && !request.device().empty()) return executor.status();
  if (!executor.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, " was saved on device '", record.device(),
        "', which this mhcd does not serve (", executor.status().message(),
        "); load with device set to one it does"));
  }
  if (!request.replace() && store.Find(record.name(), "name").ok()) {
    return absl::AlreadyExistsError(
        absl::StrCat("layer '", record.name(),
                     "' already exists; load with replace to overwrite it"));
  }
  LayerToLoad load;
  load.record = &record;
  load.layer =
      std::make_shared<Layer>(record.name(), record.preset(), *spec, *executor);
  std::vector<std::string> names;
  for (const Layer::Param& p : load.layer->params()) names.push_back(p.name);
  if (std::vector<std::string>(record.parameters().begin(),
                               record.parameters().end()) != names) {
    return absl::DataLossError(absl::StrCat(
        what, ": its parameters (", absl::StrJoin(record.parameters(), ", "),
        ") are not those of its spec (", absl::StrJoin(names, ", "), ")"));
  }
  load.sections = {"param"};
  if (record.has_gradients()) load.sections.push_back("grad");
  if (record.has_optimizer()) {
    absl::Status loadable = CheckOptimizerStateLoadable(record.optimizer());
    if (!loadable.ok()) {
      return absl::Status(loadable.code(),
                          absl::StrCat(what, ": ", loadable.message()));
    }
    load.optimizer = record.optimizer();
    for (const std::string& slot : record.optimizer().slots()) {
      load.sections.push_back(OptimizerSection(slot));
    }
  }
  for (const std::string& section : load.sections) {
    for (const Layer::Param& p : load.layer->params()) {
      const std::string name =
          CheckpointTensorName(record.name(), section, p.name);
      auto it = header.tensors.find(name);
      if (it == header.tensors.end()) {
        return absl::DataLossError(
            absl::StrCat(what, ": the checkpoint lacks tensor '", name, "'"));
      }
      if (it->second.shape != p.shape) {
        return absl::DataLossError(
            absl::StrCat(what, ": tensor '", name, "' has shape ",
                         ShapeString(it->second.shape), ", its spec needs ",
                         ShapeString(p.shape)));
      }
    }
  }
  return load;
}

// Reads and verifies the layer's tensors, then fills its new memory.
absl::Status Build(const CheckpointReader& reader, LayerToLoad& load,
                   uint64_t* bytes_read) {
  Layer& layer = *load.layer;
  const size_t count = static_cast<size_t>(layer.parameter_count());
  std::vector<std::vector<float>> host(load.sections.size());
  for (size_t s = 0; s < load.sections.size(); ++s) {
    host[s].resize(count);
    for (const Layer::Param& p : layer.params()) {
      MHC_RETURN_IF_ERROR(reader.ReadTensor(
          CheckpointTensorName(layer.name(), load.sections[s], p.name),
          host[s].data() + p.offset));
      *bytes_read += static_cast<uint64_t>(p.elements) * sizeof(float);
    }
  }
  const v1::CheckpointLayer& record = *load.record;
  return layer.executor()->WithDevice([&](Backend& backend) {
    MHC_RETURN_IF_ERROR(layer.Allocate(backend));
    MHC_ASSIGN_OR_RETURN(
        std::vector<LayerBlock> blocks,
        BlocksToLoad(backend, layer, record.has_gradients(), load.optimizer));
    for (const LayerBlock& block : blocks) {
      size_t s = 0;
      while (s < load.sections.size() && load.sections[s] != block.section) {
        ++s;
      }
      if (s == load.sections.size()) {
        return absl::InternalError(absl::StrCat(
            "LoadCheckpoint: no data for block '", block.section, "'"));
      }
      MHC_RETURN_IF_ERROR(backend.CopyToDevice(block.device, host[s].data(),
                                               count * sizeof(float)));
    }
    layer.set_version(std::max<uint64_t>(1, record.parameters_version()));
    layer.set_gradient_tokens(record.has_gradients() ? record.gradient_tokens()
                                                     : 0);
    return absl::OkStatus();
  });
}

}  // namespace

absl::StatusOr<v1::LoadCheckpointResponse> CheckpointStore::Load(
    const v1::LoadCheckpointRequest& request) {
  const absl::Time start = absl::Now();
  MHC_ASSIGN_OR_RETURN(std::string path,
                       PathOf("LoadCheckpoint", request.name()));
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader =
      CheckpointReader::Open(path);
  if (absl::IsNotFound(reader.status())) {
    return absl::NotFoundError(
        absl::StrCat("name: no checkpoint '", request.name(),
                     "' in --state_dir (ListCheckpoints lists them)"));
  }
  if (!reader.ok()) return reader.status();
  const CheckpointHeader& header = (*reader)->header();
  MHC_ASSIGN_OR_RETURN(std::vector<const v1::CheckpointLayer*> records,
                       SelectRecords(header.manifest, request.layers()));
  std::vector<LayerToLoad> loads;
  uint64_t device_bytes = 0;
  for (const v1::CheckpointLayer* record : records) {
    MHC_ASSIGN_OR_RETURN(LayerToLoad load,
                         CheckRecord(*record, header, *layers_, request));
    // The budget must hold the optimizer state the load allocates too, not
    // just the parameters and gradients.
    const uint64_t slots =
        load.optimizer.has_value() ? load.optimizer->slots_size() : 0;
    device_bytes += load.layer->allocation_bytes() +
                    slots *
                        static_cast<uint64_t>(load.layer->parameter_count()) *
                        sizeof(float);
    loads.push_back(std::move(load));
  }
  MHC_ASSIGN_OR_RETURN(
      LayerStore::Reservation reservation,
      layers_->Reserve(device_bytes,
                       absl::StrCat("the parameters, gradients and "
                                    "optimizer state of checkpoint '",
                                    request.name(), "'")));
  uint64_t bytes_read = 0;
  std::vector<std::shared_ptr<Layer>> built;
  for (LayerToLoad& load : loads) {
    MHC_RETURN_IF_ERROR(Build(**reader, load, &bytes_read));
    built.push_back(load.layer);
  }
  MHC_RETURN_IF_ERROR(
      layers_->Install(built, request.replace(), std::move(reservation)));

  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (metrics_ != nullptr) {
    metrics_->RecordCheckpoint("load", bytes_read, seconds);
  }
  std::sort(built.begin(), built.end(),
            [](const auto& a, const auto& b) { return a->name() < b->name(); });
  v1::LoadCheckpointResponse response;
  for (const auto& layer : built) {
    layers_->FillInfo(*layer, response.add_layers());
  }
  response.set_bytes(bytes_read);
  response.set_seconds(seconds);
  return response;
}

}  // namespace mhc::server
