#include "fuzz/checkpoint_checksums.h"

#include <cstdint>

#include "absl/strings/str_format.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "server/crc32c.h"

namespace mhc::fuzz {
namespace {

std::string Hex32(uint32_t value) { return absl::StrFormat("%08x", value); }

// [begin, end) of a tensor entry's data_offsets, when both are in bounds.
bool DataRange(const google::protobuf::Value& entry, uint64_t data_bytes,
               uint64_t* begin, uint64_t* end) {
  if (entry.kind_case() != google::protobuf::Value::kStructValue) return false;
  auto offsets = entry.struct_value().fields().find("data_offsets");
  if (offsets == entry.struct_value().fields().end() ||
      offsets->second.list_value().values_size() != 2) {
    return false;
  }
  const double first = offsets->second.list_value().values(0).number_value();
  const double last = offsets->second.list_value().values(1).number_value();
  if (!(first >= 0 && first <= last &&
        last <= static_cast<double>(data_bytes))) {
    return false;
  }
  *begin = static_cast<uint64_t>(first);
  *end = static_cast<uint64_t>(last);
  return true;
}

}  // namespace

bool FixCheckpointChecksums(std::string* file) {
  if (file->size() < 8) return false;
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) {
    header_bytes = header_bytes << 8 | static_cast<uint8_t>((*file)[i]);
  }
  if (header_bytes > file->size() - 8) return false;
  google::protobuf::Struct root;
  if (!google::protobuf::util::JsonStringToMessage(
           file->substr(8, header_bytes), &root)
           .ok()) {
    return false;
  }
  auto meta = root.mutable_fields()->find("__metadata__");
  if (meta == root.mutable_fields()->end() ||
      meta->second.kind_case() != google::protobuf::Value::kStructValue) {
    return false;
  }
  const std::string data = file->substr(8 + header_bytes);
  auto& metadata = *meta->second.mutable_struct_value()->mutable_fields();
  auto layers = metadata.find("layers");
  if (layers != metadata.end()) {
    const std::string& manifest = layers->second.string_value();
    metadata["layers_crc32c"].set_string_value(
        Hex32(server::Crc32c(0, manifest.data(), manifest.size())));
  }
  google::protobuf::Struct checksums;
  for (const auto& [name, entry] : root.fields()) {
    uint64_t begin = 0, end = 0;
    if (name == "__metadata__" ||
        !DataRange(entry, data.size(), &begin, &end)) {
      continue;
    }
    (*checksums.mutable_fields())[name].set_string_value(
        Hex32(server::Crc32c(0, data.data() + begin, end - begin)));
  }
  std::string checksums_json, header;
  if (!google::protobuf::util::MessageToJsonString(checksums, &checksums_json)
           .ok()) {
    return false;
  }
  metadata["checksums"].set_string_value(checksums_json);
  if (!google::protobuf::util::MessageToJsonString(root, &header).ok()) {
    return false;
  }
  std::string fixed;
  for (int i = 0; i < 8; ++i) {
    fixed.push_back(static_cast<char>(uint64_t{header.size()} >> (8 * i)));
  }
  fixed += header;
  fixed += data;
  *file = std::move(fixed);
  return true;
}

}  // namespace mhc::fuzz
