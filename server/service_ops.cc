// The compute RPCs: each is the op runner on that op's messages.
#include "server/service.h"

namespace mhc::server {

#define MHC_OP_HANDLER(Rpc, Req, Resp, Kind)                                 \
  grpc::Status MhcService::Rpc(grpc::ServerContext* context,                 \
                               const v1::Req* request, v1::Resp* response) { \
    return RunOp(#Rpc, OpKind::Kind, *context, *request, response);          \
  }

MHC_OP_HANDLER(Projection, ProjectionRequest, ProjectionResponse,
               kProjectionForward)
MHC_OP_HANDLER(ProjectionBackward, ProjectionBackwardRequest,
               ProjectionBackwardResponse, kProjectionBackward)
MHC_OP_HANDLER(Scale, ScaleRequest, ScaleResponse, kScaleForward)
MHC_OP_HANDLER(ScaleBackward, ScaleBackwardRequest, ScaleBackwardResponse,
               kScaleBackward)
MHC_OP_HANDLER(Sinkhorn, SinkhornRequest, SinkhornResponse, kSinkhornForward)
MHC_OP_HANDLER(SinkhornBackward, SinkhornBackwardRequest,
               SinkhornBackwardResponse, kSinkhornBackward)
MHC_OP_HANDLER(Aggregate, AggregateRequest, AggregateResponse,
               kAggregateForward)
MHC_OP_HANDLER(AggregateBackward, AggregateBackwardRequest,
               AggregateBackwardResponse, kAggregateBackward)
MHC_OP_HANDLER(ExpandCombine, PostRequest, PostResponse, kPostForward)
MHC_OP_HANDLER(ExpandCombineBackward, PostBackwardRequest, PostBackwardResponse,
               kPostBackward)
MHC_OP_HANDLER(Pre, PreRequest, PreResponse, kPreForward)
MHC_OP_HANDLER(PreBackward, PreBackwardRequest, PreBackwardResponse,
               kPreBackward)
MHC_OP_HANDLER(Post, PostRequest, PostResponse, kPostForward)
MHC_OP_HANDLER(PostBackward, PostBackwardRequest, PostBackwardResponse,
               kPostBackward)
MHC_OP_HANDLER(Expand, ExpandRequest, ExpandResponse, kExpandForward)
MHC_OP_HANDLER(ExpandBackward, ExpandBackwardRequest, ExpandBackwardResponse,
               kExpandBackward)
MHC_OP_HANDLER(Head, HeadRequest, HeadResponse, kHeadForward)
MHC_OP_HANDLER(HeadBackward, HeadBackwardRequest, HeadBackwardResponse,
               kHeadBackward)

#undef MHC_OP_HANDLER

}  // namespace mhc::server
