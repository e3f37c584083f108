#include "server/parameter_stream.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/tensor_resolver.h"

namespace mhc::server {

absl::Status ParameterStreamAssembler::CheckComplete(const Tensor& tensor,
                                                     absl::string_view then) {
  if (tensor.bytes.size() == tensor.expected_bytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "tensor '", tensor.param->name, "': the stream ", then, " after ",
      tensor.bytes.size(), " of its ", tensor.expected_bytes, " bytes"));
}

absl::Status ParameterStreamAssembler::Add(const v1::ParameterChunk& chunk) {
  const std::string where = absl::StrCat("piece ", pieces_++, ": ");
  auto invalid = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(where, parts...));
  };
  if (!chunk.layer().empty() && chunk.layer() != layer_.name()) {
    return invalid("layer: the stream is for layer '", layer_.name(),
                   "', got '", absl::CEscape(chunk.layer()), "'");
  }
  if (tensors_.empty() || chunk.name() != tensors_.back().param->name) {
    const Layer::Param* param = layer_.FindParam(chunk.name());
    if (param == nullptr) {
      std::vector<std::string> known;
      for (const Layer::Param& p : layer_.params()) known.push_back(p.name);
      return invalid("name: ", layer_.Describe(), " has no parameter '",
                     absl::CEscape(chunk.name()), "'; expected any of ",
                     absl::StrJoin(known, ", "));
    }
    for (const Tensor& seen : tensors_) {
      if (seen.param == param) {
        return invalid("tensor '", param->name,
                       "' came again after other tensors");
      }
    }
    if (!tensors_.empty()) {
      if (absl::Status s = CheckComplete(tensors_.back(), "moved on");
          !s.ok()) {
        return invalid(s.message());
      }
    }
    const uint64_t bytes =
        static_cast<uint64_t>(param->elements) * sizeof(float);
    tensors_.push_back(Tensor{param, std::string(), bytes});
    // Sized by the layer: a piece cannot make the daemon hold more.
    tensors_.back().bytes.reserve(bytes);
  }
  Tensor& tensor = tensors_.back();
  const Layer::Param& param = *tensor.param;
  if (chunk.dtype() != v1::DTYPE_F32) {
    return invalid("tensor '", param.name,
                   "'.dtype: expected DTYPE_F32 (parameters are always f32), "
                   "got ",
                   v1::DType_IsValid(chunk.dtype())
                       ? v1::DType_Name(chunk.dtype())
                       : absl::StrCat(chunk.dtype()));
  }
  const std::vector<int64_t> shape(chunk.shape().begin(), chunk.shape().end());
  if (shape != param.shape) {
    return invalid("tensor '", param.name, "'.shape: expected ",
                   ShapeString(param.shape), ", got ", ShapeString(shape));
  }
  if (chunk.offset() != tensor.bytes.size()) {
    return invalid("tensor '", param.name, "': piece at byte ", chunk.offset(),
                   " does not continue the ", tensor.bytes.size(),
                   " bytes received (no gaps or overlaps)");
  }
  if (chunk.data().size() > tensor.expected_bytes - tensor.bytes.size()) {
    return invalid("tensor '", param.name, "': ", chunk.data().size(),
                   " bytes at byte ", chunk.offset(), " run past its ",
                   tensor.expected_bytes, " bytes");
  }
  tensor.bytes.append(chunk.data());
  return absl::OkStatus();
}

absl::Status ParameterStreamAssembler::Finish() const {
  if (tensors_.empty()) return absl::OkStatus();
  return CheckComplete(tensors_.back(), "ended");
}

std::vector<ParameterUpdate> ParameterStreamAssembler::Updates() const {
  std::vector<ParameterUpdate> updates;
  for (const Tensor& tensor : tensors_) {
    updates.push_back(ParameterUpdate{tensor.param, tensor.bytes});
  }
  return updates;
}

}  // namespace mhc::server
