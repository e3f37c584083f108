// mhc::Backend on one CUDA device: memory, copies and every op on the
// backend's own stream. Ops never allocate: scratch comes from the caller's
// Workspace, sized exactly by WorkspaceBytes.
//
// Overlapped copies run on two more streams, one per direction, because
// host-to-device and device-to-host copies use separate copy engines: an
// upload queued behind a download that waits for an op would wait for that
// op too. Events order them with the op stream: each upload records one
// (OpsWaitForCopy makes the op stream wait for it), and each download first
// waits for an event recorded on the op stream.
#ifndef MHC_KERNELS_CUDA_CUDA_BACKEND_H_
#define MHC_KERNELS_CUDA_CUDA_BACKEND_H_

#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "fault_injection.h"
#include "mhc/backend.h"

namespace mhc::cuda {

class CudaBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(int device);
  ~CudaBackend() override;

  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string Name() const override { return "cuda"; }
  std::string DeviceDescription() const override { return description_; }
  bool HostAccessible() const override { return false; }

  absl::StatusOr<void*> Allocate(size_t bytes) override;
  void Free(void* pointer) override;
  absl::Status CopyToDevice(void* dst, const void* host_src,
                            size_t bytes) override;
  absl::Status CopyToHost(void* host_dst, const void* src,
                          size_t bytes) override;
  absl::Status Memset(void* dst, int value, size_t bytes) override;
  absl::Status Synchronize() override;
  absl::StatusOr<CopyTicket> CopyToDeviceAsync(void* dst, const void* host_src,
                                               size_t bytes) override;
  absl::Status OpsWaitForCopy(CopyTicket ticket) override;
  absl::Status CopyToHostAsync(void* host_dst, const void* src,
                               size_t bytes) override;
  // CUDA events on this backend's stream (event_timer.cu).
  std::unique_ptr<DeviceTimer> MakeDeviceTimer() override;
  absl::Status WaitForEvent(DeviceEvent event) override;
  absl::Status RecordEvent(DeviceEvent event) override;
  absl::Status WriteWordAfterWork(void* word, uint32_t value) override;
  absl::Status CheckDevice() override;
  absl::StatusOr<ExportedMemory> ExportMemory(void* pointer) override;
  // The variant of the op family's plan (projection/plan.h, plans/).
  absl::string_view KernelVariant(
      const ProjectionForwardParams& p) const override;
  absl::string_view KernelVariant(
      const ProjectionBackwardParams& p) const override;
  absl::string_view KernelVariant(const ScaleForwardParams& p) const override;
  absl::string_view KernelVariant(const ScaleBackwardParams& p) const override;
  absl::string_view KernelVariant(
      const SinkhornForwardParams& p) const override;
  absl::string_view KernelVariant(
      const SinkhornBackwardParams& p) const override;
  absl::string_view KernelVariant(
      const AggregateForwardParams& p) const override;
  absl::string_view KernelVariant(
      const AggregateBackwardParams& p) const override;
  absl::string_view KernelVariant(const PostForwardParams& p) const override;
  absl::string_view KernelVariant(const PostBackwardParams& p) const override;
  absl::string_view KernelVariant(const ExpandForwardParams& p) const override;
  absl::string_view KernelVariant(const ExpandBackwardParams& p) const override;
  absl::string_view KernelVariant(const PreForwardParams& p) const override;
  absl::string_view KernelVariant(const PreBackwardParams& p) const override;
  absl::string_view KernelVariant(const HeadForwardParams& p) const override;
  absl::string_view KernelVariant(const HeadBackwardParams& p) const override;
  size_t WorkspaceBytes(OpKind op, const LayerSpec& spec, int64_t tokens,
                        DType act_dtype) const override;

  cudaStream_t stream() const { return stream_; }

 protected:
  absl::Status RunProjectionForward(const ProjectionForwardParams& p,
                                    Workspace ws) override;
  absl::Status RunProjectionBackward(const ProjectionBackwardParams& p,
                                     Workspace ws) override;
  absl::Status RunScaleForward(const ScaleForwardParams& p,
                               Workspace ws) override;
  absl::Status RunScaleBackward(const ScaleBackwardParams& p,
                                Workspace ws) override;
  absl::Status RunSinkhornForward(const SinkhornForwardParams& p,
                                  Workspace ws) override;
  absl::Status RunSinkhornBackward(const SinkhornBackwardParams& p,
                                   Workspace ws) override;
  absl::Status RunAggregateForward(const AggregateForwardParams& p,
                                   Workspace ws) override;
  absl::Status RunAggregateBackward(const AggregateBackwardParams& p,
                                    Workspace ws) override;
  absl::Status RunPostForward(const PostForwardParams& p,
                              Workspace ws) override;
  absl::Status RunPostBackward(const PostBackwardParams& p,
                               Workspace ws) override;
  absl::Status RunExpandForward(const ExpandForwardParams& p,
                                Workspace ws) override;
  absl::Status RunExpandBackward(const ExpandBackwardParams& p,
                                 Workspace ws) override;
  absl::Status RunPreForward(const PreForwardParams& p, Workspace ws) override;
  absl::Status RunPreBackward(const PreBackwardParams& p,
                              Workspace ws) override;
  absl::Status RunHeadForward(const HeadForwardParams& p,
                              Workspace ws) override;
  absl::Status RunHeadBackward(const HeadBackwardParams& p,
                               Workspace ws) override;
  absl::Status RunOptimizerStep(const OptimizerStepParams& p,
                                Workspace ws) override;

 private:
  CudaBackend(int device, std::string description)
      : device_(device), description_(std::move(description)) {}

  // The streams, the download event and the arrival counter; the device is
  // current.
  absl::Status CreateResources();
  // Makes this backend's device current for the calling thread.
  absl::Status Activate(const char* what) const;
  // Makes the op stream wait for the downloads queued so far (`op` names
  // the caller in errors).
  absl::Status JoinDownloads(const char* op);
  // Waits for the op stream and both copy streams.
  absl::Status SynchronizeStreams(const char* what);
  // After InjectFault said so: loses the context (BreakContext) and returns
  // the error, naming `what` failed.
  absl::Status InjectedFault(const char* what);

  int device_;
  std::string description_;
  cudaStream_t stream_ = nullptr;  // ops and the synchronous copies
  cudaStream_t upload_stream_ = nullptr;
  cudaStream_t download_stream_ = nullptr;
  // Zeroed once here; single-launch reductions count their finished blocks
  // in them and the last block puts its counter back to 0. The scale
  // backward takes the first, the projection backward's split dx kernels
  // the others. One set per op stream: each user's launches follow one
  // another on it.
  unsigned* arrivals_ = nullptr;
  // Recorded on the op stream for each download to wait for.
  cudaEvent_t ops_done_ = nullptr;
  // One event per upload since the last full synchronization: the upload
  // with ticket t recorded upload_events_[t - first_pending_upload_]. A
  // ticket below first_pending_upload_ is known complete. The pool only
  // grows, to the most uploads one request queues.
  std::vector<cudaEvent_t> upload_events_;
  CopyTicket next_upload_ = 0;
  CopyTicket first_pending_upload_ = 0;
};

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_CUDA_BACKEND_H_
