#include "mhc/client/tensor.h"

#include <random>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "convert/spec_convert.h"
#include "mhc/dtype.h"

namespace mhc::client {

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  std::string lower = absl::AsciiStrToLower(name);
  if (lower == "f32" || lower == "fp32" || lower == "float32") {
    return DType::kF32;
  }
  if (lower == "f16" || lower == "fp16" || lower == "float16") {
    return DType::kF16;
  }
  if (lower == "bf16" || lower == "bfloat16") return DType::kBF16;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype: expected bf16, fp16 or fp32, got '", name, "'"));
}

int64_t HostTensor::elements() const {
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;
  return count;
}

float HostTensor::Get(int64_t index) const {
  return LoadActivation(bytes.data(), dtype, index);
}

void HostTensor::Set(int64_t index, float value) {
  StoreActivation(bytes.data(), dtype, index, value);
}

std::vector<float> HostTensor::ToFloats() const {
  std::vector<float> values(static_cast<size_t>(elements()));
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = Get(static_cast<int64_t>(i));
  }
  return values;
}

HostTensor Zeros(DType dtype, std::vector<int64_t> shape) {
  HostTensor tensor;
  tensor.dtype = dtype;
  tensor.shape = std::move(shape);
  tensor.bytes.assign(static_cast<size_t>(tensor.elements()) * DTypeSize(dtype),
                      '\0');
  return tensor;
}

HostTensor FromFloats(DType dtype, std::vector<int64_t> shape,
                      absl::Span<const float> values) {
  HostTensor tensor = Zeros(dtype, std::move(shape));
  int64_t count = std::min<int64_t>(tensor.elements(), values.size());
  for (int64_t i = 0; i < count; ++i) tensor.Set(i, values[i]);
  return tensor;
}

HostTensor RandomTensor(DType dtype, std::vector<int64_t> shape, uint64_t seed,
                        float lo, float hi) {
  HostTensor tensor = Zeros(dtype, std::move(shape));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  for (int64_t i = 0; i < tensor.elements(); ++i) tensor.Set(i, dist(rng));
  return tensor;
}

v1::TensorRef ToTensorRef(const HostTensor& tensor) {
  HostTensor copy = tensor;
  return ToTensorRef(std::move(copy));
}

v1::TensorRef ToTensorRef(HostTensor&& tensor) {
  v1::TensorRef ref;
  ref.set_dtype(DTypeToProto(tensor.dtype));
  for (int64_t dim : tensor.shape) ref.add_shape(dim);
  ref.set_inline_data(std::move(tensor.bytes));
  return ref;
}

absl::StatusOr<HostTensor> FromTensorRef(const v1::TensorRef& ref) {
  if (ref.data_case() != v1::TensorRef::kInlineData) {
    return absl::InvalidArgumentError(
        "tensor: only inline tensors can be read on the client");
  }
  absl::StatusOr<DType> dtype = DTypeFromProto(ref.dtype(), "dtype");
  if (!dtype.ok()) return dtype.status();
  std::vector<int64_t> shape(ref.shape().begin(), ref.shape().end());
  absl::StatusOr<int64_t> count = CheckedElementCount(shape);
  if (!count.ok()) return count.status();
  size_t expected = static_cast<size_t>(*count) * DTypeSize(*dtype);
  if (ref.inline_data().size() != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor: ", ref.inline_data().size(), " bytes for shape [",
                     absl::StrJoin(shape, ", "), "] ", DTypeName(*dtype),
                     ", expected ", expected));
  }
  HostTensor tensor;
  tensor.dtype = *dtype;
  tensor.shape = std::move(shape);
  tensor.bytes = ref.inline_data();
  return tensor;
}

std::string DescribeTensor(const v1::TensorRef& ref) {
  absl::StatusOr<DType> dtype = DTypeFromProto(ref.dtype(), "dtype");
  return absl::StrCat("[", absl::StrJoin(ref.shape(), ", "), "] ",
                      dtype.ok() ? DTypeName(*dtype) : "?");
}

}  // namespace mhc::client
