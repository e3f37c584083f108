#include "tensor_chunks.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace mhc::client {
namespace {

// fp32 bytes of a tensor of `shape`; -1 when a dimension is negative.
int64_t TensorBytes(const google::protobuf::RepeatedField<int64_t>& shape) {
  int64_t elements = 1;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    elements *= d;
  }
  return elements * static_cast<int64_t>(sizeof(float));
}

absl::Status CheckComplete(const std::string& name,
                           const v1::TensorRef& tensor) {
  const int64_t expected = TensorBytes(tensor.shape());
  if (static_cast<int64_t>(tensor.inline_data().size()) != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", name, "': the stream ended after ",
        tensor.inline_data().size(), " of its ", expected, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status TensorChunkAssembler::Add(const v1::TensorChunk& chunk) {
  auto& tensors = *parameters_.mutable_tensors();
  if (chunk.name() != current_) {
    if (!current_.empty()) {
      if (absl::Status s = CheckComplete(current_, tensors.at(current_));
          !s.ok()) {
        return s;
      }
    }
    if (tensors.contains(chunk.name())) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", chunk.name(), "' came twice in the stream"));
    }
    if (TensorBytes(chunk.shape()) < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", chunk.name(), "': negative dimension"));
    }
    v1::TensorRef& tensor = tensors[chunk.name()];
    tensor.set_dtype(v1::DTYPE_F32);
    *tensor.mutable_shape() = chunk.shape();
    tensor.mutable_inline_data()->reserve(
        static_cast<size_t>(TensorBytes(chunk.shape())));
    current_ = chunk.name();
  }
  v1::TensorRef& tensor = tensors.at(current_);
  std::string& bytes = *tensor.mutable_inline_data();
  if (chunk.offset() != bytes.size() ||
      static_cast<int64_t>(bytes.size() + chunk.data().size()) >
          TensorBytes(tensor.shape())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", current_, "': piece at byte ", chunk.offset(), " of ",
        chunk.data().size(), " bytes does not continue the ", bytes.size(),
        " bytes received"));
  }
  bytes.append(chunk.data());
  gradient_tokens_ = chunk.gradient_tokens();
  return absl::OkStatus();
}

absl::Status TensorChunkAssembler::Finish() {
  if (current_.empty()) return absl::OkStatus();
  return CheckComplete(current_, parameters_.tensors().at(current_));
}

absl::Status SendParameterChunks(
    const v1::SetParametersRequest& request, uint64_t max_chunk_bytes,
    absl::FunctionRef<bool(const v1::ParameterChunk&)> send) {
  const uint64_t chunk_bytes = std::max<uint64_t>(max_chunk_bytes, 1);
  std::vector<std::string> names;
  for (const auto& [name, tensor] : request.parameters().tensors()) {
    names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  // Every tensor is checked before the first piece goes out.
  for (const std::string& name : names) {
    const v1::TensorRef& tensor = request.parameters().tensors().at(name);
    const bool inline_or_empty =
        tensor.data_case() == v1::TensorRef::kInlineData ||
        tensor.data_case() == v1::TensorRef::DATA_NOT_SET;
    const int64_t expected = TensorBytes(tensor.shape());
    if (!inline_or_empty ||
        static_cast<int64_t>(tensor.inline_data().size()) != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", name, "': expected inline fp32 data of its shape, ",
          expected, " bytes; got ", tensor.inline_data().size()));
    }
  }
  bool first = true;
  for (const std::string& name : names) {
    const v1::TensorRef& tensor = request.parameters().tensors().at(name);
    const std::string& bytes = tensor.inline_data();
    uint64_t offset = 0;
    do {
      const uint64_t size =
          std::min<uint64_t>(chunk_bytes, bytes.size() - offset);
      v1::ParameterChunk chunk;
      if (first) chunk.set_layer(request.layer());
      first = false;
      chunk.set_name(name);
      *chunk.mutable_shape() = tensor.shape();
      chunk.set_dtype(tensor.dtype());
      chunk.set_offset(offset);
      chunk.set_data(bytes.data() + offset, size);
      if (!send(chunk)) return absl::OkStatus();
      offset += size;
    } while (offset < bytes.size());
  }
  return absl::OkStatus();
}

}  // namespace mhc::client
