#include "server/service.h"

#include <exception>
#include <map>
#include <new>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "mhc/status.h"
#include "server/determinism_audit.h"
#include "server/status_util.h"

#ifndef MHC_VERSION
#define MHC_VERSION "0.0.0"
#endif

namespace mhc::server {

MhcService::MhcService(const ServiceOptions& options,
                       std::vector<Executor*> executors, LayerStore* store,
                       CheckpointStore* checkpoints, Admission* admission,
                       Metrics* metrics, ShmRegistry* shm,
                       GroupRegistry* groups, const Authorizer* authorizer)
    : options_(options),
      executors_(std::move(executors)),
      store_(store),
      checkpoints_(checkpoints),
      admission_(admission),
      metrics_(metrics),
      shm_(shm),
      groups_(groups),
      authorizer_(authorizer),
      runner_(store, options.limits),
      optimizer_(store, metrics) {
  for (Executor* executor : executors_) {
    metrics_->DeclareOptimizerDevice(executor->device());
  }
}

grpc::Status MhcService::Handle(const grpc::ServerContext& context,
                                absl::string_view rpc, bool admit,
                                absl::FunctionRef<absl::Status()> body) {
  const absl::Time start = absl::Now();
  return ToGrpcStatus(
      Serve(rpc, admit, authorizer_->Authorize(context, rpc), start, body));
}

absl::Status MhcService::Serve(absl::string_view rpc, bool admit,
                               absl::Status authorized, absl::Time start,
                               absl::FunctionRef<absl::Status()> body) {
  absl::Status status = std::move(authorized);
  if (status.ok()) {
    absl::StatusOr<Admission::Ticket> ticket = Admission::Ticket(nullptr);
    if (admit) ticket = admission_->TryEnter();
    if (!ticket.ok()) {
      status = ticket.status();
    } else {
      metrics_->AddInflight(1);
      // Requests are bounded by the size limits, so running out of memory
      // is an answer to this request, never a reason to take the daemon
      // down.
      try {
        status = body();
      } catch (const std::bad_alloc&) {
        status = absl::ResourceExhaustedError(
            absl::StrCat(rpc, ": out of memory while handling the request"));
      } catch (const std::exception& e) {
        status = absl::InternalError(absl::StrCat(rpc, ": ", e.what()));
      }
      metrics_->AddInflight(-1);
    }
  }
  metrics_->RecordRequest(rpc, static_cast<grpc::StatusCode>(status.code()),
                          absl::ToDoubleSeconds(absl::Now() - start));
  return status;
}

void MhcService::UpdateLayerMetrics() {
  struct Totals {
    double layers = 0;
    double parameter_bytes = 0;
    double optimizer_bytes = 0;
  };
  std::map<const Executor*, Totals> per_device;
  for (Executor* executor : executors_) per_device[executor] = {};
  for (const auto& layer : store_->List()) {
    Totals& totals = per_device[layer->executor()];
    ++totals.layers;
    totals.parameter_bytes +=
        static_cast<double>(layer->parameter_count()) * sizeof(float);
    totals.optimizer_bytes +=
        static_cast<double>(layer->optimizer_state_bytes());
  }
  for (const auto& [executor, totals] : per_device) {
    // Every parameter has a gradient accumulator of its size.
    metrics_->SetLayerMemory(executor->device(), totals.layers,
                             totals.parameter_bytes, totals.parameter_bytes);
    metrics_->SetOptimizerStateBytes(executor->device(),
                                     totals.optimizer_bytes);
  }
}

grpc::Status MhcService::RunOp(absl::string_view rpc, OpKind kind,
                               const grpc::ServerContext& context,
                               const google::protobuf::Message& request,
                               google::protobuf::Message* response) {
  return Handle(context, rpc, true, [&] {
    RegionScope regions = Regions(context);
    return runner_.RunSingle(kind, request, response, &regions);
  });
}

grpc::Status MhcService::GetServerInfo(grpc::ServerContext* context,
                                       const v1::GetServerInfoRequest*,
                                       v1::GetServerInfoResponse* response) {
  return Handle(*context, "GetServerInfo", false, [&] {
    response->set_version(MHC_VERSION);
    response->set_backend(executors_.front()->BackendName());
    for (const Executor* executor : executors_) {
      v1::Device* device = response->add_devices();
      device->set_name(executor->device());
      device->set_backend(executor->BackendName());
      device->set_description(executor->Description());
    }
    for (const std::string& preset : PresetNames()) {
      response->add_presets(preset);
    }
    response->add_dtypes(v1::DTYPE_F32);
    response->add_dtypes(v1::DTYPE_F16);
    response->add_dtypes(v1::DTYPE_BF16);
    response->add_layouts(v1::LAYOUT_STREAM_MAJOR);
    response->add_layouts(v1::LAYOUT_STREAM_MINOR);
    v1::Limits* limits = response->mutable_limits();
    limits->set_max_message_bytes(options_.max_message_bytes);
    limits->set_max_tensor_bytes(options_.limits.max_tensor_bytes);
    limits->set_max_request_bytes(options_.limits.max_request_bytes);
    limits->set_max_inflight(options_.max_inflight);
    limits->set_max_streams(kMaxStreams);
    limits->set_max_sinkhorn_iterations(kMaxSinkhornIterations);
    limits->set_max_batch_ops(options_.limits.max_batch_ops);
    limits->set_max_parameter_bytes(options_.limits.max_parameter_bytes);
    limits->set_max_metadata_bytes(kMaxMetadataBytes);
    response->set_draining(admission_->draining());
    return absl::OkStatus();
  });
}

grpc::Status MhcService::GetDeterminismReport(
    grpc::ServerContext* context, const v1::GetDeterminismReportRequest*,
    v1::GetDeterminismReportResponse* response) {
  return Handle(*context, "GetDeterminismReport", false, [&] {
    // One audit serves every device.
    if (executors_.front()->audit() != nullptr) {
      executors_.front()->audit()->FillReport(response);
    }
    return absl::OkStatus();
  });
}

grpc::Status MhcService::CreateLayer(grpc::ServerContext* context,
                                     const v1::CreateLayerRequest* request,
                                     v1::LayerInfo* response) {
  return Handle(*context, "CreateLayer", true, [&]() -> absl::Status {
    MHC_ASSIGN_OR_RETURN(std::shared_ptr<Layer> layer,
                         store_->Create(*request));
    UpdateLayerMetrics();
    store_->FillInfo(*layer, response);
    return absl::OkStatus();
  });
}

grpc::Status MhcService::GetLayer(grpc::ServerContext* context,
                                  const v1::GetLayerRequest* request,
                                  v1::LayerInfo* response) {
  return Handle(*context, "GetLayer", true, [&]() -> absl::Status {
    MHC_ASSIGN_OR_RETURN(std::shared_ptr<Layer> layer,
                         store_->Find(request->name(), "name"));
    store_->FillInfo(*layer, response);
    return absl::OkStatus();
  });
}

grpc::Status MhcService::ListLayers(grpc::ServerContext* context,
                                    const v1::ListLayersRequest*,
                                    v1::ListLayersResponse* response) {
  return Handle(*context, "ListLayers", true, [&] {
    for (const auto& layer : store_->List()) {
      store_->FillInfo(*layer, response->add_layers());
    }
    return absl::OkStatus();
  });
}

grpc::Status MhcService::DeleteLayer(grpc::ServerContext* context,
                                     const v1::DeleteLayerRequest* request,
                                     v1::DeleteLayerResponse*) {
  return Handle(*context, "DeleteLayer", true, [&]() -> absl::Status {
    if (request->name().empty()) {
      return absl::InvalidArgumentError("name: required (a layer name)");
    }
    MHC_RETURN_IF_ERROR(store_->Delete(request->name()));
    UpdateLayerMetrics();
    return absl::OkStatus();
  });
}

grpc::Status MhcService::GetParameters(grpc::ServerContext* context,
                                       const v1::GetParametersRequest* request,
                                       v1::Parameters* response) {
  return Handle(*context, "GetParameters", true, [&]() -> absl::Status {
    MHC_ASSIGN_OR_RETURN(std::shared_ptr<Layer> layer,
                         store_->Find(request->layer(), "layer"));
    return store_->Read(*layer, request->names(), /*gradients=*/false, response)
        .status();
  });
}

grpc::Status MhcService::SetParameters(grpc::ServerContext* context,
                                       const v1::SetParametersRequest* request,
                                       v1::LayerInfo* response) {
  return Handle(*context, "SetParameters", true, [&]() -> absl::Status {
    MHC_ASSIGN_OR_RETURN(std::shared_ptr<Layer> layer,
                         store_->Find(request->layer(), "layer"));
    MHC_RETURN_IF_ERROR(store_->Write(*layer, request->parameters()));
    store_->FillInfo(*layer, response);
    return absl::OkStatus();
  });
}

grpc::Status MhcService::GetGradients(grpc::ServerContext* context,
                                      const v1::GetGradientsRequest* request,
                                      v1::GetGradientsResponse* response) {
  return Handle(*context, "GetGradients", true, [&]() -> absl::Status {
    MHC_ASSIGN_OR_RETURN(std::shared_ptr<Layer> layer,
                         store_->Find(request->layer(), "layer"));
    MHC_ASSIGN_OR_RETURN(
        int64_t tokens,
        store_->Read(*layer, request->names(), /*gradients=*/true,
                     response->mutable_gradients()));
    response->set_gradient_tokens(tokens);
    return absl::OkStatus();
  });
}

grpc::Status MhcService::ZeroGradients(grpc::ServerContext* context,
                                       const v1::ZeroGradientsRequest* request,
                                       v1::ZeroGradientsResponse*) {
  return Handle(*context, "ZeroGradients", true, [&]() -> absl::Status {
    MHC_ASSIGN_OR_RETURN(std::shared_ptr<Layer> layer,
                         store_->Find(request->layer(), "layer"));
    return store_->ZeroGradients(*layer);
  });
}

grpc::Status MhcService::ConvertLayout(grpc::ServerContext* context,
                                       const v1::ConvertLayoutRequest* request,
                                       v1::LayerInfo* response) {
  return Handle(*context, "ConvertLayout", true, [&]() -> absl::Status {
    MHC_ASSIGN_OR_RETURN(
        std::shared_ptr<Layer> layer,
        store_->ConvertLayout(request->layer(), request->layout()));
    store_->FillInfo(*layer, response);
    return absl::OkStatus();
  });
}

grpc::Status MhcService::Execute(grpc::ServerContext* context,
                                 const v1::ExecuteRequest* request,
                                 v1::ExecuteResponse* response) {
  return Handle(*context, "Execute", true, [&] {
    RegionScope regions = Regions(*context);
    return runner_.Execute(*request, response, &regions);
  });
}

OpenStreams::Entry::Entry(OpenStreams* streams, grpc::ServerContext* context)
    : streams_(streams), context_(context) {
  absl::MutexLock lock(&streams_->mu_);
  streams_->idle_[context_] = false;
}

OpenStreams::Entry::~Entry() {
  absl::MutexLock lock(&streams_->mu_);
  streams_->idle_.erase(context_);
}

bool OpenStreams::Entry::Idle() {
  absl::MutexLock lock(&streams_->mu_);
  if (streams_->ending_) return false;
  streams_->idle_[context_] = true;
  return true;
}

bool OpenStreams::Entry::Busy() {
  absl::MutexLock lock(&streams_->mu_);
  streams_->idle_[context_] = false;
  return !streams_->ending_;
}

void OpenStreams::EndAll() {
  absl::MutexLock lock(&mu_);
  ending_ = true;
  // Under the lock: a stream still listed has a live call, and cancelling
  // only wakes its Read.
  for (auto& [context, idle] : idle_) {
    if (idle) context->TryCancel();
  }
}

grpc::Status MhcService::ExecuteStream(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::ExecuteResponse, v1::ExecuteRequest>* stream) {
  // Each batch is admitted and measured on its own: a long-lived stream
  // holds no admission slot between batches. A failed batch ends the
  // stream with its status, since a stream has only one. A drain ends the
  // stream between batches (UNAVAILABLE), never in the middle of one.
  OpenStreams::Entry entry(&streams_, context);
  v1::ExecuteRequest request;
  while (true) {
    if (!entry.Idle()) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "mhcd is draining (shutting down); the stream "
                          "ended after its last batch");
    }
    const bool read = stream->Read(&request);
    if (!entry.Busy()) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "mhcd is draining (shutting down); the stream was "
                          "ended while idle");
    }
    if (!read) break;
    v1::ExecuteResponse response;
    grpc::Status status = Handle(*context, "ExecuteStream", true, [&] {
      RegionScope regions = Regions(*context);
      return runner_.Execute(request, &response, &regions);
    });
    if (!status.ok()) return status;
    if (!stream->Write(response)) {
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          "the client closed the stream");
    }
  }
  return grpc::Status::OK;
}

}  // namespace mhc::server
