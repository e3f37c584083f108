// mhc::client::Client: a thin, typed wrapper over the generated mhc.v1.Mhc
// stub. Every RPC returns absl::StatusOr whose absl code is the gRPC code the
// daemon sent (the two enumerations share their numbering), so callers can
// branch on INVALID_ARGUMENT, NOT_FOUND, ... without touching gRPC types.
#ifndef MHC_CLIENT_CLIENT_H_
#define MHC_CLIENT_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "mhc/v1/service.grpc.pb.h"

namespace mhc::client {

struct ClientOptions {
  // Deadline of every call, measured from its start.
  absl::Duration timeout = absl::Seconds(60);
  // Largest message sent or received; the daemon's default limit.
  int max_message_bytes = 1 << 30;
  // TLS to a TCP address (docs/security.md). The PEM texts, not paths:
  // the CA that signed the daemon's certificate (empty: the system's
  // roots), and for mutual TLS the client's certificate chain and key.
  bool tls = false;
  std::string tls_root_ca_pem;
  std::string tls_client_cert_pem;
  std::string tls_client_key_pem;
  // The name the daemon's certificate must carry when it is not the
  // address's host (e.g. "localhost" for 127.0.0.1).
  std::string tls_server_name;
  // Sent as "authorization: Bearer TOKEN" with every call; empty: none.
  std::string bearer_token;
};

// Reads a whole file (a PEM certificate or key, a token file) for
// ClientOptions; surrounding whitespace is kept.
absl::StatusOr<std::string> ReadClientFile(const std::string& path);

// Converts a gRPC status to absl, keeping code and message.
absl::Status FromGrpcStatus(const grpc::Status& status);

// Accepts "host:port", "[v6]:port", "unix:/path" (and any other gRPC target
// such as "dns:///host:port"); returns the gRPC target string.
absl::StatusOr<std::string> NormalizeAddress(absl::string_view address);

// Stream order of compute calls (see shm.proto): indices into the session's
// events on the layers' device, -1 for none. With a signal event the daemon
// answers once the work is queued; the caller's stream must wait for the
// daemon's event `signal_event` before it reads an output or reuses an
// input.
struct StreamOrder {
  int wait_event = -1;
  int signal_event = -1;
};

// Settings of one call, for callers that share a Client between threads
// (the client-wide session, stream order and timeout are not per call).
struct CallOptions {
  StreamOrder stream_order;
  // The client's when unset; the session id must outlive the call.
  std::optional<absl::Duration> timeout;
  std::optional<absl::string_view> session_id;
};

class ComputeMethod;
class CallRing;

class Client {
 public:
  // Creates the channel; does not wait for the daemon (see WaitForReady).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      absl::string_view address, ClientOptions options = {});

  // Blocks until the channel is connected or `timeout` passes.
  absl::Status WaitForReady(absl::Duration timeout);

  absl::Duration timeout() const { return options_.timeout; }
  void set_timeout(absl::Duration timeout) { options_.timeout = timeout; }
  const std::string& target() const { return target_; }
  mhc::v1::Mhc::Stub* stub() { return stub_.get(); }

  // Shared-memory session whose id every call carries as metadata
  // "mhc-session-id" (set by Session::Open in mhc/client/shm.h); empty:
  // none.
  const std::string& session_id() const { return session_id_; }
  void set_session_id(std::string id) { session_id_ = std::move(id); }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  // Sent with every later call (compute calls use it) until set again;
  // StreamOrder{} sends none.
  void set_stream_order(StreamOrder order) { stream_order_ = order; }

  // grpc.health.v1 Check: "SERVING", "NOT_SERVING", "UNKNOWN", ...
  absl::StatusOr<std::string> Health(const std::string& service = "");

  absl::StatusOr<v1::GetServerInfoResponse> GetServerInfo();
  absl::StatusOr<v1::GetDeterminismReportResponse> GetDeterminismReport();

  absl::StatusOr<v1::LayerInfo> CreateLayer(const v1::CreateLayerRequest& r);
  absl::StatusOr<v1::LayerInfo> GetLayer(const std::string& name);
  absl::StatusOr<v1::ListLayersResponse> ListLayers();
  absl::StatusOr<v1::DeleteLayerResponse> DeleteLayer(const std::string& name);
  absl::StatusOr<v1::Parameters> GetParameters(
      const std::string& layer, const std::vector<std::string>& names = {});
  absl::StatusOr<v1::LayerInfo> SetParameters(
      const v1::SetParametersRequest& r);
  absl::StatusOr<v1::GetGradientsResponse> GetGradients(
      const std::string& layer, const std::vector<std::string>& names = {});
  // GetParameters and GetGradients for layers larger than the message
  // limit (theirs or the daemon's --max_message_bytes): the same answer,
  // assembled from the pieces of StreamParameters/StreamGradients.
  absl::StatusOr<v1::Parameters> StreamParameters(
      const std::string& layer, const std::vector<std::string>& names = {});
  absl::StatusOr<v1::GetGradientsResponse> StreamGradients(
      const std::string& layer, const std::vector<std::string>& names = {});
  // SetParameters for layers larger than the message limit: the same
  // request (inline tensors) sent in pieces through SetParametersStream,
  // applied all at once or not at all. `max_chunk_bytes` 0: pieces that fit
  // this client's and the daemon's limits (asked with GetServerInfo).
  absl::StatusOr<v1::LayerInfo> SetParametersStream(
      const v1::SetParametersRequest& r, uint64_t max_chunk_bytes = 0);
  absl::StatusOr<v1::ZeroGradientsResponse> ZeroGradients(
      const std::string& layer);
  absl::StatusOr<v1::LayerInfo> ConvertLayout(const std::string& layer,
                                              v1::Layout layout);
  // The layer's parameters and gradients as one CUDA IPC allocation.
  absl::StatusOr<v1::LayerMemory> MapLayerMemory(const std::string& layer);
  // One optimizer step over the request's layers (optimizer.proto); sent
  // with the stream order like the compute calls.
  absl::StatusOr<v1::OptimizerStepResponse> OptimizerStep(
      const v1::OptimizerStepRequest& r);

  // Checkpoints in the daemon's --state_dir (docs/checkpoints.md).
  absl::StatusOr<v1::SaveCheckpointResponse> SaveCheckpoint(
      const v1::SaveCheckpointRequest& r);
  absl::StatusOr<v1::LoadCheckpointResponse> LoadCheckpoint(
      const v1::LoadCheckpointRequest& r);
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints();

  absl::StatusOr<v1::ProjectionResponse> Projection(
      const v1::ProjectionRequest& r);
  absl::StatusOr<v1::ProjectionBackwardResponse> ProjectionBackward(
      const v1::ProjectionBackwardRequest& r);
  absl::StatusOr<v1::ScaleResponse> Scale(const v1::ScaleRequest& r);
  absl::StatusOr<v1::ScaleBackwardResponse> ScaleBackward(
      const v1::ScaleBackwardRequest& r);
  absl::StatusOr<v1::SinkhornResponse> Sinkhorn(const v1::SinkhornRequest& r);
  absl::StatusOr<v1::SinkhornBackwardResponse> SinkhornBackward(
      const v1::SinkhornBackwardRequest& r);
  absl::StatusOr<v1::AggregateResponse> Aggregate(
      const v1::AggregateRequest& r);
  absl::StatusOr<v1::AggregateBackwardResponse> AggregateBackward(
      const v1::AggregateBackwardRequest& r);
  absl::StatusOr<v1::PostResponse> ExpandCombine(const v1::PostRequest& r);
  absl::StatusOr<v1::PostBackwardResponse> ExpandCombineBackward(
      const v1::PostBackwardRequest& r);
  absl::StatusOr<v1::PreResponse> Pre(const v1::PreRequest& r);
  absl::StatusOr<v1::PreBackwardResponse> PreBackward(
      const v1::PreBackwardRequest& r);
  absl::StatusOr<v1::PostResponse> Post(const v1::PostRequest& r);
  absl::StatusOr<v1::PostBackwardResponse> PostBackward(
      const v1::PostBackwardRequest& r);
  absl::StatusOr<v1::ExpandResponse> Expand(const v1::ExpandRequest& r);
  absl::StatusOr<v1::ExpandBackwardResponse> ExpandBackward(
      const v1::ExpandBackwardRequest& r);
  absl::StatusOr<v1::HeadResponse> Head(const v1::HeadRequest& r);
  absl::StatusOr<v1::HeadBackwardResponse> HeadBackward(
      const v1::HeadBackwardRequest& r);
  absl::StatusOr<v1::ExecuteResponse> Execute(const v1::ExecuteRequest& r);
  // The compute RPC `method` chosen at run time (see
  // mhc/client/compute_method.h); `request` and `response` must be its
  // messages. Safe to call from several threads at once.
  absl::Status Compute(const ComputeMethod& method,
                       const google::protobuf::Message& request,
                       google::protobuf::Message& response,
                       const CallOptions& options) const;
  // Sends every batch on one stream and returns the answers in order; the
  // first failing batch ends the stream and its status is returned.
  absl::StatusOr<std::vector<v1::ExecuteResponse>> ExecuteStream(
      const std::vector<v1::ExecuteRequest>& batches);

  // Shared memory of this client's session (see mhc/client/shm.h).
  absl::Status RegisterSystemSharedMemory(const std::string& name,
                                          const std::string& key,
                                          uint64_t offset, uint64_t byte_size);
  absl::Status RegisterCudaSharedMemory(const std::string& name,
                                        const std::string& raw_handle,
                                        int device_id, uint64_t byte_size);
  // `name` empty: all of the session's regions.
  absl::StatusOr<v1::UnregisterSharedMemoryResponse> UnregisterSharedMemory(
      const std::string& name);
  absl::StatusOr<v1::SharedMemoryStatusResponse> SharedMemoryStatus(
      const std::string& name = "");
  // Opens the session's events (cudaIpcEventHandle_t each) on `device_id`;
  // returns the daemon's, as many.
  absl::StatusOr<std::vector<std::string>> RegisterCudaEvents(
      int device_id, const std::vector<std::string>& raw_handles);
  // Makes system region `region` of the session its call ring (see
  // mhc/client/call_ring.h, which calls this).
  absl::Status OpenCallRing(const std::string& region);
  // Sends Compute calls of the ring's session through `ring` while it is
  // usable (null: gRPC only). Safe while other threads call.
  void set_call_ring(std::shared_ptr<CallRing> ring) {
    std::atomic_store(&call_ring_, std::move(ring));
  }

 private:
  Client(std::string target, ClientOptions options,
         std::shared_ptr<grpc::Channel> channel);

  // Sends a compute call through the call ring when one of the call's
  // session is usable; false when the call is still to be sent by gRPC.
  bool TryCallRing(absl::string_view method,
                   const google::protobuf::Message& request,
                   google::protobuf::Message& response,
                   const CallOptions& options, absl::Status* status) const;

  // Prepares a context with this client's deadline and stream order.
  void Prepare(grpc::ClientContext& context) const;
  void Prepare(grpc::ClientContext& context, const CallOptions& options) const;

  template <typename Request, typename Response, typename Method>
  absl::StatusOr<Response> Call(Method method, const Request& request);

  std::string target_;
  ClientOptions options_;
  std::string session_id_;
  StreamOrder stream_order_;
  std::shared_ptr<CallRing> call_ring_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Mhc::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_stub_;
};

}  // namespace mhc::client

#endif  // MHC_CLIENT_CLIENT_H_
