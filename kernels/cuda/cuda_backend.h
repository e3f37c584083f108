// mhc::Backend on one CUDA device: memory, copies and every op on the
// backend's own stream. Ops never allocate: scratch comes from the caller's
// Workspace, sized exactly by WorkspaceBytes.
#ifndef MHC_KERNELS_CUDA_CUDA_BACKEND_H_
#define MHC_KERNELS_CUDA_CUDA_BACKEND_H_

#include <cuda_runtime.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
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
  // CUDA events on this backend's stream (event_timer.cu).
  std::unique_ptr<DeviceTimer> MakeDeviceTimer() override;
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

 private:
  CudaBackend(int device, cudaStream_t stream, unsigned* arrivals,
              std::string description)
      : device_(device),
        stream_(stream),
        arrivals_(arrivals),
        description_(std::move(description)) {}

  // Makes this backend's device current for the calling thread.
  absl::Status Activate(const char* what) const;

  int device_;
  cudaStream_t stream_;
  // Zeroed once here; single-launch reductions count their finished blocks
  // in it and the last block puts it back to 0. One per stream: kernels on
  // one stream never overlap, so they can share it.
  unsigned* arrivals_;
  std::string description_;
};

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_CUDA_BACKEND_H_
