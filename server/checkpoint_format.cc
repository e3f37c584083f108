#include "server/checkpoint_format.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "mhc/status.h"
#include "mhc/types.h"
#include "server/crc32c.h"
#include "server/json_text.h"

namespace mhc::server {

namespace {

// Metadata keys (all values are strings, as safetensors requires).
constexpr char kFormatKey[] = "format";
constexpr char kVersionKey[] = "format_version";
constexpr char kLayersKey[] = "layers";
constexpr char kLayersCrcKey[] = "layers_crc32c";
constexpr char kChecksumKey[] = "checksum_algorithm";
constexpr char kChecksumsKey[] = "checksums";
constexpr char kCreatedByKey[] = "created_by";
constexpr char kChecksumAlgorithm[] = "crc32c";

// Exactly representable in the double a JSON number becomes.
constexpr double kMaxJsonInteger = 9007199254740992.0;  // 2^53

std::string Hex32(uint32_t value) {
  char text[9];
  std::snprintf(text, sizeof(text), "%08x", value);
  return text;
}

absl::Status Corrupt(absl::string_view what) {
  return absl::DataLossError(
      absl::StrCat("checkpoint header is corrupt: ", what));
}

// A non-negative integer of a JSON value.
absl::StatusOr<uint64_t> JsonInteger(const google::protobuf::Value& value,
                                     absl::string_view what) {
  const double number = value.number_value();
  if (value.kind_case() != google::protobuf::Value::kNumberValue ||
      !(number >= 0) || number > kMaxJsonInteger ||
      std::floor(number) != number) {
    return Corrupt(absl::StrCat(what, " is not a non-negative integer"));
  }
  return static_cast<uint64_t>(number);
}

absl::StatusOr<CheckpointTensor> DecodeTensor(
    const std::string& name, const google::protobuf::Value& value,
    uint64_t data_bytes) {
  if (value.kind_case() != google::protobuf::Value::kStructValue) {
    return Corrupt(absl::StrCat("tensor '", name, "' is not an object"));
  }
  const auto& fields = value.struct_value().fields();
  auto dtype = fields.find("dtype");
  auto shape = fields.find("shape");
  auto offsets = fields.find("data_offsets");
  if (dtype == fields.end() || shape == fields.end() ||
      offsets == fields.end() ||
      shape->second.kind_case() != google::protobuf::Value::kListValue ||
      offsets->second.kind_case() != google::protobuf::Value::kListValue ||
      offsets->second.list_value().values_size() != 2) {
    return Corrupt(
        absl::StrCat("tensor '", name,
                     "' needs dtype, shape and data_offsets [begin, end]"));
  }
  if (dtype->second.string_value() != "F32") {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint tensor '", name, "' has dtype '",
                     dtype->second.string_value(), "'; mhcd holds only F32"));
  }
  CheckpointTensor tensor;
  for (const auto& dim : shape->second.list_value().values()) {
    MHC_ASSIGN_OR_RETURN(uint64_t d,
                         JsonInteger(dim, absl::StrCat(name, " shape")));
    tensor.shape.push_back(static_cast<int64_t>(d));
  }
  MHC_ASSIGN_OR_RETURN(tensor.begin,
                       JsonInteger(offsets->second.list_value().values(0),
                                   absl::StrCat(name, " data_offsets")));
  MHC_ASSIGN_OR_RETURN(tensor.end,
                       JsonInteger(offsets->second.list_value().values(1),
                                   absl::StrCat(name, " data_offsets")));
  MHC_ASSIGN_OR_RETURN(int64_t elements, CheckedElementCount(tensor.shape));
  if (tensor.end < tensor.begin ||
      tensor.end - tensor.begin != static_cast<uint64_t>(elements) * 4) {
    return Corrupt(absl::StrCat("tensor '", name, "' spans bytes [",
                                tensor.begin, ", ", tensor.end, ") but its ",
                                elements, " F32 elements need ", elements * 4));
  }
  if (tensor.end > data_bytes) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint is truncated: tensor '", name, "' ends at data byte ",
        tensor.end, " but the file holds only ", data_bytes,
        " bytes of tensor data"));
  }
  return tensor;
}

absl::StatusOr<std::string> MetadataString(
    const google::protobuf::Struct& metadata, absl::string_view key) {
  auto it = metadata.fields().find(std::string(key));
  if (it == metadata.fields().end() ||
      it->second.kind_case() != google::protobuf::Value::kStringValue) {
    return Corrupt(absl::StrCat("__metadata__ lacks the string '", key, "'"));
  }
  return it->second.string_value();
}

}  // namespace

std::string CheckpointTensorName(absl::string_view layer,
                                 absl::string_view section,
                                 absl::string_view parameter) {
  return absl::StrCat(layer, "/", section, "/", parameter);
}

std::string OptimizerSection(absl::string_view slot) {
  return absl::StrCat("optim/", slot);
}

absl::StatusOr<std::string> EncodeCheckpointHeader(
    const CheckpointHeader& header, uint64_t min_bytes) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string layers;
  if (!google::protobuf::util::MessageToJsonString(header.manifest, &layers,
                                                   options)
           .ok()) {
    return absl::InternalError("checkpoint: could not encode the manifest");
  }
  // Checksums sorted by tensor name (std::map), one JSON object.
  std::string checksums = "{";
  for (const auto& [name, tensor] : header.tensors) {
    if (checksums.size() > 1) checksums.push_back(',');
    AppendJsonString(&checksums, name);
    checksums.push_back(':');
    AppendJsonString(&checksums, Hex32(tensor.crc32c));
  }
  checksums.push_back('}');

  std::string json = "{\"__metadata__\":{";
  const std::pair<const char*, std::string> metadata[] = {
      {kFormatKey, kCheckpointFormat},
      {kVersionKey, absl::StrCat(kCheckpointFormatVersion)},
      {kCreatedByKey, header.created_by},
      {kChecksumKey, kChecksumAlgorithm},
      {kLayersCrcKey, Hex32(Crc32c(0, layers.data(), layers.size()))},
      {kLayersKey, layers},
      {kChecksumsKey, checksums},
  };
  bool first = true;
  for (const auto& [key, value] : metadata) {
    if (!first) json.push_back(',');
    first = false;
    AppendJsonString(&json, key);
    json.push_back(':');
    AppendJsonString(&json, value);
  }
  json.push_back('}');
  for (const auto& [name, tensor] : header.tensors) {
    json.push_back(',');
    AppendJsonString(&json, name);
    absl::StrAppend(&json, ":{\"dtype\":\"F32\",\"shape\":[",
                    absl::StrJoin(tensor.shape, ","), "],\"data_offsets\":[",
                    tensor.begin, ",", tensor.end, "]}");
  }
  json.push_back('}');
  uint64_t size = std::max<uint64_t>(json.size(), min_bytes);
  size += (kCheckpointDataAlignment - (8 + size) % kCheckpointDataAlignment) %
          kCheckpointDataAlignment;
  json.resize(size, ' ');
  return json;
}

absl::StatusOr<CheckpointHeader> DecodeCheckpointHeader(absl::string_view json,
                                                        uint64_t data_bytes) {
  google::protobuf::Struct root;
  if (!google::protobuf::util::JsonStringToMessage(std::string(json), &root)
           .ok()) {
    return Corrupt("not a JSON object");
  }
  auto meta = root.fields().find("__metadata__");
  if (meta == root.fields().end() ||
      meta->second.kind_case() != google::protobuf::Value::kStructValue) {
    return absl::InvalidArgumentError(
        "not an mhcd checkpoint: the safetensors header has no __metadata__");
  }
  const google::protobuf::Struct& metadata = meta->second.struct_value();
  auto format = metadata.fields().find(kFormatKey);
  if (format == metadata.fields().end() ||
      format->second.string_value() != kCheckpointFormat) {
    return absl::InvalidArgumentError(
        absl::StrCat("not an mhcd checkpoint: __metadata__.format is '",
                     format == metadata.fields().end()
                         ? ""
                         : absl::CEscape(format->second.string_value()),
                     "', expected '", kCheckpointFormat, "'"));
  }
  MHC_ASSIGN_OR_RETURN(std::string version,
                       MetadataString(metadata, kVersionKey));
  if (version != absl::StrCat(kCheckpointFormatVersion)) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint format version '", absl::CEscape(version),
                     "' is not one this mhcd reads (version ",
                     kCheckpointFormatVersion, ")"));
  }
  MHC_ASSIGN_OR_RETURN(std::string algorithm,
                       MetadataString(metadata, kChecksumKey));
  if (algorithm != kChecksumAlgorithm) {
    return Corrupt(absl::StrCat("checksum_algorithm is '",
                                absl::CEscape(algorithm), "', expected '",
                                kChecksumAlgorithm, "'"));
  }
  CheckpointHeader header;
  MHC_ASSIGN_OR_RETURN(header.created_by,
                       MetadataString(metadata, kCreatedByKey));
  MHC_ASSIGN_OR_RETURN(std::string layers,
                       MetadataString(metadata, kLayersKey));
  MHC_ASSIGN_OR_RETURN(std::string layers_crc,
                       MetadataString(metadata, kLayersCrcKey));
  if (layers_crc != Hex32(Crc32c(0, layers.data(), layers.size()))) {
    return Corrupt("the layers' metadata does not match its checksum");
  }
  if (!google::protobuf::util::JsonStringToMessage(layers, &header.manifest)
           .ok()) {
    return Corrupt("the layers' metadata is not a CheckpointManifest");
  }
  MHC_ASSIGN_OR_RETURN(std::string checksums_json,
                       MetadataString(metadata, kChecksumsKey));
  google::protobuf::Struct checksums;
  if (!google::protobuf::util::JsonStringToMessage(checksums_json, &checksums)
           .ok()) {
    return Corrupt("checksums is not a JSON object");
  }
  for (const auto& [name, value] : root.fields()) {
    if (name == "__metadata__") continue;
    MHC_ASSIGN_OR_RETURN(CheckpointTensor tensor,
                         DecodeTensor(name, value, data_bytes));
    auto crc = checksums.fields().find(name);
    uint32_t parsed = 0;
    if (crc == checksums.fields().end() ||
        crc->second.string_value().size() != 8 ||
        !absl::SimpleHexAtoi(crc->second.string_value(), &parsed)) {
      return Corrupt(absl::StrCat("no valid checksum for tensor '", name, "'"));
    }
    tensor.crc32c = parsed;
    header.tensors.emplace(name, std::move(tensor));
  }
  if (static_cast<size_t>(checksums.fields().size()) != header.tensors.size()) {
    return Corrupt("checksums name tensors the header does not hold");
  }
  return header;
}

}  // namespace mhc::server
