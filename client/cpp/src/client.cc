#include "mhc/client/client.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/client_interceptor.h"
#include "mhc/client/call_ring.h"
#include "mhc/client/compute_method.h"
#include "mhc/status.h"
#include "tensor_chunks.h"

namespace mhc::client {

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  // grpc::StatusCode and absl::StatusCode are both the canonical codes.
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

absl::StatusOr<std::string> NormalizeAddress(absl::string_view address) {
  if (address.empty()) {
    return absl::InvalidArgumentError("address: empty");
  }
  if (absl::StartsWith(address, "unix:")) {
    if (address.size() == 5) {
      return absl::InvalidArgumentError("address: unix: needs a path");
    }
    return std::string(address);
  }
  // Other gRPC name schemes pass through; a bare host:port needs a port.
  if (absl::StrContains(address, "://") || absl::StartsWith(address, "dns:") ||
      absl::StartsWith(address, "ipv4:") ||
      absl::StartsWith(address, "ipv6:")) {
    return std::string(address);
  }
  size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "address: expected host:port or unix:/path, got '", address, "'"));
  }
  return std::string(address);
}

namespace {

// Adds the bearer token to every call of the channel, health checks and
// session streams included.
class BearerTokenInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit BearerTokenInterceptor(const std::string* header)
      : header_(header) {}
  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::
                PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace("authorization", *header_);
    }
    methods->Proceed();
  }

 private:
  const std::string* const header_;
};

class BearerTokenFactory final
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerTokenFactory(const std::string& token)
      : header_(absl::StrCat("Bearer ", token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new BearerTokenInterceptor(&header_);
  }

 private:
  const std::string header_;
};

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    absl::string_view target, const ClientOptions& options) {
  const bool client_cert = !options.tls_client_cert_pem.empty() ||
                           !options.tls_client_key_pem.empty();
  if (!options.tls) {
    if (client_cert || !options.tls_root_ca_pem.empty() ||
        !options.tls_server_name.empty()) {
      return absl::InvalidArgumentError(
          "TLS settings (root CA, client certificate, server name) need "
          "tls = true");
    }
    return grpc::InsecureChannelCredentials();
  }
  if (absl::StartsWith(target, "unix:")) {
    return absl::InvalidArgumentError(
        "tls: only for TCP addresses (unix sockets are local and use the "
        "peer's user instead)");
  }
  if (options.tls_client_cert_pem.empty() !=
      options.tls_client_key_pem.empty()) {
    return absl::InvalidArgumentError(
        "tls client certificate and key: give both or neither");
  }
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = options.tls_root_ca_pem;
  ssl.pem_cert_chain = options.tls_client_cert_pem;
  ssl.pem_private_key = options.tls_client_key_pem;
  return grpc::SslCredentials(ssl);
}

}  // namespace

absl::StatusOr<std::string> ReadClientFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream text;
  text << file.rdbuf();
  if (!file) {
    return absl::InvalidArgumentError(absl::StrCat("cannot read ", path));
  }
  return text.str();
}

Client::Client(std::string target, ClientOptions options,
               std::shared_ptr<grpc::Channel> channel)
    : target_(std::move(target)),
      options_(options),
      channel_(std::move(channel)),
      stub_(v1::Mhc::NewStub(channel_)),
      health_stub_(grpc::health::v1::Health::NewStub(channel_)) {}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(
    absl::string_view address, ClientOptions options) {
  absl::StatusOr<std::string> target = NormalizeAddress(address);
  if (!target.ok()) return target.status();
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      ChannelCredentials(*target, options);
  if (!credentials.ok()) return credentials.status();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  if (!options.tls_server_name.empty()) {
    args.SetSslTargetNameOverride(options.tls_server_name);
  }
  std::vector<
      std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>
      interceptors;
  if (!options.bearer_token.empty()) {
    interceptors.push_back(
        std::make_unique<BearerTokenFactory>(options.bearer_token));
  }
  auto channel = grpc::experimental::CreateCustomChannelWithInterceptors(
      *target, *credentials, args, std::move(interceptors));
  return std::unique_ptr<Client>(
      new Client(*std::move(target), options, std::move(channel)));
}

absl::Status Client::WaitForReady(absl::Duration timeout) {
  auto deadline =
      std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout);
  if (!channel_->WaitForConnected(deadline)) {
    return absl::UnavailableError(absl::StrCat("could not connect to ", target_,
                                               " within ",
                                               absl::FormatDuration(timeout)));
  }
  return absl::OkStatus();
}

void Client::Prepare(grpc::ClientContext& context) const {
  Prepare(context, CallOptions{stream_order_, std::nullopt, std::nullopt});
}

void Client::Prepare(grpc::ClientContext& context,
                     const CallOptions& options) const {
  context.set_deadline(
      std::chrono::system_clock::now() +
      absl::ToChronoMilliseconds(options.timeout.value_or(options_.timeout)));
  const absl::string_view session = options.session_id.value_or(session_id_);
  if (!session.empty()) {
    context.AddMetadata("mhc-session-id", std::string(session));
  }
  const StreamOrder& order = options.stream_order;
  if (order.wait_event >= 0) {
    context.AddMetadata("mhc-wait-event", absl::StrCat(order.wait_event));
  }
  if (order.signal_event >= 0) {
    context.AddMetadata("mhc-signal-event", absl::StrCat(order.signal_event));
  }
}

bool Client::TryCallRing(absl::string_view method,
                         const google::protobuf::Message& request,
                         google::protobuf::Message& response,
                         const CallOptions& options,
                         absl::Status* status) const {
  const std::shared_ptr<CallRing> ring = std::atomic_load(&call_ring_);
  if (ring == nullptr ||
      options.session_id.value_or(session_id_) != ring->session_id()) {
    return false;
  }
  // A closed or broken ring answers "not sent", and the call goes by gRPC.
  bool sent = false;
  *status = ring->Call(method, request, response, options.stream_order,
                       options.timeout.value_or(options_.timeout), &sent);
  return sent;
}

absl::Status Client::Compute(const ComputeMethod& method,
                             const google::protobuf::Message& request,
                             google::protobuf::Message& response,
                             const CallOptions& options) const {
  absl::Status status;
  if (TryCallRing(method.name(), request, response, options, &status)) {
    return status;
  }
  grpc::ClientContext context;
  Prepare(context, options);
  return method.Invoke(*stub_, context, request, response);
}

template <typename Request, typename Response, typename Method>
absl::StatusOr<Response> Client::Call(Method method, const Request& request) {
  grpc::ClientContext context;
  Prepare(context);
  Response response;
  grpc::Status status = (stub_.get()->*method)(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<std::string> Client::Health(const std::string& service) {
  grpc::ClientContext context;
  Prepare(context);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = health_stub_->Check(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(
      response.status());
}

absl::StatusOr<v1::GetServerInfoResponse> Client::GetServerInfo() {
  return Call<v1::GetServerInfoRequest, v1::GetServerInfoResponse>(
      &v1::Mhc::Stub::GetServerInfo, v1::GetServerInfoRequest());
}

absl::StatusOr<v1::GetDeterminismReportResponse>
Client::GetDeterminismReport() {
  return Call<v1::GetDeterminismReportRequest,
              v1::GetDeterminismReportResponse>(
      &v1::Mhc::Stub::GetDeterminismReport, v1::GetDeterminismReportRequest());
}

absl::StatusOr<v1::LayerInfo> Client::CreateLayer(
    const v1::CreateLayerRequest& r) {
  return Call<v1::CreateLayerRequest, v1::LayerInfo>(
      &v1::Mhc::Stub::CreateLayer, r);
}

absl::StatusOr<v1::LayerInfo> Client::GetLayer(const std::string& name) {
  v1::GetLayerRequest r;
  r.set_name(name);
  return Call<v1::GetLayerRequest, v1::LayerInfo>(&v1::Mhc::Stub::GetLayer, r);
}

absl::StatusOr<v1::ListLayersResponse> Client::ListLayers() {
  return Call<v1::ListLayersRequest, v1::ListLayersResponse>(
      &v1::Mhc::Stub::ListLayers, v1::ListLayersRequest());
}

absl::StatusOr<v1::DeleteLayerResponse> Client::DeleteLayer(
    const std::string& name) {
  v1::DeleteLayerRequest r;
  r.set_name(name);
  return Call<v1::DeleteLayerRequest, v1::DeleteLayerResponse>(
      &v1::Mhc::Stub::DeleteLayer, r);
}

absl::StatusOr<v1::Parameters> Client::GetParameters(
    const std::string& layer, const std::vector<std::string>& names) {
  v1::GetParametersRequest r;
  r.set_layer(layer);
  for (const std::string& name : names) r.add_names(name);
  return Call<v1::GetParametersRequest, v1::Parameters>(
      &v1::Mhc::Stub::GetParameters, r);
}

absl::StatusOr<v1::LayerInfo> Client::SetParameters(
    const v1::SetParametersRequest& r) {
  return Call<v1::SetParametersRequest, v1::LayerInfo>(
      &v1::Mhc::Stub::SetParameters, r);
}

absl::StatusOr<v1::GetGradientsResponse> Client::GetGradients(
    const std::string& layer, const std::vector<std::string>& names) {
  v1::GetGradientsRequest r;
  r.set_layer(layer);
  for (const std::string& name : names) r.add_names(name);
  return Call<v1::GetGradientsRequest, v1::GetGradientsResponse>(
      &v1::Mhc::Stub::GetGradients, r);
}

namespace {

// The largest piece a client with `max_message_bytes` can receive, leaving
// room for the piece's name and shape.
uint64_t MaxChunkBytes(int max_message_bytes) {
  constexpr uint64_t kHeadroom = 64 << 10;
  const uint64_t limit = static_cast<uint64_t>(std::max(max_message_bytes, 0));
  return limit > 2 * kHeadroom ? limit - kHeadroom
                               : std::max<uint64_t>(limit / 2, 4);
}

// Reads a StreamParameters/StreamGradients answer to its end.
absl::Status ReadChunks(grpc::ClientReader<v1::TensorChunk>& reader,
                        TensorChunkAssembler& assembler) {
  v1::TensorChunk chunk;
  absl::Status assembled;
  while (reader.Read(&chunk)) {
    if (assembled.ok()) assembled = assembler.Add(chunk);
  }
  grpc::Status status = reader.Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  if (!assembled.ok()) return assembled;
  return assembler.Finish();
}

}  // namespace

absl::StatusOr<v1::Parameters> Client::StreamParameters(
    const std::string& layer, const std::vector<std::string>& names) {
  v1::GetParametersRequest r;
  r.set_layer(layer);
  for (const std::string& name : names) r.add_names(name);
  r.set_max_chunk_bytes(MaxChunkBytes(options_.max_message_bytes));
  grpc::ClientContext context;
  Prepare(context);
  auto reader = stub_->StreamParameters(&context, r);
  TensorChunkAssembler assembler;
  MHC_RETURN_IF_ERROR(ReadChunks(*reader, assembler));
  return std::move(assembler.parameters());
}

absl::StatusOr<v1::GetGradientsResponse> Client::StreamGradients(
    const std::string& layer, const std::vector<std::string>& names) {
  v1::GetGradientsRequest r;
  r.set_layer(layer);
  for (const std::string& name : names) r.add_names(name);
  r.set_max_chunk_bytes(MaxChunkBytes(options_.max_message_bytes));
  grpc::ClientContext context;
  Prepare(context);
  auto reader = stub_->StreamGradients(&context, r);
  TensorChunkAssembler assembler;
  MHC_RETURN_IF_ERROR(ReadChunks(*reader, assembler));
  v1::GetGradientsResponse response;
  *response.mutable_gradients() = std::move(assembler.parameters());
  response.set_gradient_tokens(assembler.gradient_tokens());
  return response;
}

absl::StatusOr<v1::LayerInfo> Client::SetParametersStream(
    const v1::SetParametersRequest& r, uint64_t max_chunk_bytes) {
  // Nothing to cut up: the stream needs at least one piece.
  if (r.parameters().tensors().empty()) return SetParameters(r);
  if (max_chunk_bytes == 0) {
    MHC_ASSIGN_OR_RETURN(v1::GetServerInfoResponse info, GetServerInfo());
    const uint64_t daemon = info.limits().max_message_bytes();
    const uint64_t limit = std::min<uint64_t>(
        daemon > 0 ? daemon : UINT64_MAX,
        static_cast<uint64_t>(std::max(options_.max_message_bytes, 0)));
    // At most the client's int limit, so the cast keeps the value.
    max_chunk_bytes = MaxChunkBytes(static_cast<int>(limit));
  }
  grpc::ClientContext context;
  Prepare(context);
  v1::LayerInfo info;
  auto writer = stub_->SetParametersStream(&context, &info);
  const absl::Status sent = SendParameterChunks(
      r, max_chunk_bytes,
      [&](const v1::ParameterChunk& chunk) { return writer->Write(chunk); });
  // The daemon applies nothing from a cancelled stream.
  if (!sent.ok()) context.TryCancel();
  // A failed write means the daemon ended the call; Finish says why.
  writer->WritesDone();
  grpc::Status status = writer->Finish();
  if (!sent.ok()) return sent;
  if (!status.ok()) return FromGrpcStatus(status);
  return info;
}

absl::StatusOr<v1::ZeroGradientsResponse> Client::ZeroGradients(
    const std::string& layer) {
  v1::ZeroGradientsRequest r;
  r.set_layer(layer);
  return Call<v1::ZeroGradientsRequest, v1::ZeroGradientsResponse>(
      &v1::Mhc::Stub::ZeroGradients, r);
}

absl::StatusOr<v1::LayerInfo> Client::ConvertLayout(const std::string& layer,
                                                    v1::Layout layout) {
  v1::ConvertLayoutRequest r;
  r.set_layer(layer);
  r.set_layout(layout);
  return Call<v1::ConvertLayoutRequest, v1::LayerInfo>(
      &v1::Mhc::Stub::ConvertLayout, r);
}

absl::StatusOr<v1::SaveCheckpointResponse> Client::SaveCheckpoint(
    const v1::SaveCheckpointRequest& r) {
  return Call<v1::SaveCheckpointRequest, v1::SaveCheckpointResponse>(
      &v1::Mhc::Stub::SaveCheckpoint, r);
}

absl::StatusOr<v1::LoadCheckpointResponse> Client::LoadCheckpoint(
    const v1::LoadCheckpointRequest& r) {
  return Call<v1::LoadCheckpointRequest, v1::LoadCheckpointResponse>(
      &v1::Mhc::Stub::LoadCheckpoint, r);
}

absl::StatusOr<v1::ListCheckpointsResponse> Client::ListCheckpoints() {
  return Call<v1::ListCheckpointsRequest, v1::ListCheckpointsResponse>(
      &v1::Mhc::Stub::ListCheckpoints, v1::ListCheckpointsRequest());
}

// The compute RPCs are all unary with the same shape of call, through the
// call ring when one is open.
#define MHC_CLIENT_UNARY(Name, Request, Response)                           \
  absl::StatusOr<v1::Response> Client::Name(const v1::Request& r) {         \
    v1::Response response;                                                  \
    absl::Status status;                                                    \
    if (TryCallRing(#Name, r, response,                                     \
                    CallOptions{stream_order_, std::nullopt, std::nullopt}, \
                    &status)) {                                             \
      if (!status.ok()) return status;                                      \
      return response;                                                      \
    }                                                                       \
    return Call<v1::Request, v1::Response>(&v1::Mhc::Stub::Name, r);        \
  }

MHC_CLIENT_UNARY(Projection, ProjectionRequest, ProjectionResponse)
MHC_CLIENT_UNARY(ProjectionBackward, ProjectionBackwardRequest,
                 ProjectionBackwardResponse)
MHC_CLIENT_UNARY(Scale, ScaleRequest, ScaleResponse)
MHC_CLIENT_UNARY(ScaleBackward, ScaleBackwardRequest, ScaleBackwardResponse)
MHC_CLIENT_UNARY(Sinkhorn, SinkhornRequest, SinkhornResponse)
MHC_CLIENT_UNARY(SinkhornBackward, SinkhornBackwardRequest,
                 SinkhornBackwardResponse)
MHC_CLIENT_UNARY(Aggregate, AggregateRequest, AggregateResponse)
MHC_CLIENT_UNARY(AggregateBackward, AggregateBackwardRequest,
                 AggregateBackwardResponse)
MHC_CLIENT_UNARY(ExpandCombine, PostRequest, PostResponse)
MHC_CLIENT_UNARY(ExpandCombineBackward, PostBackwardRequest,
                 PostBackwardResponse)
MHC_CLIENT_UNARY(Pre, PreRequest, PreResponse)
MHC_CLIENT_UNARY(PreBackward, PreBackwardRequest, PreBackwardResponse)
MHC_CLIENT_UNARY(Post, PostRequest, PostResponse)
MHC_CLIENT_UNARY(PostBackward, PostBackwardRequest, PostBackwardResponse)
MHC_CLIENT_UNARY(Expand, ExpandRequest, ExpandResponse)
MHC_CLIENT_UNARY(ExpandBackward, ExpandBackwardRequest, ExpandBackwardResponse)
MHC_CLIENT_UNARY(Head, HeadRequest, HeadResponse)
MHC_CLIENT_UNARY(HeadBackward, HeadBackwardRequest, HeadBackwardResponse)
MHC_CLIENT_UNARY(Execute, ExecuteRequest, ExecuteResponse)

#undef MHC_CLIENT_UNARY

absl::StatusOr<v1::OptimizerStepResponse> Client::OptimizerStep(
    const v1::OptimizerStepRequest& r) {
  return Call<v1::OptimizerStepRequest, v1::OptimizerStepResponse>(
      &v1::Mhc::Stub::OptimizerStep, r);
}

absl::StatusOr<std::vector<v1::ExecuteResponse>> Client::ExecuteStream(
    const std::vector<v1::ExecuteRequest>& batches) {
  grpc::ClientContext context;
  Prepare(context);
  auto stream = stub_->ExecuteStream(&context);
  std::vector<v1::ExecuteResponse> responses;
  // One batch in flight at a time keeps the answers' order obvious and lets
  // the first failure end the stream early.
  for (const v1::ExecuteRequest& batch : batches) {
    if (!stream->Write(batch)) break;
    v1::ExecuteResponse response;
    if (!stream->Read(&response)) break;
    responses.push_back(std::move(response));
  }
  stream->WritesDone();
  v1::ExecuteResponse extra;
  while (stream->Read(&extra)) responses.push_back(std::move(extra));
  grpc::Status status = stream->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  if (responses.size() != batches.size()) {
    return absl::InternalError(absl::StrCat("ExecuteStream: sent ",
                                            batches.size(), " batches, got ",
                                            responses.size(), " answers"));
  }
  return responses;
}

absl::Status Client::RegisterSystemSharedMemory(const std::string& name,
                                                const std::string& key,
                                                uint64_t offset,
                                                uint64_t byte_size) {
  v1::RegisterSystemSharedMemoryRequest r;
  r.set_name(name);
  r.set_key(key);
  r.set_offset(offset);
  r.set_byte_size(byte_size);
  return Call<v1::RegisterSystemSharedMemoryRequest,
              v1::RegisterSystemSharedMemoryResponse>(
             &v1::Mhc::Stub::RegisterSystemSharedMemory, r)
      .status();
}

absl::Status Client::RegisterCudaSharedMemory(const std::string& name,
                                              const std::string& raw_handle,
                                              int device_id,
                                              uint64_t byte_size) {
  v1::RegisterCudaSharedMemoryRequest r;
  r.set_name(name);
  r.set_raw_handle(raw_handle);
  r.set_device_id(device_id);
  r.set_byte_size(byte_size);
  return Call<v1::RegisterCudaSharedMemoryRequest,
              v1::RegisterCudaSharedMemoryResponse>(
             &v1::Mhc::Stub::RegisterCudaSharedMemory, r)
      .status();
}

absl::StatusOr<v1::UnregisterSharedMemoryResponse>
Client::UnregisterSharedMemory(const std::string& name) {
  v1::UnregisterSharedMemoryRequest r;
  r.set_name(name);
  return Call<v1::UnregisterSharedMemoryRequest,
              v1::UnregisterSharedMemoryResponse>(
      &v1::Mhc::Stub::UnregisterSharedMemory, r);
}

absl::StatusOr<std::vector<std::string>> Client::RegisterCudaEvents(
    int device_id, const std::vector<std::string>& raw_handles) {
  v1::RegisterCudaEventsRequest r;
  r.set_device_id(device_id);
  for (const std::string& handle : raw_handles) r.add_raw_handles(handle);
  MHC_ASSIGN_OR_RETURN(
      v1::RegisterCudaEventsResponse response,
      (Call<v1::RegisterCudaEventsRequest, v1::RegisterCudaEventsResponse>(
          &v1::Mhc::Stub::RegisterCudaEvents, r)));
  return std::vector<std::string>(response.raw_handles().begin(),
                                  response.raw_handles().end());
}

absl::Status Client::OpenCallRing(const std::string& region) {
  v1::OpenCallRingRequest r;
  r.set_region(region);
  return Call<v1::OpenCallRingRequest, v1::OpenCallRingResponse>(
             &v1::Mhc::Stub::OpenCallRing, r)
      .status();
}

absl::StatusOr<v1::LayerMemory> Client::MapLayerMemory(
    const std::string& layer) {
  v1::MapLayerMemoryRequest r;
  r.set_layer(layer);
  return Call<v1::MapLayerMemoryRequest, v1::LayerMemory>(
      &v1::Mhc::Stub::MapLayerMemory, r);
}

absl::StatusOr<v1::SharedMemoryStatusResponse> Client::SharedMemoryStatus(
    const std::string& name) {
  v1::SharedMemoryStatusRequest r;
  r.set_name(name);
  return Call<v1::SharedMemoryStatusRequest, v1::SharedMemoryStatusResponse>(
      &v1::Mhc::Stub::SharedMemoryStatus, r);
}

}  // namespace mhc::client
