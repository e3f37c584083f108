// Host tensors and their TensorRef form. Activation values are rounded once,
// to nearest even, when stored as bf16/fp16 (mhc/dtype.h), so a client and
// the daemon see exactly the same input values. Bytes are little-endian, as
// the API requires; this code assumes a little-endian host.
#ifndef MHC_CLIENT_TENSOR_H_
#define MHC_CLIENT_TENSOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "mhc/types.h"
#include "mhc/v1/tensor.pb.h"

namespace mhc::client {

// "f32" / "fp32" / "float32", "f16" / "fp16", "bf16".
absl::StatusOr<DType> ParseDType(absl::string_view name);

struct HostTensor {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::string bytes;  // product(shape) x DTypeSize(dtype)

  int64_t elements() const;
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  float* f32() { return reinterpret_cast<float*>(bytes.data()); }
  const float* f32() const {
    return reinterpret_cast<const float*>(bytes.data());
  }
  float Get(int64_t index) const;
  void Set(int64_t index, float value);  // rounds once to dtype
  std::vector<float> ToFloats() const;
};

HostTensor Zeros(DType dtype, std::vector<int64_t> shape);
// Rounds each value once to `dtype`; values.size() must match shape.
HostTensor FromFloats(DType dtype, std::vector<int64_t> shape,
                      absl::Span<const float> values);
// Uniform in [lo, hi) from a seeded generator, rounded to dtype.
HostTensor RandomTensor(DType dtype, std::vector<int64_t> shape, uint64_t seed,
                        float lo = -1.0f, float hi = 1.0f);

// Inline TensorRef holding a copy of the tensor's bytes.
v1::TensorRef ToTensorRef(const HostTensor& tensor);
// Moves the bytes into the TensorRef (no copy of large payloads).
v1::TensorRef ToTensorRef(HostTensor&& tensor);
// Reads an inline TensorRef back; checks dtype, dims and byte length.
absl::StatusOr<HostTensor> FromTensorRef(const v1::TensorRef& ref);

// "[2, 4, 64] bf16"
std::string DescribeTensor(const v1::TensorRef& ref);

}  // namespace mhc::client

#endif  // MHC_CLIENT_TENSOR_H_
