// mhc::client::ComputeMethod: a compute RPC of the Mhc service chosen at run
// time by name, for callers that do not know the operator when compiled
// (the Python client's native call path). It makes the method's messages
// and sends them through Client::Compute.
#ifndef MHC_CLIENT_COMPUTE_METHOD_H_
#define MHC_CLIENT_COMPUTE_METHOD_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "google/protobuf/arena.h"
#include "google/protobuf/map.h"
#include "google/protobuf/message.h"
#include "grpcpp/grpcpp.h"
#include "mhc/v1/service.grpc.pb.h"

namespace mhc::client {

class ComputeMethod {
 public:
  using OutputRegions = google::protobuf::Map<std::string, v1::SharedMemoryRef>;

  // The compute RPC named `name` ("Pre", "PostBackward", "ExpandCombine",
  // ...); NOT_FOUND for any other method of the service.
  static absl::StatusOr<const ComputeMethod*> Find(absl::string_view name);
  // Every compute RPC, in a fixed order (indices stay valid for the life of
  // the process).
  static absl::Span<const ComputeMethod> All();

  absl::string_view name() const { return name_; }
  const google::protobuf::Descriptor* request_type() const {
    return request_prototype_->GetDescriptor();
  }

  // Messages of this method on `arena` (owned by it).
  google::protobuf::Message* NewRequest(google::protobuf::Arena* arena) const {
    return request_prototype_->New(arena);
  }
  google::protobuf::Message* NewResponse(google::protobuf::Arena* arena) const {
    return response_prototype_->New(arena);
  }
  // The request's fields that every compute request has; `request` must be
  // this method's (made by NewRequest).
  std::string* MutableLayer(google::protobuf::Message& request) const {
    return fields_.layer(request);
  }
  OutputRegions* MutableOutputRegions(
      google::protobuf::Message& request) const {
    return fields_.output_regions(request);
  }

  // Sends `request` with a prepared context (see Client::Compute);
  // INVALID_ARGUMENT when the messages are not this method's.
  absl::Status Invoke(v1::Mhc::Stub& stub, grpc::ClientContext& context,
                      const google::protobuf::Message& request,
                      google::protobuf::Message& response) const;

  using InvokeFn = grpc::Status (*)(v1::Mhc::Stub&, grpc::ClientContext&,
                                    const google::protobuf::Message&,
                                    google::protobuf::Message&);
  struct CommonFields {
    std::string* (*layer)(google::protobuf::Message&);
    OutputRegions* (*output_regions)(google::protobuf::Message&);
  };
  ComputeMethod(const char* name,
                const google::protobuf::Message* request_prototype,
                const google::protobuf::Message* response_prototype,
                InvokeFn invoke, CommonFields fields);

 private:
  const char* name_;
  const google::protobuf::Message* request_prototype_;
  const google::protobuf::Message* response_prototype_;
  InvokeFn invoke_;
  CommonFields fields_;
};

}  // namespace mhc::client

#endif  // MHC_CLIENT_COMPUTE_METHOD_H_
