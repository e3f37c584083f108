// Validation of TensorRefs before anything runs: dtype, shape against the
// layer's spec, leading token dimensions shared by an op's tensors,
// overflow-checked element counts, byte lengths, and the per-tensor and
// per-request size limits. Errors name the field and what was expected.
#ifndef MHC_SERVER_TENSOR_RESOLVER_H_
#define MHC_SERVER_TENSOR_RESOLVER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "mhc/types.h"
#include "mhc/v1/tensor.pb.h"

namespace mhc::server {

struct RequestLimits {
  uint64_t max_tensor_bytes = uint64_t{1} << 30;
  uint64_t max_request_bytes = uint64_t{1} << 30;
  int max_batch_ops = 256;
  // Daemon-wide: layer parameters and gradients together (0: no limit).
  uint64_t max_parameter_bytes = 0;
};

// dtype, shape and byte size of a tensor whose declaration was checked.
struct TensorInfo {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  int64_t elements = 0;
  uint64_t bytes = 0;
};

// "[2, 3, 4096]".
std::string ShapeString(const std::vector<int64_t>& dims);

// Counts the bytes of one request (or batch) against the limits; over them
// is RESOURCE_EXHAUSTED.
class ByteBudget {
 public:
  explicit ByteBudget(const RequestLimits& limits) : limits_(limits) {}
  absl::Status Charge(uint64_t bytes, absl::string_view field);
  uint64_t total() const { return total_; }

 private:
  const RequestLimits& limits_;
  uint64_t total_ = 0;
};

// Checks the declared dtype and shape of `ref` (enum value, dims >= 0,
// element count and byte size without overflow). Says nothing about where
// the bytes are.
absl::StatusOr<TensorInfo> DeclaredInfo(const v1::TensorRef& ref,
                                        absl::string_view field);

// Bytes of a tensor carried in the request: inline_data of exactly
// info.bytes (absent is fine for an empty tensor). shm is not valid here
// (the op runner resolves compute tensors' regions itself); ref is not valid
// here (only inside Execute, where the
// caller resolves it before).
absl::StatusOr<absl::string_view> InlineBytes(const v1::TensorRef& ref,
                                              const TensorInfo& info,
                                              absl::string_view field);

// What one tensor of an op must look like after the leading token
// dimensions.
struct SlotShape {
  std::vector<int64_t> trailing;
  bool activation = false;  // dtype: the op's activation dtype; else f32
};

// Agreement across the tensors of one op: the first tensor fixes the
// leading dimensions and the first activation the activation dtype.
class OpShapes {
 public:
  // `layer_desc` goes into messages: "layer 'l1' (STREAM_MAJOR)".
  explicit OpShapes(std::string layer_desc)
      : layer_desc_(std::move(layer_desc)) {}

  absl::Status Match(const TensorInfo& info, const SlotShape& expected,
                     absl::string_view field);
  // Leading dims given without a tensor (static Scale's lead_shape).
  absl::Status SetLead(const std::vector<int64_t>& lead,
                       absl::string_view field);

  bool has_lead() const { return lead_.has_value(); }
  const std::vector<int64_t>& lead() const { return *lead_; }
  int64_t tokens() const { return tokens_; }
  std::optional<DType> act_dtype() const { return act_dtype_; }

 private:
  std::string layer_desc_;
  std::optional<std::vector<int64_t>> lead_;
  std::string lead_field_;
  int64_t tokens_ = 0;
  std::optional<DType> act_dtype_;
  std::string act_field_;
};

// A parameter tensor (CreateLayer / SetParameters): f32 with exactly
// `shape`, inline. Returns its bytes.
absl::StatusOr<absl::string_view> ResolveParameter(
    const v1::TensorRef& ref, absl::string_view field,
    const std::vector<int64_t>& shape, ByteBudget* budget);

}  // namespace mhc::server

#endif  // MHC_SERVER_TENSOR_RESOLVER_H_
