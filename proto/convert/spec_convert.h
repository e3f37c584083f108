// Conversions between the API's messages and the kernels' vocabulary, shared
// by the daemon and the clients so both read the API the same way.
#ifndef MHC_PROTO_CONVERT_SPEC_CONVERT_H_
#define MHC_PROTO_CONVERT_SPEC_CONVERT_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "mhc/types.h"
#include "mhc/v1/layer.pb.h"
#include "mhc/v1/tensor.pb.h"

namespace mhc {

// The preset (empty: deepseek_v4) with the request's overrides applied
// (see mhc.v1.LayerSpec), validated. Errors name the field.
absl::StatusOr<LayerSpec> ResolveSpec(absl::string_view preset,
                                      const v1::LayerSpec& overrides);

// Every field set.
void SpecToProto(const LayerSpec& spec, v1::LayerSpec* out);
v1::LayerSpec SpecToProto(const LayerSpec& spec);

// Activation dtype of the API; INVALID_ARGUMENT naming `field` for
// UNSPECIFIED or an unknown value.
absl::StatusOr<DType> DTypeFromProto(int value, absl::string_view field);
v1::DType DTypeToProto(DType dtype);

absl::StatusOr<Layout> LayoutFromProto(int value, absl::string_view field);
v1::Layout LayoutToProto(Layout layout);

// "STREAM_MAJOR", "F32", ... for messages.
std::string LayoutLabel(Layout layout);
std::string DTypeLabel(DType dtype);

}  // namespace mhc

#endif  // MHC_PROTO_CONVERT_SPEC_CONVERT_H_
