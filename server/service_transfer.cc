// StreamParameters, StreamGradients and SetParametersStream: a layer's
// tensors in pieces that each fit a message, for layers too large for
// GetParameters/GetGradients/SetParameters.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "mhc/status.h"
#include "server/parameter_stream.h"
#include "server/service.h"

namespace mhc::server {
namespace {

// Pieces stay well below gRPC's 4 MiB default receive limit, so that any
// client can read them, and leave room in a message for the piece's name
// and shape.
constexpr uint64_t kMaxChunkBytes = uint64_t{1} << 20;
constexpr uint64_t kChunkOverheadBytes = 1024;

}  // namespace

uint64_t MhcService::ChunkBytes(uint64_t client_max) const {
  const uint64_t room = options_.max_message_bytes > kChunkOverheadBytes
                            ? options_.max_message_bytes - kChunkOverheadBytes
                            : 0;
  uint64_t bytes = std::min(kMaxChunkBytes, room);
  if (client_max > 0) bytes = std::min(bytes, client_max);
  // Whole floats, at least one per piece.
  return std::max<uint64_t>(sizeof(float),
                            bytes / sizeof(float) * sizeof(float));
}

grpc::Status MhcService::StreamTensors(
    const grpc::ServerContext& context, absl::string_view rpc,
    const std::string& layer_name,
    const google::protobuf::RepeatedPtrField<std::string>& names,
    uint64_t max_chunk_bytes, bool gradients,
    grpc::ServerWriter<v1::TensorChunk>* writer) {
  return Handle(context, rpc, true, [&]() -> absl::Status {
    MHC_ASSIGN_OR_RETURN(std::shared_ptr<Layer> layer,
                         store_->Find(layer_name, "layer"));
    // One read under one device lock: the pieces form a snapshot.
    v1::Parameters snapshot;
    MHC_ASSIGN_OR_RETURN(int64_t tokens,
                         store_->Read(*layer, names, gradients, &snapshot));
    // Sorted, so that a tensor's place in the stream does not depend on
    // the map's order.
    std::vector<std::string> order;
    for (const auto& [name, tensor] : snapshot.tensors()) order.push_back(name);
    std::sort(order.begin(), order.end());
    const uint64_t chunk_bytes = ChunkBytes(max_chunk_bytes);
    for (const std::string& name : order) {
      const v1::TensorRef& tensor = snapshot.tensors().at(name);
      const std::string& bytes = tensor.inline_data();
      uint64_t offset = 0;
      do {
        const uint64_t size =
            std::min<uint64_t>(chunk_bytes, bytes.size() - offset);
        v1::TensorChunk chunk;
        chunk.set_name(name);
        *chunk.mutable_shape() = tensor.shape();
        chunk.set_offset(offset);
        chunk.set_data(bytes.data() + offset, size);
        chunk.set_gradient_tokens(tokens);
        if (!writer->Write(chunk)) {
          return absl::CancelledError(
              absl::StrCat(rpc, ": the client stopped reading"));
        }
        offset += size;
      } while (offset < bytes.size());
    }
    return absl::OkStatus();
  });
}

grpc::Status MhcService::StreamParameters(
    grpc::ServerContext* context, const v1::GetParametersRequest* request,
    grpc::ServerWriter<v1::TensorChunk>* writer) {
  return StreamTensors(*context, "StreamParameters", request->layer(),
                       request->names(), request->max_chunk_bytes(),
                       /*gradients=*/false, writer);
}

grpc::Status MhcService::StreamGradients(
    grpc::ServerContext* context, const v1::GetGradientsRequest* request,
    grpc::ServerWriter<v1::TensorChunk>* writer) {
  return StreamTensors(*context, "StreamGradients", request->layer(),
                       request->names(), request->max_chunk_bytes(),
                       /*gradients=*/true, writer);
}

grpc::Status MhcService::SetParametersStream(
    grpc::ServerContext* context,
    grpc::ServerReader<v1::ParameterChunk>* reader, v1::LayerInfo* response) {
  return SetParametersFromPieces(
      *context,
      [reader](v1::ParameterChunk* chunk) { return reader->Read(chunk); },
      response);
}

grpc::Status MhcService::SetParametersFromPieces(
    const grpc::ServerContext& context,
    absl::FunctionRef<bool(v1::ParameterChunk*)> next,
    v1::LayerInfo* response) {
  constexpr absl::string_view kRpc = "SetParametersStream";
  return Handle(context, kRpc, true, [&]() -> absl::Status {
    v1::ParameterChunk chunk;
    if (!next(&chunk)) {
      return absl::InvalidArgumentError(
          absl::StrCat(kRpc, ": the stream ended before its first piece"));
    }
    if (chunk.layer().empty()) {
      return absl::InvalidArgumentError(
          "layer: required in the first piece (a layer name)");
    }
    MHC_ASSIGN_OR_RETURN(std::shared_ptr<Layer> layer,
                         store_->Find(chunk.layer(), "layer"));
    ParameterStreamAssembler assembler(*layer);
    do {
      MHC_RETURN_IF_ERROR(assembler.Add(chunk));
    } while (next(&chunk));
    // The reads end the same way when the client closes its side and when
    // the call breaks; only a closed stream is complete.
    if (context.IsCancelled()) {
      return absl::CancelledError(absl::StrCat(
          kRpc, ": the stream broke off; the layer was not changed"));
    }
    MHC_RETURN_IF_ERROR(assembler.Finish());
    MHC_RETURN_IF_ERROR(store_->WriteChecked(*layer, assembler.Updates()));
    store_->FillInfo(*layer, response);
    return absl::OkStatus();
  });
}

}  // namespace mhc::server
