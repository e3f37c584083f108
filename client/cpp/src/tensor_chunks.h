// Reassembles the TensorChunks of StreamParameters/StreamGradients into
// the Parameters message GetParameters/GetGradients would have answered.
#ifndef MHC_CLIENT_SRC_TENSOR_CHUNKS_H_
#define MHC_CLIENT_SRC_TENSOR_CHUNKS_H_

#include <cstdint>
#include <string>

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

}  // namespace mhc::client

#endif  // MHC_CLIENT_SRC_TENSOR_CHUNKS_H_
