// The pieces of a SetParametersStream put back together and checked as they
// arrive: each names a parameter of the layer, its exact shape and
// DTYPE_F32, and continues its tensor where the last piece ended, within the
// tensor's bytes; no tensor comes twice or is left incomplete. Buffers are
// sized by the layer, never by what a piece claims, so a stream holds at
// most the layer's own parameter bytes.
#ifndef MHC_SERVER_PARAMETER_STREAM_H_
#define MHC_SERVER_PARAMETER_STREAM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "mhc/v1/layer.pb.h"
#include "server/layer_store.h"

namespace mhc::server {

class ParameterStreamAssembler {
 public:
  // `layer` outlives the assembler.
  explicit ParameterStreamAssembler(const Layer& layer) : layer_(layer) {}

  // INVALID_ARGUMENT naming the piece (by its place in the stream) and
  // what was expected.
  absl::Status Add(const v1::ParameterChunk& chunk);
  // After the last piece: INVALID_ARGUMENT when the last tensor is
  // incomplete.
  absl::Status Finish() const;

  // The whole tensors received, for LayerStore::WriteChecked.
  std::vector<ParameterUpdate> Updates() const;

 private:
  struct Tensor {
    const Layer::Param* param;
    std::string bytes;
    uint64_t expected_bytes;
  };
  // `then`: what the stream did next ("moved on", "ended").
  static absl::Status CheckComplete(const Tensor& tensor,
                                    absl::string_view then);

  const Layer& layer_;
  std::vector<Tensor> tensors_;  // in stream order; the last is open
  int64_t pieces_ = 0;
};

}  // namespace mhc::server

#endif  // MHC_SERVER_PARAMETER_STREAM_H_
