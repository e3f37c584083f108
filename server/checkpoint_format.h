// The checkpoint file: safetensors (an 8-byte little-endian header size, a
// JSON header, then the tensors' raw little-endian bytes) with mhcd's
// metadata: format name and version, the layers' manifest and a CRC-32C of
// every tensor. docs/checkpoints.md is the reference; this file encodes and
// validates the header, nothing else.
#ifndef MHC_SERVER_CHECKPOINT_FORMAT_H_
#define MHC_SERVER_CHECKPOINT_FORMAT_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "mhc/v1/checkpoint.pb.h"

namespace mhc::server {

inline constexpr char kCheckpointFormat[] = "mhcd.checkpoint";
inline constexpr int kCheckpointFormatVersion = 1;
inline constexpr char kCheckpointExtension[] = ".safetensors";
// Data starts at a multiple of this (the header is padded with spaces), so
// a reader that maps the file gets aligned tensors.
inline constexpr uint64_t kCheckpointDataAlignment = 64;
// Larger headers are refused before they are read (safetensors' own limit).
inline constexpr uint64_t kMaxCheckpointHeaderBytes = uint64_t{100} << 20;

// "<layer>/param/<name>", "<layer>/grad/<name>",
// "<layer>/optim/<slot>/<name>": `section` is "param", "grad" or
// "optim/<slot>".
std::string CheckpointTensorName(absl::string_view layer,
                                 absl::string_view section,
                                 absl::string_view parameter);
std::string OptimizerSection(absl::string_view slot);

// One fp32 tensor of the file; offsets count from the start of the data.
struct CheckpointTensor {
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
  uint32_t crc32c = 0;
};

struct CheckpointHeader {
  v1::CheckpointManifest manifest;
  std::map<std::string, CheckpointTensor> tensors;
  std::string created_by;  // "mhcd 0.1.0"
};

// The JSON header, padded with spaces to at least `min_bytes` and so that
// the data after it (8 + size) starts aligned.
absl::StatusOr<std::string> EncodeCheckpointHeader(
    const CheckpointHeader& header, uint64_t min_bytes = 0);

// Parses and checks a header: format name and version, the manifest and
// its checksum, every tensor's dtype, shape, bounds within the
// `data_bytes` that follow the header, and checksum entry. Errors say what
// is wrong with the file (truncated, corrupt, other version).
absl::StatusOr<CheckpointHeader> DecodeCheckpointHeader(absl::string_view json,
                                                        uint64_t data_bytes);

}  // namespace mhc::server

#endif  // MHC_SERVER_CHECKPOINT_FORMAT_H_
