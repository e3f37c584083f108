// CheckpointStore::Save: plan the file (every tensor's place is known from
// the layers' shapes), stream each layer into a temp file as it is read
// from its device, then write the header with the checksums and commit.
#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "convert/spec_convert.h"
#include "mhc/status.h"
#include "server/checkpoint_file.h"
#include "server/checkpoint_format.h"
#include "server/checkpoint_layer.h"
#include "server/checkpoint_store.h"
#include "server/crc32c.h"

#ifndef MHC_VERSION
#define MHC_VERSION "0.0.0"
#endif

namespace mhc::server {

namespace {

// One layer's place in the file: its tensors are contiguous, block by
// block, each block in parameter order.
struct PlannedLayer {
  std::shared_ptr<Layer> layer;
  std::vector<std::string> sections;  // of the blocks, in file order
  uint64_t begin = 0;                 // data offset of its first tensor
  uint64_t bytes = 0;
  v1::CheckpointLayer* record = nullptr;  // in the header's manifest
};

absl::StatusOr<std::vector<std::shared_ptr<Layer>>> SelectLayers(
    const LayerStore& store,
    const google::protobuf::RepeatedPtrField<std::string>& names) {
  if (names.empty()) return store.List();
  std::vector<std::shared_ptr<Layer>> layers;
  absl::flat_hash_set<std::string> seen;
  for (int i = 0; i < names.size(); ++i) {
    const std::string field = absl::StrCat("layers[", i, "]");
    if (!seen.insert(names[i]).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": layer '", names[i], "' is listed twice"));
    }
    MHC_ASSIGN_OR_RETURN(layers.emplace_back(), store.Find(names[i], field));
  }
  std::sort(layers.begin(), layers.end(),
            [](const auto& a, const auto& b) { return a->name() < b->name(); });
  return layers;
}

std::vector<std::string> Sections(const std::vector<LayerBlock>& blocks) {
  std::vector<std::string> sections;
  for (const LayerBlock& block : blocks) sections.push_back(block.section);
  return sections;
}

// The header with every number that a save fills in late at its widest,
// so that the real header fits the space this one reserves.
absl::StatusOr<uint64_t> ReservedHeaderBytes(CheckpointHeader header) {
  for (v1::CheckpointLayer& record : *header.manifest.mutable_layers()) {
    record.set_parameters_version(std::numeric_limits<uint64_t>::max());
    record.set_gradient_tokens(std::numeric_limits<int64_t>::max());
    if (record.has_optimizer()) {
      record.mutable_optimizer()->set_step(std::numeric_limits<int64_t>::max());
    }
  }
  MHC_ASSIGN_OR_RETURN(std::string json, EncodeCheckpointHeader(header));
  return json.size();
}

}  // namespace

absl::StatusOr<v1::SaveCheckpointResponse> CheckpointStore::Save(
    const v1::SaveCheckpointRequest& request) {
  const absl::Time start = absl::Now();
  MHC_ASSIGN_OR_RETURN(std::string path,
                       PathOf("SaveCheckpoint", request.name()));
  MHC_ASSIGN_OR_RETURN(std::vector<std::shared_ptr<Layer>> layers,
                       SelectLayers(*layers_, request.layers()));
  const bool gradients = request.include_gradients();
  const bool optimizer = !request.skip_optimizer_state();

  // Plan: the blocks of every layer (asked for under its device, as the
  // optimizer state may come and go), hence every tensor's offsets.
  CheckpointHeader header;
  header.created_by = "mhcd " MHC_VERSION;
  std::vector<PlannedLayer> plan;
  uint64_t data_bytes = 0;
  for (const auto& layer : layers) {
    PlannedLayer& planned = plan.emplace_back();
    planned.layer = layer;
    v1::CheckpointLayer& record = *header.manifest.add_layers();
    planned.record = &record;
    record.set_name(layer->name());
    record.set_preset(layer->preset());
    SpecToProto(layer->spec(), record.mutable_spec());
    record.set_device(layer->executor()->device());
    record.set_has_gradients(gradients);
    for (const Layer::Param& p : layer->params()) record.add_parameters(p.name);
    MHC_RETURN_IF_ERROR(layer->executor()->WithDevice([&](Backend&) {
      MHC_RETURN_IF_ERROR(layer->CheckCurrent());
      std::optional<v1::CheckpointOptimizerState> state;
      if (optimizer) state = OptimizerStateOf(*layer);
      if (state.has_value()) *record.mutable_optimizer() = *state;
      planned.sections = Sections(BlocksToSave(*layer, gradients, optimizer));
      return absl::OkStatus();
    }));
    planned.begin = data_bytes;
    for (const std::string& section : planned.sections) {
      for (const Layer::Param& p : layer->params()) {
        CheckpointTensor& tensor =
            header
                .tensors[CheckpointTensorName(layer->name(), section, p.name)];
        tensor.shape = p.shape;
        tensor.begin = data_bytes;
        tensor.end = data_bytes + static_cast<uint64_t>(p.elements) * 4;
        data_bytes = tensor.end;
      }
    }
    planned.bytes = data_bytes - planned.begin;
  }
  MHC_ASSIGN_OR_RETURN(const uint64_t header_bytes,
                       ReservedHeaderBytes(header));
  const uint64_t data_start = 8 + header_bytes;

  absl::MutexLock lock(&save_mu_);
  MHC_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> file,
                       AtomicFileWriter::Create(
                           options_.state_dir,
                           absl::StrCat(request.name(), kCheckpointExtension),
                           options_.max_write_bytes_per_second));
  // One layer in host memory at a time: read it, checksum it, write it.
  std::vector<char> host;
  for (PlannedLayer& planned : plan) {
    const Layer& layer = *planned.layer;
    host.resize(planned.bytes);
    MHC_RETURN_IF_ERROR(layer.executor()->WithDevice([&](Backend& backend) {
      MHC_RETURN_IF_ERROR(layer.CheckCurrent());
      std::vector<LayerBlock> blocks =
          BlocksToSave(layer, gradients, optimizer);
      if (Sections(blocks) != planned.sections) {
        return absl::AbortedError(absl::StrCat(
            "layer '", layer.name(),
            "': its optimizer state changed during the save; retry"));
      }
      char* out = host.data();
      for (const LayerBlock& block : blocks) {
        for (const Layer::Param& p : layer.params()) {
          const size_t bytes = static_cast<size_t>(p.elements) * sizeof(float);
          MHC_RETURN_IF_ERROR(
              backend.CopyToHost(out, block.device + p.offset, bytes));
          out += bytes;
        }
      }
      // The counters at the same instant as the values.
      planned.record->set_parameters_version(layer.version());
      if (gradients) {
        planned.record->set_gradient_tokens(layer.gradient_tokens());
      }
      if (planned.record->has_optimizer()) {
        std::optional<v1::CheckpointOptimizerState> state =
            OptimizerStateOf(layer);
        if (state.has_value()) {
          planned.record->mutable_optimizer()->set_step(state->step());
        }
      }
      return absl::OkStatus();
    }));
    for (const std::string& section : planned.sections) {
      for (const Layer::Param& p : layer.params()) {
        CheckpointTensor& tensor =
            header.tensors[CheckpointTensorName(layer.name(), section, p.name)];
        tensor.crc32c = Crc32c(0, host.data() + (tensor.begin - planned.begin),
                               tensor.end - tensor.begin);
      }
    }
    MHC_RETURN_IF_ERROR(file->WriteAt(
        data_start + planned.begin,
        absl::string_view(host.data(), static_cast<size_t>(planned.bytes))));
  }
  std::vector<char>().swap(host);

  MHC_ASSIGN_OR_RETURN(std::string json,
                       EncodeCheckpointHeader(header, header_bytes));
  if (json.size() != header_bytes) {
    return absl::InternalError(absl::StrCat("SaveCheckpoint: header grew to ",
                                            json.size(), " bytes beyond the ",
                                            header_bytes, " reserved"));
  }
  std::string prefix(8, '\0');
  for (int i = 0; i < 8; ++i) {
    prefix[i] = static_cast<char>((header_bytes >> (8 * i)) & 0xFF);
  }
  MHC_RETURN_IF_ERROR(file->WriteAt(0, prefix + json));
  MHC_RETURN_IF_ERROR(file->Commit());

  const uint64_t file_bytes = data_start + data_bytes;
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (metrics_ != nullptr) {
    metrics_->RecordCheckpoint("save", file_bytes, seconds);
  }
  v1::SaveCheckpointResponse response;
  response.set_name(request.name());
  response.set_bytes(file_bytes);
  for (const auto& layer : layers) response.add_layers(layer->name());
  response.set_seconds(seconds);
  return response;
}

}  // namespace mhc::server
