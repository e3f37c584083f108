// The table of operators the API exposes: for each, the request and response
// messages, which TensorRef fields are inputs and outputs and what they must
// look like, which layers it applies to, and how its Backend call is made.
// Both the single-op RPCs and Execute run ops from this one table, so an
// op's validation and launch exist exactly once. Output names are the field
// names of the response message.
#ifndef MHC_SERVER_OP_DEFS_H_
#define MHC_SERVER_OP_DEFS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "google/protobuf/descriptor.h"
#include "mhc/backend.h"
#include "mhc/types.h"

namespace mhc::server {

// Trailing dimensions of a tensor after the leading token dimensions.
enum class Dims : uint8_t {
  kX,        // [n, C] (STREAM_MAJOR) or [C, n] (STREAM_MINOR)
  kHidden,   // [C]
  kLogits,   // [N]
  kStreams,  // [n]
  kMatrix,   // [n, n]
  kToken,    // [] (one value per token)
};

// When a tensor takes part, given the layer and the request's flags.
enum class Need : uint8_t {
  kRequired,
  kOptional,          // input the client may leave out
  kIfDynamic,         // dynamic layers only (absent for static ones)
  kIfMhc,             // MHC layers only (absent for HEAD)
  kUnlessSkipDx,      // output left out when the request sets skip_dx
  kKeptProjection,    // input: the projection Pre kept (dynamic layers;
                      // all of an op's such inputs or none)
  kIfKeepProjection,  // output of a dynamic layer asked for keep_projection
};

// The request's flags that decide which tensors take part.
struct RequestFlags {
  bool skip_dx = false;
  bool keep_projection = false;
};

// Which layers an op is valid for (FAILED_PRECONDITION otherwise).
enum class LayerRule : uint8_t { kAny, kMhc, kDynamic, kHead };

struct SlotDef {
  std::string name;
  Dims dims;
  bool activation;  // dtype of the op's activations; otherwise f32
  Need need;
  const google::protobuf::FieldDescriptor* field = nullptr;
};

// What a launch function receives: pointers in the backend's memory, by
// slot index (null for tensors that do not take part).
struct BoundOp {
  const LayerSpec* spec = nullptr;
  int64_t tokens = 0;
  DType act_dtype = DType::kF32;
  std::vector<const void*> in;
  std::vector<void*> out;
  LayerWeights weights;
  LayerGrads grads;  // all null when parameter gradients are skipped
};

using LaunchFn = absl::Status (*)(Backend&, const BoundOp&, Workspace);

struct OpDef {
  std::string op_field;  // field of mhc.v1.Op's oneof, "pre_backward"
  std::string rpc;       // "PreBackward"
  OpKind kind;
  LayerRule rule;
  std::vector<SlotDef> inputs;
  std::vector<SlotDef> outputs;
  // Backward ops that add into the layer's gradient accumulators.
  bool accumulates = false;
  // Ops whose tokens count once per layer backward in gradient_tokens: the
  // ones that accumulate beta (Scale, Pre, Head backward), so a layer's
  // backward counts M once whether it runs fused or op by op.
  bool counts_tokens = false;
  LaunchFn launch = nullptr;

  const google::protobuf::Descriptor* request = nullptr;
  const google::protobuf::Descriptor* response = nullptr;
  const google::protobuf::FieldDescriptor* layer_field = nullptr;
  const google::protobuf::FieldDescriptor* regions_field = nullptr;
  const google::protobuf::FieldDescriptor* skip_grads_field = nullptr;
  const google::protobuf::FieldDescriptor* skip_dx_field = nullptr;
  const google::protobuf::FieldDescriptor* keep_projection_field = nullptr;
  const google::protobuf::FieldDescriptor* lead_shape_field = nullptr;
};

// The definition of `kind` (one per OpKind).
const OpDef& GetOpDef(OpKind kind);
// The definition behind mhc.v1.Op's oneof field with this number, or null.
const OpDef* FindOpDefByOpField(int field_number);

std::vector<int64_t> TrailingDims(Dims dims, const LayerSpec& spec);

}  // namespace mhc::server

#endif  // MHC_SERVER_OP_DEFS_H_
