// Conversions between the API's layer messages and the kernels' LayerSpec,
// and a host copy of a layer's parameters that the float64 reference backend
// (mhc::MakeReferenceBackend) can run on, so clients can check the daemon.
#ifndef MHC_CLIENT_SPEC_H_
#define MHC_CLIENT_SPEC_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "mhc/client/tensor.h"
#include "mhc/ops/weights.h"
#include "mhc/types.h"
#include "mhc/v1/layer.pb.h"

namespace mhc::client {

// A fully resolved spec (as GetLayer returns it); UNSPECIFIED enums and unset
// optional fields are errors, since a resolved spec has every field set.
// (SpecToProto, the other direction, is in convert/spec_convert.h.)
absl::StatusOr<LayerSpec> SpecFromProto(const v1::LayerSpec& proto);

// Lower-case names used by mhcctl flags and output ("stream_major", ...).
absl::StatusOr<v1::Layout> ParseLayout(absl::string_view name);
absl::StatusOr<v1::Orientation> ParseOrientation(absl::string_view name);
absl::StatusOr<v1::SinkhornMode> ParseSinkhornMode(absl::string_view name);
absl::StatusOr<v1::EpsPlacement> ParseEpsPlacement(absl::string_view name);
absl::StatusOr<v1::MatmulPrecision> ParseMatmulPrecision(
    absl::string_view name);
absl::StatusOr<v1::LayerKind> ParseLayerKind(absl::string_view name);

// Shape of one token's stream state in the layer's layout: {n, C} or {C, n}.
std::vector<int64_t> StreamDims(const LayerSpec& spec);

// A layer's parameters (and gradient accumulators) in host fp32.
struct HostLayer {
  LayerSpec spec;
  std::map<std::string, std::vector<float>> parameters;
  std::map<std::string, std::vector<float>> gradients;  // zero-initialised

  // Pointers into `parameters` / `gradients`; valid while this object lives
  // and its maps are not resized.
  LayerWeights Weights() const;
  LayerGrads Grads();
};

// Builds a HostLayer from GetLayer's spec and GetParameters' tensors; checks
// that every parameter the spec needs is present with its exact shape.
absl::StatusOr<HostLayer> MakeHostLayer(const v1::LayerSpec& spec,
                                        const v1::Parameters& parameters);
// Names and shapes of the parameters a spec has.
std::map<std::string, std::vector<int64_t>> ParameterShapes(
    const LayerSpec& spec);

}  // namespace mhc::client

#endif  // MHC_CLIENT_SPEC_H_
