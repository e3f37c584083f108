#include "fuzz/rpc_table.h"

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "fuzz/call_sequence.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/server_context.h"

namespace mhc::fuzz {
namespace {

using server::MhcService;

template <typename Request, typename Response>
using Handler = grpc::Status (MhcService::*)(grpc::ServerContext*,
                                             const Request*, Response*);

struct Rpc {
  const google::protobuf::Descriptor* request_type;
  RpcInvoker invoke;
};

template <typename Request, typename Response>
Rpc Unary(const char* name, Handler<Request, Response> handler) {
  return {Request::descriptor(),
          [name, handler](MhcService& service, absl::string_view bytes) {
            Request request;
            if (!request.ParseFromArray(bytes.data(),
                                        static_cast<int>(bytes.size()))) {
              return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                  "the request does not parse");
            }
            Response response;
            grpc::ServerContext context;
            grpc::Status status =
                (service.*handler)(&context, &request, &response);
            AbortOnDaemonBug(name, status);
            // What gRPC would do with the answer.
            response.SerializeAsString();
            return status;
          }};
}

#define MHC_FUZZ_RPC(Name) \
  { #Name, Unary(#Name, &MhcService::Name) }

std::map<std::string, Rpc> UnaryRpcs() {
  return {
      MHC_FUZZ_RPC(GetServerInfo),
      MHC_FUZZ_RPC(GetDeterminismReport),
      MHC_FUZZ_RPC(CreateLayer),
      MHC_FUZZ_RPC(GetLayer),
      MHC_FUZZ_RPC(ListLayers),
      MHC_FUZZ_RPC(DeleteLayer),
      MHC_FUZZ_RPC(GetParameters),
      MHC_FUZZ_RPC(SetParameters),
      MHC_FUZZ_RPC(GetGradients),
      MHC_FUZZ_RPC(ZeroGradients),
      MHC_FUZZ_RPC(ConvertLayout),
      MHC_FUZZ_RPC(MapLayerMemory),
      MHC_FUZZ_RPC(OptimizerStep),
      MHC_FUZZ_RPC(SaveCheckpoint),
      MHC_FUZZ_RPC(LoadCheckpoint),
      MHC_FUZZ_RPC(ListCheckpoints),
      MHC_FUZZ_RPC(Projection),
      MHC_FUZZ_RPC(ProjectionBackward),
      MHC_FUZZ_RPC(Scale),
      MHC_FUZZ_RPC(ScaleBackward),
      MHC_FUZZ_RPC(Sinkhorn),
      MHC_FUZZ_RPC(SinkhornBackward),
      MHC_FUZZ_RPC(Aggregate),
      MHC_FUZZ_RPC(AggregateBackward),
      MHC_FUZZ_RPC(ExpandCombine),
      MHC_FUZZ_RPC(ExpandCombineBackward),
      MHC_FUZZ_RPC(Pre),
      MHC_FUZZ_RPC(PreBackward),
      MHC_FUZZ_RPC(Post),
      MHC_FUZZ_RPC(PostBackward),
      MHC_FUZZ_RPC(Expand),
      MHC_FUZZ_RPC(ExpandBackward),
      MHC_FUZZ_RPC(Head),
      MHC_FUZZ_RPC(HeadBackward),
      MHC_FUZZ_RPC(Execute),
      MHC_FUZZ_RPC(RegisterSystemSharedMemory),
      MHC_FUZZ_RPC(RegisterCudaSharedMemory),
      MHC_FUZZ_RPC(UnregisterSharedMemory),
      MHC_FUZZ_RPC(SharedMemoryStatus),
      MHC_FUZZ_RPC(RegisterCudaEvents),
      MHC_FUZZ_RPC(OpenCallRing),
      MHC_FUZZ_RPC(CreateGroup),
      MHC_FUZZ_RPC(JoinGroup),
      MHC_FUZZ_RPC(GetGroup),
      MHC_FUZZ_RPC(AllReduceGradients),
      MHC_FUZZ_RPC(BroadcastParameters),
      MHC_FUZZ_RPC(LeaveGroup),
  };
}

#undef MHC_FUZZ_RPC

// Client-streaming RPCs: the request holds the pieces (EncodeStream), read
// one by one as from gRPC.
std::map<std::string, Rpc> ClientStreamRpcs() {
  Rpc set_parameters{v1::ParameterChunk::descriptor(),
                     [](MhcService& service, absl::string_view bytes) {
                       std::vector<std::string> pieces;
                       if (!SplitStream(bytes, &pieces)) {
                         return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                             "the pieces do not split");
                       }
                       size_t next = 0;
                       auto read = [&](v1::ParameterChunk* chunk) {
                         while (next < pieces.size()) {
                           // A piece that does not parse is skipped, as gRPC
                           // would never deliver it.
                           if (chunk->ParseFromString(pieces[next++]))
                             return true;
                         }
                         return false;
                       };
                       v1::LayerInfo response;
                       grpc::ServerContext context;
                       grpc::Status status = service.SetParametersFromPieces(
                           context, read, &response);
                       AbortOnDaemonBug("SetParametersStream", status);
                       response.SerializeAsString();
                       return status;
                     }};
  return {{"SetParametersStream", set_parameters}};
}

[[noreturn]] void TableIsStale(const std::string& message) {
  std::fprintf(stderr, "fuzz/rpc_table.cc is out of date: %s\n",
               message.c_str());
  std::abort();
}

const google::protobuf::ServiceDescriptor& MhcDescriptor() {
  static const google::protobuf::ServiceDescriptor* descriptor =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          "mhc.v1.Mhc");
  if (descriptor == nullptr) TableIsStale("no service mhc.v1.Mhc");
  return *descriptor;
}

// Invokers by method index. Every unary method of the service must have
// one, of its request type, so that an RPC added to service.proto cannot
// escape the harness unnoticed.
std::vector<const RpcInvoker*> BuildIndex() {
  static const std::map<std::string, Rpc>* unary =
      new std::map<std::string, Rpc>(UnaryRpcs());
  static const std::map<std::string, Rpc>* client_streams =
      new std::map<std::string, Rpc>(ClientStreamRpcs());
  const google::protobuf::ServiceDescriptor& service = MhcDescriptor();
  std::vector<const RpcInvoker*> index(service.method_count(), nullptr);
  int covered = 0;
  for (int i = 0; i < service.method_count(); ++i) {
    const google::protobuf::MethodDescriptor& method = *service.method(i);
    // Streams with answers in pieces repeat unary RPCs (StreamParameters
    // is GetParameters, ExecuteStream runs Execute per batch) or carry no
    // content (OpenSession); client streams have invokers of their own.
    const std::map<std::string, Rpc>* rpcs =
        method.client_streaming() && !method.server_streaming() ? client_streams
                                                                : unary;
    auto it = rpcs->find(method.name());
    if (method.server_streaming()) {
      if (it != rpcs->end()) TableIsStale(method.name() + " is streaming");
      continue;
    }
    if (it == rpcs->end()) TableIsStale("no invoker for " + method.name());
    if (it->second.request_type != method.input_type()) {
      TableIsStale(method.name() + " takes " +
                   method.input_type()->full_name());
    }
    index[i] = &it->second.invoke;
    ++covered;
  }
  if (covered != static_cast<int>(unary->size() + client_streams->size())) {
    TableIsStale("invokers for methods the service does not have");
  }
  return index;
}

const std::vector<const RpcInvoker*>& Index() {
  static const std::vector<const RpcInvoker*>* index =
      new std::vector<const RpcInvoker*>(BuildIndex());
  return *index;
}

}  // namespace

void AbortOnDaemonBug(absl::string_view rpc, const grpc::Status& status) {
  if (status.error_code() == grpc::StatusCode::INTERNAL ||
      status.error_code() == grpc::StatusCode::UNKNOWN) {
    std::fprintf(stderr, "%.*s answered %s: %s\n", static_cast<int>(rpc.size()),
                 rpc.data(),
                 status.error_code() == grpc::StatusCode::INTERNAL ? "INTERNAL"
                                                                   : "UNKNOWN",
                 status.error_message().c_str());
    std::abort();
  }
}

const RpcInvoker* FindRpc(int index) {
  if (index < 0 || index >= static_cast<int>(Index().size())) return nullptr;
  return Index()[index];
}

int RpcCount() { return static_cast<int>(Index().size()); }

int RpcIndex(absl::string_view name) {
  const google::protobuf::MethodDescriptor* method =
      MhcDescriptor().FindMethodByName(std::string(name));
  return method == nullptr ? -1 : method->index();
}

}  // namespace mhc::fuzz
