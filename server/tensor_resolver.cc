#include "server/tensor_resolver.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "convert/spec_convert.h"
#include "mhc/status.h"

namespace mhc::server {

std::string ShapeString(const std::vector<int64_t>& dims) {
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}

absl::Status ByteBudget::Charge(uint64_t bytes, absl::string_view field) {
  if (bytes > limits_.max_tensor_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        field, ": ", bytes, " bytes exceed the per-tensor limit of ",
        limits_.max_tensor_bytes, " bytes (--max_tensor_bytes)"));
  }
  // total_ never exceeds the limit, so the subtraction cannot wrap.
  if (bytes > limits_.max_request_bytes - total_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        field, ": the request's tensors exceed the per-request limit of ",
        limits_.max_request_bytes, " bytes (--max_request_bytes)"));
  }
  total_ += bytes;
  return absl::OkStatus();
}

absl::StatusOr<TensorInfo> DeclaredInfo(const v1::TensorRef& ref,
                                        absl::string_view field) {
  TensorInfo info;
  MHC_ASSIGN_OR_RETURN(
      info.dtype, DTypeFromProto(ref.dtype(), absl::StrCat(field, ".dtype")));
  info.shape.assign(ref.shape().begin(), ref.shape().end());
  for (size_t i = 0; i < info.shape.size(); ++i) {
    if (info.shape[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shape[", i, "]: expected >= 0, got ",
                       info.shape[i], " in ", ShapeString(info.shape)));
    }
  }
  const int64_t size = static_cast<int64_t>(DTypeSize(info.dtype));
  absl::StatusOr<int64_t> elements =
      CheckedElementCount(info.shape, INT64_MAX / size);
  if (!elements.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".shape: ", ShapeString(info.shape),
                     " has too many elements (the byte size overflows)"));
  }
  info.elements = *elements;
  info.bytes = static_cast<uint64_t>(*elements) * static_cast<uint64_t>(size);
  return info;
}

absl::StatusOr<absl::string_view> InlineBytes(const v1::TensorRef& ref,
                                              const TensorInfo& info,
                                              absl::string_view field) {
  switch (ref.data_case()) {
    case v1::TensorRef::kInlineData:
      if (ref.inline_data().size() != info.bytes) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".inline_data: expected ", info.bytes, " bytes (",
            info.elements, " elements of ", DTypeLabel(info.dtype), " for ",
            ShapeString(info.shape), "), got ", ref.inline_data().size()));
      }
      return absl::string_view(ref.inline_data());
    case v1::TensorRef::kShm:
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".shm: not accepted here (parameters are always inline)"));
    case v1::TensorRef::kRef:
      return absl::InvalidArgumentError(
          absl::StrCat(field,
                       ".ref: only valid inside Execute (names an earlier op's "
                       "output)"));
    case v1::TensorRef::DATA_NOT_SET:
      break;
  }
  if (info.bytes == 0) return absl::string_view();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": no data; expected inline_data of ", info.bytes, " bytes"));
}

absl::Status OpShapes::SetLead(const std::vector<int64_t>& lead,
                               absl::string_view field) {
  if (lead.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected at least one leading token dimension"));
  }
  for (size_t i = 0; i < lead.size(); ++i) {
    if (lead[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "]: expected >= 0, got ", lead[i]));
    }
  }
  absl::StatusOr<int64_t> tokens = CheckedElementCount(lead);
  if (!tokens.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": token count of ", ShapeString(lead), " overflows"));
  }
  lead_ = lead;
  lead_field_ = std::string(field);
  tokens_ = *tokens;
  return absl::OkStatus();
}

absl::Status OpShapes::Match(const TensorInfo& info, const SlotShape& expected,
                             absl::string_view field) {
  // dtype first: its message is more useful than a byte-size mismatch.
  if (expected.activation) {
    if (!act_dtype_.has_value()) {
      act_dtype_ = info.dtype;
      act_field_ = std::string(field);
    } else if (*act_dtype_ != info.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".dtype: expected ", DTypeLabel(*act_dtype_), " like ",
          act_field_, " (activations share one dtype), got ",
          DTypeLabel(info.dtype)));
    }
  } else if (info.dtype != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(
        field,
        ".dtype: expected DTYPE_F32 (mixing values are always f32), "
        "got ",
        DTypeLabel(info.dtype)));
  }
  const size_t rank = expected.trailing.size();
  bool trailing_ok = info.shape.size() >= rank + 1;
  for (size_t i = 0; trailing_ok && i < rank; ++i) {
    trailing_ok =
        info.shape[info.shape.size() - rank + i] == expected.trailing[i];
  }
  if (!trailing_ok) {
    std::string want =
        rank == 0 ? "[lead...]"
                  : absl::StrCat("[..., ",
                                 absl::StrJoin(expected.trailing, ", "), "]");
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".shape: expected ", want, " for ", layer_desc_,
                     " (at least one leading token dimension), got ",
                     ShapeString(info.shape)));
  }
  std::vector<int64_t> lead(info.shape.begin(), info.shape.end() - rank);
  if (!lead_.has_value()) return SetLead(lead, absl::StrCat(field, ".shape"));
  if (lead != *lead_) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".shape: leading token dimensions ", ShapeString(lead),
        " differ from ", ShapeString(*lead_), " of ", lead_field_));
  }
  return absl::OkStatus();
}

absl::StatusOr<absl::string_view> ResolveParameter(
    const v1::TensorRef& ref, absl::string_view field,
    const std::vector<int64_t>& shape, ByteBudget* budget) {
  MHC_ASSIGN_OR_RETURN(TensorInfo info, DeclaredInfo(ref, field));
  if (info.dtype != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat(field,
                     ".dtype: expected DTYPE_F32 (parameters are "
                     "always f32), got ",
                     DTypeLabel(info.dtype)));
  }
  if (info.shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape: expected ",
                                                   ShapeString(shape), ", got ",
                                                   ShapeString(info.shape)));
  }
  MHC_RETURN_IF_ERROR(budget->Charge(info.bytes, field));
  return InlineBytes(ref, info, field);
}

}  // namespace mhc::server
