#include "mhc/client/compute_method.h"

#include <array>

#include "absl/strings/str_cat.h"
#include "mhc/client/client.h"

namespace mhc::client {
namespace {

using google::protobuf::Message;

template <typename Request, typename Response>
using StubMethod = grpc::Status (v1::Mhc::Stub::*)(grpc::ClientContext*,
                                                   const Request&, Response*);

// The messages were checked against the method's types by Invoke.
template <typename Request, typename Response,
          StubMethod<Request, Response> kMethod>
grpc::Status InvokeTyped(v1::Mhc::Stub& stub, grpc::ClientContext& context,
                         const Message& request, Message& response) {
  return (stub.*kMethod)(&context, static_cast<const Request&>(request),
                         static_cast<Response*>(&response));
}

template <typename Request>
std::string* LayerOf(Message& request) {
  return static_cast<Request&>(request).mutable_layer();
}

template <typename Request>
ComputeMethod::OutputRegions* OutputRegionsOf(Message& request) {
  return static_cast<Request&>(request).mutable_output_regions();
}

template <typename Request, typename Response,
          StubMethod<Request, Response> kMethod>
ComputeMethod Make(const char* name) {
  return ComputeMethod(name, &Request::default_instance(),
                       &Response::default_instance(),
                       &InvokeTyped<Request, Response, kMethod>,
                       {&LayerOf<Request>, &OutputRegionsOf<Request>});
}

#define MHC_COMPUTE_METHOD(Name, Request, Response) \
  Make<v1::Request, v1::Response, &v1::Mhc::Stub::Name>(#Name)

const auto& Methods() {
  static const auto* methods = new std::array{
      MHC_COMPUTE_METHOD(Projection, ProjectionRequest, ProjectionResponse),
      MHC_COMPUTE_METHOD(ProjectionBackward, ProjectionBackwardRequest,
                         ProjectionBackwardResponse),
      MHC_COMPUTE_METHOD(Scale, ScaleRequest, ScaleResponse),
      MHC_COMPUTE_METHOD(ScaleBackward, ScaleBackwardRequest,
                         ScaleBackwardResponse),
      MHC_COMPUTE_METHOD(Sinkhorn, SinkhornRequest, SinkhornResponse),
      MHC_COMPUTE_METHOD(SinkhornBackward, SinkhornBackwardRequest,
                         SinkhornBackwardResponse),
      MHC_COMPUTE_METHOD(Aggregate, AggregateRequest, AggregateResponse),
      MHC_COMPUTE_METHOD(AggregateBackward, AggregateBackwardRequest,
                         AggregateBackwardResponse),
      MHC_COMPUTE_METHOD(ExpandCombine, PostRequest, PostResponse),
      MHC_COMPUTE_METHOD(ExpandCombineBackward, PostBackwardRequest,
                         PostBackwardResponse),
      MHC_COMPUTE_METHOD(Pre, PreRequest, PreResponse),
      MHC_COMPUTE_METHOD(PreBackward, PreBackwardRequest, PreBackwardResponse),
      MHC_COMPUTE_METHOD(Post, PostRequest, PostResponse),
      MHC_COMPUTE_METHOD(PostBackward, PostBackwardRequest,
                         PostBackwardResponse),
      MHC_COMPUTE_METHOD(Expand, ExpandRequest, ExpandResponse),
      MHC_COMPUTE_METHOD(ExpandBackward, ExpandBackwardRequest,
                         ExpandBackwardResponse),
      MHC_COMPUTE_METHOD(Head, HeadRequest, HeadResponse),
      MHC_COMPUTE_METHOD(HeadBackward, HeadBackwardRequest,
                         HeadBackwardResponse),
  };
  return *methods;
}

#undef MHC_COMPUTE_METHOD

}  // namespace

ComputeMethod::ComputeMethod(const char* name, const Message* request_prototype,
                             const Message* response_prototype, InvokeFn invoke,
                             CommonFields fields)
    : name_(name),
      request_prototype_(request_prototype),
      response_prototype_(response_prototype),
      invoke_(invoke),
      fields_(fields) {}

absl::Span<const ComputeMethod> ComputeMethod::All() { return Methods(); }

absl::StatusOr<const ComputeMethod*> ComputeMethod::Find(
    absl::string_view name) {
  for (const ComputeMethod& method : All()) {
    if (method.name() == name) return &method;
  }
  return absl::NotFoundError(
      absl::StrCat("no compute method '", name, "' in mhc.v1.Mhc"));
}

absl::Status ComputeMethod::Invoke(v1::Mhc::Stub& stub,
                                   grpc::ClientContext& context,
                                   const Message& request,
                                   Message& response) const {
  if (request.GetDescriptor() != request_prototype_->GetDescriptor() ||
      response.GetDescriptor() != response_prototype_->GetDescriptor()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ": got a ", request.GetTypeName(), " and a ",
                     response.GetTypeName(), ", expected a ",
                     request_prototype_->GetTypeName(), " and a ",
                     response_prototype_->GetTypeName()));
  }
  return FromGrpcStatus(invoke_(stub, context, request, response));
}

}  // namespace mhc::client
