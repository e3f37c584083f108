// The mhc.v1.Mhc service: thin handlers that admit the request, call the
// layer store or the op runner, map the status and record metrics.
#ifndef MHC_SERVER_SERVICE_H_
#define MHC_SERVER_SERVICE_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "mhc/v1/service.grpc.pb.h"
#include "server/admission.h"
#include "server/authorizer.h"
#include "server/checkpoint_store.h"
#include "server/executor.h"
#include "server/groups.h"
#include "server/layer_store.h"
#include "server/metrics.h"
#include "server/op_runner.h"
#include "server/optimizer_runner.h"
#include "server/shm/call_ring.h"
#include "server/shm/shm_registry.h"

namespace mhc::server {

// Request metadata (headers) a call may carry, set explicitly in place of
// gRPC's 8 KiB default so that credentials and tracing headers fit.
inline constexpr uint64_t kMaxMetadataBytes = uint64_t{64} << 10;

struct ServiceOptions {
  RequestLimits limits;
  uint64_t max_message_bytes = uint64_t{1} << 30;
  int max_inflight = 64;
  ShmOptions shm;
};

// The open ExecuteStream calls, so that a drain can end them: a stream
// waiting for its next batch is cancelled, one running a batch ends after
// it.
class OpenStreams {
 public:
  class Entry {
   public:
    Entry(OpenStreams* streams, grpc::ServerContext* context);
    ~Entry();
    // Before waiting for the next batch: false when draining.
    bool Idle();
    // After the wait: false when draining (the wait was cancelled).
    bool Busy();

   private:
    OpenStreams* const streams_;
    grpc::ServerContext* const context_;
  };

  void EndAll();

 private:
  absl::Mutex mu_;
  bool ending_ ABSL_GUARDED_BY(mu_) = false;
  // Each open stream and whether it waits for a batch.
  std::map<grpc::ServerContext*, bool> idle_ ABSL_GUARDED_BY(mu_);
};

// A compute RPC by name: Execute (no kind) or a single op.
struct ComputeRpc {
  absl::string_view name;
  std::optional<OpKind> kind;
  const google::protobuf::Message* request;  // default instances
  const google::protobuf::Message* response;
};
// nullptr when `name` is no compute RPC (service_ops.cc).
const ComputeRpc* FindComputeRpc(absl::string_view name);

#define MHC_UNARY(Rpc, Req, Resp)                                        \
  grpc::Status Rpc(grpc::ServerContext* context, const v1::Req* request, \
                   v1::Resp* response) override

class MhcService final : public v1::Mhc::Service {
 public:
  // `executors`: one per device, the default device first; `authorizer`
  // decides who may call what.
  MhcService(const ServiceOptions& options, std::vector<Executor*> executors,
             LayerStore* store, CheckpointStore* checkpoints,
             Admission* admission, Metrics* metrics, ShmRegistry* shm,
             GroupRegistry* groups, const Authorizer* authorizer);

  MHC_UNARY(GetServerInfo, GetServerInfoRequest, GetServerInfoResponse);
  MHC_UNARY(GetDeterminismReport, GetDeterminismReportRequest,
            GetDeterminismReportResponse);
  MHC_UNARY(CreateLayer, CreateLayerRequest, LayerInfo);
  MHC_UNARY(GetLayer, GetLayerRequest, LayerInfo);
  MHC_UNARY(ListLayers, ListLayersRequest, ListLayersResponse);
  MHC_UNARY(DeleteLayer, DeleteLayerRequest, DeleteLayerResponse);
  MHC_UNARY(GetParameters, GetParametersRequest, Parameters);
  MHC_UNARY(SetParameters, SetParametersRequest, LayerInfo);
  MHC_UNARY(GetGradients, GetGradientsRequest, GetGradientsResponse);
  MHC_UNARY(ZeroGradients, ZeroGradientsRequest, ZeroGradientsResponse);
  // service_transfer.cc
  grpc::Status StreamParameters(
      grpc::ServerContext* context, const v1::GetParametersRequest* request,
      grpc::ServerWriter<v1::TensorChunk>* writer) override;
  grpc::Status StreamGradients(
      grpc::ServerContext* context, const v1::GetGradientsRequest* request,
      grpc::ServerWriter<v1::TensorChunk>* writer) override;
  grpc::Status SetParametersStream(
      grpc::ServerContext* context,
      grpc::ServerReader<v1::ParameterChunk>* reader,
      v1::LayerInfo* response) override;
  // SetParametersStream without its transport: `next` reads the next piece
  // and returns false after the last. The fuzz harness calls it directly.
  grpc::Status SetParametersFromPieces(
      const grpc::ServerContext& context,
      absl::FunctionRef<bool(v1::ParameterChunk*)> next,
      v1::LayerInfo* response);
  MHC_UNARY(ConvertLayout, ConvertLayoutRequest, LayerInfo);
  MHC_UNARY(MapLayerMemory, MapLayerMemoryRequest, LayerMemory);
  // service_optimizer.cc
  MHC_UNARY(OptimizerStep, OptimizerStepRequest, OptimizerStepResponse);

  // Checkpoints (service_checkpoint.cc).
  MHC_UNARY(SaveCheckpoint, SaveCheckpointRequest, SaveCheckpointResponse);
  MHC_UNARY(LoadCheckpoint, LoadCheckpointRequest, LoadCheckpointResponse);
  MHC_UNARY(ListCheckpoints, ListCheckpointsRequest, ListCheckpointsResponse);

  MHC_UNARY(Projection, ProjectionRequest, ProjectionResponse);
  MHC_UNARY(ProjectionBackward, ProjectionBackwardRequest,
            ProjectionBackwardResponse);
  MHC_UNARY(Scale, ScaleRequest, ScaleResponse);
  MHC_UNARY(ScaleBackward, ScaleBackwardRequest, ScaleBackwardResponse);
  MHC_UNARY(Sinkhorn, SinkhornRequest, SinkhornResponse);
  MHC_UNARY(SinkhornBackward, SinkhornBackwardRequest,
            SinkhornBackwardResponse);
  MHC_UNARY(Aggregate, AggregateRequest, AggregateResponse);
  MHC_UNARY(AggregateBackward, AggregateBackwardRequest,
            AggregateBackwardResponse);
  MHC_UNARY(ExpandCombine, PostRequest, PostResponse);
  MHC_UNARY(ExpandCombineBackward, PostBackwardRequest, PostBackwardResponse);
  MHC_UNARY(Pre, PreRequest, PreResponse);
  MHC_UNARY(PreBackward, PreBackwardRequest, PreBackwardResponse);
  MHC_UNARY(Post, PostRequest, PostResponse);
  MHC_UNARY(PostBackward, PostBackwardRequest, PostBackwardResponse);
  MHC_UNARY(Expand, ExpandRequest, ExpandResponse);
  MHC_UNARY(ExpandBackward, ExpandBackwardRequest, ExpandBackwardResponse);
  MHC_UNARY(Head, HeadRequest, HeadResponse);
  MHC_UNARY(HeadBackward, HeadBackwardRequest, HeadBackwardResponse);
  MHC_UNARY(Execute, ExecuteRequest, ExecuteResponse);

  grpc::Status ExecuteStream(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::ExecuteResponse, v1::ExecuteRequest>* stream)
      override;

  // Ends the open ExecuteStream calls for a drain: idle ones now, busy ones
  // after their batch. New streams end at once.
  void EndStreams() {
    streams_.EndAll();
    call_rings_.CloseAll();
  }

  // Layer count and parameter/gradient/optimizer memory after layers or
  // their optimizer state came or went (also after --restore).
  void UpdateLayerMetrics();

  // Shared memory (service_shm.cc).
  grpc::Status OpenSession(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::SessionEvent, v1::OpenSessionRequest>*
          stream) override;
  MHC_UNARY(RegisterSystemSharedMemory, RegisterSystemSharedMemoryRequest,
            RegisterSystemSharedMemoryResponse);
  MHC_UNARY(RegisterCudaSharedMemory, RegisterCudaSharedMemoryRequest,
            RegisterCudaSharedMemoryResponse);
  MHC_UNARY(UnregisterSharedMemory, UnregisterSharedMemoryRequest,
            UnregisterSharedMemoryResponse);
  MHC_UNARY(SharedMemoryStatus, SharedMemoryStatusRequest,
            SharedMemoryStatusResponse);
  MHC_UNARY(RegisterCudaEvents, RegisterCudaEventsRequest,
            RegisterCudaEventsResponse);
  // A session's call ring (call_ring.h); its calls: service_call_ring.cc.
  MHC_UNARY(OpenCallRing, OpenCallRingRequest, OpenCallRingResponse);

  // Data-parallel groups (service_groups.cc).
  MHC_UNARY(CreateGroup, CreateGroupRequest, GroupInfo);
  MHC_UNARY(JoinGroup, JoinGroupRequest, GroupInfo);
  MHC_UNARY(GetGroup, GetGroupRequest, GroupInfo);
  MHC_UNARY(AllReduceGradients, AllReduceGradientsRequest, CollectiveResponse);
  MHC_UNARY(BroadcastParameters, BroadcastParametersRequest,
            CollectiveResponse);
  MHC_UNARY(LeaveGroup, LeaveGroupRequest, LeaveGroupResponse);

 private:
  // Authorization, admission (unless `admit` is false), the call, status
  // mapping, metrics.
  grpc::Status Handle(const grpc::ServerContext& context, absl::string_view rpc,
                      bool admit, absl::FunctionRef<absl::Status()> body);
  // Handle's work after authorization, for calls from gRPC or a call ring.
  absl::Status Serve(absl::string_view rpc, bool admit, absl::Status authorized,
                     absl::Time start, absl::FunctionRef<absl::Status()> body);
  // One call taken from a session's call ring (service_call_ring.cc).
  absl::Status RingCall(const SessionRef& session,
                        const std::optional<Caller>& caller,
                        const RingCallRequest& call, std::string* response);
  grpc::Status RunOp(absl::string_view rpc, OpKind kind,
                     const grpc::ServerContext& context,
                     const google::protobuf::Message& request,
                     google::protobuf::Message* response);
  // The layer's parameters or gradients as TensorChunks.
  grpc::Status StreamTensors(
      const grpc::ServerContext& context, absl::string_view rpc,
      const std::string& layer_name,
      const google::protobuf::RepeatedPtrField<std::string>& names,
      uint64_t max_chunk_bytes, bool gradients,
      grpc::ServerWriter<v1::TensorChunk>* writer);
  // Data bytes per TensorChunk: each piece fits --max_message_bytes and
  // the client's `client_max` (0: no wish).
  uint64_t ChunkBytes(uint64_t client_max) const;
  // The session the call names, with its caller (see SessionRef).
  absl::StatusOr<SessionRef> SessionOf(
      const grpc::ServerContext& context) const;
  // The shared-memory view of one request: its session and transport.
  RegionScope Regions(const grpc::ServerContext& context);
  // Region gauges after registrations change.
  void PublishSharedMemory();

  const ServiceOptions options_;
  const std::vector<Executor*> executors_;
  LayerStore* const store_;
  CheckpointStore* const checkpoints_;
  Admission* const admission_;
  Metrics* const metrics_;
  ShmRegistry* const shm_;
  GroupRegistry* const groups_;
  const Authorizer* const authorizer_;
  OpRunner runner_;
  OptimizerRunner optimizer_;
  OpenStreams streams_;
  CallRings call_rings_;
};

#undef MHC_UNARY

}  // namespace mhc::server

#endif  // MHC_SERVER_SERVICE_H_
