// Reassembles the TensorChunks of StreamParameters/StreamGradients into
// the Parameters message GetParameters/GetGradients would have answered, and
// cuts a SetParametersRequest into the ParameterChunks of
// SetParametersStream.
#ifndef MHC_CLIENT_SRC_TENSOR_CHUNKS_H_
#define MHC_CLIENT_SRC_TENSOR_CHUNKS_H_

#include <cstdint>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "mhc/v1/layer.pb.h"
#include "mhc/v1/tensor.pb.h"

namespace mhc::client {

class TensorChunkAssembler {
 public:
  // INVALID_ARGUMENT (naming the tensor) when a piece does not continue
  // its tensor where the last one ended or runs past its shape.
  absl::Status Add(const v1::TensorChunk& chunk);
  // After the last piece: INVALID_ARGUMENT when a tensor is incomplete.
  absl::Status Finish();

  v1::Parameters& parameters() { return parameters_; }
  int64_t gradient_tokens() const { return gradient_tokens_; }

 private:
  v1::Parameters parameters_;
  std::string current_;  // the tensor the last piece belonged to
  int64_t gradient_tokens_ = 0;
};

// Calls `send` with each piece of `request` in stream order: tensors sorted
// by name, pieces of at most `max_chunk_bytes` data bytes, the layer named
// in the first. Stops when `send` returns false (the stream broke).
// INVALID_ARGUMENT when a tensor's bytes are not inline or do not match its
// shape.
absl::Status SendParameterChunks(
    const v1::SetParametersRequest& request, uint64_t max_chunk_bytes,
    absl::FunctionRef<bool(const v1::ParameterChunk&)> send);

}  // namespace mhc::client

#endif  // MHC_CLIENT_SRC_TENSOR_CHUNKS_H_
