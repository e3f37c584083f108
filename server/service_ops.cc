// The compute RPCs: each is the op runner on that op's messages. The same
// table lets a call ring find an RPC by name.
#include "server/service.h"

namespace mhc::server {

// RPC, request, response, OpKind.
#define MHC_COMPUTE_RPCS(X)                                                    \
  X(Projection, ProjectionRequest, ProjectionResponse, kProjectionForward)     \
  X(ProjectionBackward, ProjectionBackwardRequest, ProjectionBackwardResponse, \
    kProjectionBackward)                                                       \
  X(Scale, ScaleRequest, ScaleResponse, kScaleForward)                         \
  X(ScaleBackward, ScaleBackwardRequest, ScaleBackwardResponse,                \
    kScaleBackward)                                                            \
  X(Sinkhorn, SinkhornRequest, SinkhornResponse, kSinkhornForward)             \
  X(SinkhornBackward, SinkhornBackwardRequest, SinkhornBackwardResponse,       \
    kSinkhornBackward)                                                         \
  X(Aggregate, AggregateRequest, AggregateResponse, kAggregateForward)         \
  X(AggregateBackward, AggregateBackwardRequest, AggregateBackwardResponse,    \
    kAggregateBackward)                                                        \
  X(ExpandCombine, PostRequest, PostResponse, kPostForward)                    \
  X(ExpandCombineBackward, PostBackwardRequest, PostBackwardResponse,          \
    kPostBackward)                                                             \
  X(Pre, PreRequest, PreResponse, kPreForward)                                 \
  X(PreBackward, PreBackwardRequest, PreBackwardResponse, kPreBackward)        \
  X(Post, PostRequest, PostResponse, kPostForward)                             \
  X(PostBackward, PostBackwardRequest, PostBackwardResponse, kPostBackward)    \
  X(Expand, ExpandRequest, ExpandResponse, kExpandForward)                     \
  X(ExpandBackward, ExpandBackwardRequest, ExpandBackwardResponse,             \
    kExpandBackward)                                                           \
  X(Head, HeadRequest, HeadResponse, kHeadForward)                             \
  X(HeadBackward, HeadBackwardRequest, HeadBackwardResponse, kHeadBackward)

#define MHC_OP_HANDLER(Rpc, Req, Resp, Kind)                                 \
  grpc::Status MhcService::Rpc(grpc::ServerContext* context,                 \
                               const v1::Req* request, v1::Resp* response) { \
    return RunOp(#Rpc, OpKind::Kind, *context, *request, response);          \
  }
MHC_COMPUTE_RPCS(MHC_OP_HANDLER)
#undef MHC_OP_HANDLER

const ComputeRpc* FindComputeRpc(absl::string_view name) {
#define MHC_OP_ENTRY(Rpc, Req, Resp, Kind)                     \
  ComputeRpc{#Rpc, OpKind::Kind, &v1::Req::default_instance(), \
             &v1::Resp::default_instance()},
  static const ComputeRpc kRpcs[] = {MHC_COMPUTE_RPCS(MHC_OP_ENTRY) ComputeRpc{
      "Execute", std::nullopt, &v1::ExecuteRequest::default_instance(),
      &v1::ExecuteResponse::default_instance()}};
#undef MHC_OP_ENTRY
  for (const ComputeRpc& rpc : kRpcs) {
    if (rpc.name == name) return &rpc;
  }
  return nullptr;
}

#undef MHC_COMPUTE_RPCS

}  // namespace mhc::server
