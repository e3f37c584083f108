// The CUDA Backend: device selection, memory, synchronous copies on the op
// stream and overlapped ones on the copy streams, exact workspace sizes and
// the op dispatch to the launchers.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "common.cuh"
#include "cuda_backend.h"
#include "fault_injection.h"
#include "launch.h"
#include "mhc/cuda.h"
#include "mhc/status.h"

namespace mhc {
namespace cuda {
namespace {

// The scale backward's counter, then the projection backward's.
constexpr int kArrivals = 1 + proj::kSplitArrivals;

}  // namespace

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(int device) {
  const int count = CudaDeviceCount();
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda backend: device ", device, " not available (", count,
                     " CUDA devices)"));
  }
  const std::string what = absl::StrCat("device ", device);
  MHC_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "create backend", what);
  cudaDeviceProp prop;
  MHC_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device),
                           "create backend", what);
  // Owned from here on, so the destructor releases whatever was created.
  std::unique_ptr<CudaBackend> backend(
      new CudaBackend(device, absl::StrCat(prop.name, " (", device, ")")));
  MHC_RETURN_IF_ERROR(backend->CreateResources());
  return backend;
}

absl::Status CudaBackend::CreateResources() {
  const std::string what = absl::StrCat("device ", device_);
  for (cudaStream_t* stream : {&stream_, &upload_stream_, &download_stream_}) {
    MHC_CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking),
        "create backend", what);
  }
  MHC_CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&ops_done_, cudaEventDisableTiming),
      "create backend", what);
  MHC_CUDA_RETURN_IF_ERROR(cudaMalloc(&arrivals_, sizeof(unsigned) * kArrivals),
                           "create backend", what);
  MHC_CUDA_RETURN_IF_ERROR(
      cudaMemset(arrivals_, 0, sizeof(unsigned) * kArrivals), "create backend",
      what);
  MHC_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "create backend", what);
  return absl::OkStatus();
}

CudaBackend::~CudaBackend() {
  if (cudaSetDevice(device_) != cudaSuccess) return;
  for (cudaStream_t stream : {stream_, upload_stream_, download_stream_}) {
    if (stream == nullptr) continue;
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
  }
  if (ops_done_ != nullptr) cudaEventDestroy(ops_done_);
  if (arrivals_ != nullptr) cudaFree(arrivals_);
  for (cudaEvent_t event : upload_events_) cudaEventDestroy(event);
}

absl::Status CudaBackend::Activate(const char* what) const {
  MHC_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), what,
                           absl::StrCat("device ", device_));
  return absl::OkStatus();
}

absl::Status CudaBackend::InjectedFault(const char* what) {
  const cudaError_t error = BreakContext(stream_);
  return absl::InternalError(absl::StrCat(
      "cuda ", what, " device ", device_,
      ": injected fault (--fault_injection): ", cudaGetErrorName(error), " (",
      cudaGetErrorString(error), ")"));
}

absl::StatusOr<void*> CudaBackend::Allocate(size_t bytes) {
  MHC_RETURN_IF_ERROR(Activate("allocate"));
  if (bytes == 0) return nullptr;
  void* pointer = nullptr;
  const bool injected = InjectFault(FaultSite::kAlloc);
  const cudaError_t error =
      injected ? cudaErrorMemoryAllocation : cudaMalloc(&pointer, bytes);
  if (error != cudaSuccess) {
    cudaGetLastError();  // cudaMalloc failures are not sticky; clear them
    return absl::ResourceExhaustedError(
        absl::StrCat("cuda allocate ", bytes, " bytes on device ", device_,
                     ": ", cudaGetErrorString(error),
                     injected ? " (injected by --fault_injection)" : ""));
  }
  return pointer;
}

void CudaBackend::Free(void* pointer) {
  if (pointer == nullptr) return;
  if (cudaSetDevice(device_) != cudaSuccess) return;
  // Pending work may still read the buffer, copies included. A failure
  // here is reported by the next call that returns a status.
  for (cudaStream_t stream : {stream_, upload_stream_, download_stream_}) {
    cudaStreamSynchronize(stream);
  }
  cudaFree(pointer);
}

absl::Status CudaBackend::CopyToDevice(void* dst, const void* host_src,
                                       size_t bytes) {
  MHC_RETURN_IF_ERROR(Activate("copy to device"));
  if (bytes == 0) return absl::OkStatus();
  if (InjectFault(FaultSite::kCopy)) return InjectedFault("copy to device");
  const std::string what = absl::StrCat(bytes, " bytes");
  MHC_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_),
      "copy to device", what);
  // The host buffer may be reused as soon as we return.
  MHC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "copy to device",
                           what);
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyToHost(void* host_dst, const void* src,
                                     size_t bytes) {
  MHC_RETURN_IF_ERROR(Activate("copy to host"));
  if (bytes == 0) return absl::OkStatus();
  if (InjectFault(FaultSite::kCopy)) return InjectedFault("copy to host");
  const std::string what = absl::StrCat(bytes, " bytes");
  MHC_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_),
      "copy to host", what);
  MHC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "copy to host",
                           what);
  return absl::OkStatus();
}

absl::Status CudaBackend::Memset(void* dst, int value, size_t bytes) {
  MHC_RETURN_IF_ERROR(Activate("memset"));
  if (bytes == 0) return absl::OkStatus();
  MHC_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst, value, bytes, stream_),
                           "memset", absl::StrCat(bytes, " bytes"));
  return absl::OkStatus();
}

absl::Status CudaBackend::SynchronizeStreams(const char* what) {
  MHC_RETURN_IF_ERROR(Activate(what));
  const std::string device = absl::StrCat("device ", device_);
  MHC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(upload_stream_), what, device);
  MHC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), what, device);
  MHC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(download_stream_), what,
                           device);
  // Every upload is complete: tickets issued so far need no waiting, and
  // their events may be recorded again.
  first_pending_upload_ = next_upload_;
  return absl::OkStatus();
}

absl::Status CudaBackend::Synchronize() {
  return SynchronizeStreams("synchronize");
}

absl::Status CudaBackend::WaitForEvent(DeviceEvent event) {
  MHC_RETURN_IF_ERROR(Activate("wait for event"));
  // Uploads read host memory only; the ops and the downloads behind them
  // are what must follow the other process's work.
  MHC_CUDA_RETURN_IF_ERROR(
      cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(event), 0),
      "wait for event", absl::StrCat("device ", device_));
  return absl::OkStatus();
}

absl::Status CudaBackend::JoinDownloads(const char* op) {
  const std::string what = absl::StrCat("device ", device_);
  // Downloads run on their own stream: what follows the work must follow
  // them too.
  MHC_CUDA_RETURN_IF_ERROR(cudaEventRecord(ops_done_, download_stream_), op,
                           what);
  MHC_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, ops_done_, 0), op,
                           what);
  return absl::OkStatus();
}

absl::Status CudaBackend::RecordEvent(DeviceEvent event) {
  MHC_RETURN_IF_ERROR(Activate("record event"));
  MHC_RETURN_IF_ERROR(JoinDownloads("record event"));
  MHC_CUDA_RETURN_IF_ERROR(
      cudaEventRecord(static_cast<cudaEvent_t>(event), stream_), "record event",
      absl::StrCat("device ", device_));
  return absl::OkStatus();
}

absl::Status CudaBackend::WriteWordAfterWork(void* word, uint32_t value) {
  // Looked up once; null when the driver has no such entry point.
  static const PFN_cuStreamWriteValue32_v11070 write_value = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &function,
                                         12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return PFN_cuStreamWriteValue32_v11070{nullptr};
    }
    return reinterpret_cast<PFN_cuStreamWriteValue32_v11070>(function);
  }();
  if (write_value == nullptr) {
    return absl::UnavailableError(
        "the CUDA driver has no cuStreamWriteValue32 entry point");
  }
  MHC_RETURN_IF_ERROR(Activate("write word"));
  MHC_RETURN_IF_ERROR(JoinDownloads("write word"));
  // The default flags order the write after the stream's earlier writes.
  const CUresult result =
      write_value(reinterpret_cast<CUstream>(stream_),
                  reinterpret_cast<CUdeviceptr>(word), value, 0);
  if (result != CUDA_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("CUDA: cuStreamWriteValue32 on device ", device_,
                     " failed (", result, ")"));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::CheckDevice() {
  MHC_RETURN_IF_ERROR(Activate("check device"));
  const cudaError_t error = cudaStreamQuery(stream_);
  if (error == cudaSuccess || error == cudaErrorNotReady) {
    return absl::OkStatus();
  }
  return absl::InternalError(absl::StrCat(
      "device ", device_, ": earlier work failed: ", cudaGetErrorName(error),
      " (", cudaGetErrorString(error), ")"));
}

absl::StatusOr<Backend::ExportedMemory> CudaBackend::ExportMemory(
    void* pointer) {
  MHC_RETURN_IF_ERROR(Activate("export memory"));
  MHC_ASSIGN_OR_RETURN(CudaAllocation allocation, FindCudaAllocation(pointer));
  cudaIpcMemHandle_t handle;
  MHC_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&handle, allocation.base),
                           "export memory", absl::StrCat("device ", device_));
  ExportedMemory exported;
  exported.handle.assign(reinterpret_cast<const char*>(&handle),
                         sizeof(handle));
  exported.offset =
      static_cast<uint64_t>(static_cast<char*>(pointer) - allocation.base);
  exported.bytes = allocation.bytes;
  return exported;
}

absl::StatusOr<CopyTicket> CudaBackend::CopyToDeviceAsync(void* dst,
                                                          const void* host_src,
                                                          size_t bytes) {
  MHC_RETURN_IF_ERROR(Activate("copy to device async"));
  if (bytes == 0) return kNoCopy;
  if (InjectFault(FaultSite::kCopy)) {
    return InjectedFault("copy to device async");
  }
  const std::string what = absl::StrCat(bytes, " bytes");
  const size_t index =
      static_cast<size_t>(next_upload_ - first_pending_upload_);
  if (index == upload_events_.size()) {
    cudaEvent_t event = nullptr;
    MHC_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
        "copy to device async", what);
    upload_events_.push_back(event);
  }
  MHC_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice,
                      upload_stream_),
      "copy to device async", what);
  MHC_CUDA_RETURN_IF_ERROR(
      cudaEventRecord(upload_events_[index], upload_stream_),
      "copy to device async", what);
  return next_upload_++;
}

absl::Status CudaBackend::OpsWaitForCopy(CopyTicket ticket) {
  if (ticket < first_pending_upload_) return absl::OkStatus();  // complete
  if (ticket >= next_upload_) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda wait for copy: ticket ", ticket,
                     " was never issued (next is ", next_upload_, ")"));
  }
  MHC_RETURN_IF_ERROR(Activate("wait for copy"));
  // The stream waits for the event as recorded now; recording it again
  // later (after a synchronization) does not affect this wait.
  MHC_CUDA_RETURN_IF_ERROR(
      cudaStreamWaitEvent(
          stream_,
          upload_events_[static_cast<size_t>(ticket - first_pending_upload_)],
          0),
      "wait for copy", absl::StrCat("ticket ", ticket));
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyToHostAsync(void* host_dst, const void* src,
                                          size_t bytes) {
  MHC_RETURN_IF_ERROR(Activate("copy to host async"));
  if (bytes == 0) return absl::OkStatus();
  if (InjectFault(FaultSite::kCopy)) return InjectedFault("copy to host async");
  const std::string what = absl::StrCat(bytes, " bytes");
  MHC_CUDA_RETURN_IF_ERROR(cudaEventRecord(ops_done_, stream_),
                           "copy to host async", what);
  MHC_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(download_stream_, ops_done_, 0),
                           "copy to host async", what);
  MHC_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost,
                      download_stream_),
      "copy to host async", what);
  return absl::OkStatus();
}

absl::string_view CudaBackend::KernelVariant(
    const ProjectionForwardParams& p) const {
  return ToString(PlanOf(p).variant);
}

absl::string_view CudaBackend::KernelVariant(
    const ProjectionBackwardParams& p) const {
  return ToString(PlanOf(p).variant);
}

absl::string_view CudaBackend::KernelVariant(
    const ScaleForwardParams& p) const {
  return ToString(PlanOf(p).variant);
}

absl::string_view CudaBackend::KernelVariant(
    const ScaleBackwardParams& p) const {
  return ToString(PlanOf(p).variant);
}

absl::string_view CudaBackend::KernelVariant(
    const SinkhornForwardParams& p) const {
  return ToString(PlanOf(p).variant);
}

absl::string_view CudaBackend::KernelVariant(
    const SinkhornBackwardParams& p) const {
  return ToString(PlanOf(p).variant);
}

absl::string_view CudaBackend::KernelVariant(const PostForwardParams& p) const {
  return ToString(PlanOf(p).variant);
}

absl::string_view CudaBackend::KernelVariant(
    const PostBackwardParams& p) const {
  return ToString(PlanOf(p).variant);
}

absl::string_view CudaBackend::KernelVariant(
    const AggregateForwardParams& p) const {
  return ToString(PlanOf(p).access);
}

absl::string_view CudaBackend::KernelVariant(
    const AggregateBackwardParams& p) const {
  return ToString(PlanOf(p).access);
}

absl::string_view CudaBackend::KernelVariant(
    const ExpandForwardParams& p) const {
  return ToString(PlanOf(p).access);
}

absl::string_view CudaBackend::KernelVariant(
    const ExpandBackwardParams& p) const {
  return ToString(PlanOf(p).access);
}

absl::string_view CudaBackend::KernelVariant(const PreForwardParams& p) const {
  return ToString(PlanFusedForward(*p.spec).variant);
}

absl::string_view CudaBackend::KernelVariant(const PreBackwardParams& p) const {
  return ToString(PlanFusedBackward(*p.spec).variant);
}

absl::string_view CudaBackend::KernelVariant(const HeadForwardParams& p) const {
  return ToString(PlanFusedForward(*p.spec).variant);
}

absl::string_view CudaBackend::KernelVariant(
    const HeadBackwardParams& p) const {
  return ToString(PlanFusedBackward(*p.spec).variant);
}

size_t CudaBackend::WorkspaceBytes(OpKind op, const LayerSpec& spec,
                                   int64_t tokens, DType act_dtype) const {
  if (tokens <= 0) return 0;
  switch (op) {
    case OpKind::kProjectionForward:
      return ProjectionForwardWorkspace(spec, tokens, act_dtype);
    case OpKind::kPreForward:
    case OpKind::kHeadForward:
      return FusedForwardWorkspace(spec, tokens, act_dtype);
    case OpKind::kProjectionBackward:
      return ProjectionBackwardWorkspace(spec, tokens, act_dtype);
    case OpKind::kScaleBackward:
      return ScaleBackwardWorkspace(spec, tokens);
    case OpKind::kPostBackward:
      return PostBackwardWorkspace(spec, tokens);
    case OpKind::kPreBackward:
    case OpKind::kHeadBackward:
      return FusedBackwardWorkspace(spec, tokens, act_dtype);
    default:
      return 0;
  }
}

// Every op the backend runs passes here: the launch fault site.
#define MHC_CUDA_RUN_(launch)                                             \
  MHC_RETURN_IF_ERROR(Activate("op"));                                    \
  if (InjectFault(FaultSite::kLaunch)) return InjectedFault("op launch"); \
  return launch

absl::Status CudaBackend::RunProjectionForward(const ProjectionForwardParams& p,
                                               Workspace ws) {
  MHC_CUDA_RUN_(LaunchProjectionForward(p, ws, stream_));
}
absl::Status CudaBackend::RunProjectionBackward(
    const ProjectionBackwardParams& p, Workspace ws) {
  MHC_CUDA_RUN_(LaunchProjectionBackward(p, ws, arrivals_ + 1, stream_));
}
absl::Status CudaBackend::RunScaleForward(const ScaleForwardParams& p,
                                          Workspace) {
  MHC_CUDA_RUN_(LaunchScaleForward(p, stream_));
}
absl::Status CudaBackend::RunScaleBackward(const ScaleBackwardParams& p,
                                           Workspace ws) {
  MHC_CUDA_RUN_(LaunchScaleBackward(p, ws, arrivals_, stream_));
}
absl::Status CudaBackend::RunSinkhornForward(const SinkhornForwardParams& p,
                                             Workspace) {
  MHC_CUDA_RUN_(LaunchSinkhornForward(p, stream_));
}
absl::Status CudaBackend::RunSinkhornBackward(const SinkhornBackwardParams& p,
                                              Workspace) {
  MHC_CUDA_RUN_(LaunchSinkhornBackward(p, stream_));
}
absl::Status CudaBackend::RunAggregateForward(const AggregateForwardParams& p,
                                              Workspace) {
  MHC_CUDA_RUN_(LaunchAggregateForward(p, stream_));
}
absl::Status CudaBackend::RunAggregateBackward(const AggregateBackwardParams& p,
                                               Workspace) {
  MHC_CUDA_RUN_(LaunchAggregateBackward(p, stream_));
}
absl::Status CudaBackend::RunPostForward(const PostForwardParams& p,
                                         Workspace) {
  MHC_CUDA_RUN_(LaunchPostForward(p, stream_));
}
absl::Status CudaBackend::RunPostBackward(const PostBackwardParams& p,
                                          Workspace ws) {
  MHC_CUDA_RUN_(LaunchPostBackward(p, ws, stream_));
}
absl::Status CudaBackend::RunExpandForward(const ExpandForwardParams& p,
                                           Workspace) {
  MHC_CUDA_RUN_(LaunchExpandForward(p, stream_));
}
absl::Status CudaBackend::RunExpandBackward(const ExpandBackwardParams& p,
                                            Workspace) {
  MHC_CUDA_RUN_(LaunchExpandBackward(p, stream_));
}
absl::Status CudaBackend::RunPreForward(const PreForwardParams& p,
                                        Workspace ws) {
  MHC_CUDA_RUN_(LaunchPreForward(p, ws, stream_));
}
absl::Status CudaBackend::RunPreBackward(const PreBackwardParams& p,
                                         Workspace ws) {
  MHC_CUDA_RUN_(LaunchPreBackward(p, ws, stream_));
}
absl::Status CudaBackend::RunHeadForward(const HeadForwardParams& p,
                                         Workspace ws) {
  MHC_CUDA_RUN_(LaunchHeadForward(p, ws, stream_));
}
absl::Status CudaBackend::RunHeadBackward(const HeadBackwardParams& p,
                                          Workspace ws) {
  MHC_CUDA_RUN_(LaunchHeadBackward(p, ws, stream_));
}
absl::Status CudaBackend::RunOptimizerStep(const OptimizerStepParams& p,
                                           Workspace ws) {
  MHC_CUDA_RUN_(LaunchOptimizerStep(p, ws, stream_));
}

#undef MHC_CUDA_RUN_

}  // namespace cuda

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver / no device: not an error for callers
    return 0;
  }
  return count;
}

absl::StatusOr<CudaAllocation> FindCudaAllocation(const void* pointer) {
  // Looked up once; null when the driver has no such entry point.
  static const PFN_cuMemGetAddressRange_v3020 address_range = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &function,
                                         12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return PFN_cuMemGetAddressRange_v3020{nullptr};
    }
    return reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(function);
  }();
  if (address_range == nullptr) {
    return absl::UnavailableError(
        "the CUDA driver has no cuMemGetAddressRange entry point");
  }
  CUdeviceptr base = 0;
  size_t bytes = 0;
  if (address_range(&base, &bytes, reinterpret_cast<CUdeviceptr>(pointer)) !=
      CUDA_SUCCESS) {
    return absl::NotFoundError(
        "the pointer is not in a device allocation of this process");
  }
  return CudaAllocation{reinterpret_cast<char*>(base), bytes};
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device) {
  MHC_ASSIGN_OR_RETURN(std::unique_ptr<cuda::CudaBackend> backend,
                       cuda::CudaBackend::Create(device));
  return std::unique_ptr<Backend>(std::move(backend));
}

absl::StatusOr<void*> CudaOpStream(Backend& cuda_backend) {
  auto* cuda = dynamic_cast<cuda::CudaBackend*>(&cuda_backend);
  if (cuda == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("not a CUDA backend: ", cuda_backend.Name()));
  }
  return static_cast<void*>(cuda->stream());
}

}  // namespace mhc
