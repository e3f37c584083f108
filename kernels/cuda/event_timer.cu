// Kernel time as the device saw it: two events on the backend's stream,
// without draining the stream before the first one (the host clock would
// count launch latency and queueing instead).
#include <memory>

#include "absl/strings/str_cat.h"
#include "common.cuh"
#include "cuda_backend.h"

namespace mhc::cuda {
namespace {

class EventTimer final : public DeviceTimer {
 public:
  EventTimer(int device, cudaStream_t stream)
      : device_(device), stream_(stream) {}
  ~EventTimer() override {
    if (cudaSetDevice(device_) != cudaSuccess) return;
    if (start_ != nullptr) cudaEventDestroy(start_);
    if (stop_ != nullptr) cudaEventDestroy(stop_);
  }

  void Start() override {
    // A failure resurfaces from StopSeconds, which reports it.
    start_error_ = Record(start_);
  }

  absl::StatusOr<double> StopSeconds() override {
    const std::string what = absl::StrCat("device ", device_);
    MHC_CUDA_RETURN_IF_ERROR(start_error_, "timer start", what);
    MHC_CUDA_RETURN_IF_ERROR(Record(stop_), "timer stop", what);
    MHC_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop_), "timer", what);
    float ms = 0;
    MHC_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start_, stop_), "timer",
                             what);
    return ms * 1e-3;
  }

 private:
  cudaError_t Record(cudaEvent_t& event) {
    cudaError_t error = cudaSetDevice(device_);
    if (error == cudaSuccess && event == nullptr) {
      error = cudaEventCreate(&event);
    }
    return error == cudaSuccess ? cudaEventRecord(event, stream_) : error;
  }

  const int device_;
  const cudaStream_t stream_;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
  cudaError_t start_error_ = cudaSuccess;
};

}  // namespace

std::unique_ptr<DeviceTimer> CudaBackend::MakeDeviceTimer() {
  return std::make_unique<EventTimer>(device_, stream_);
}

}  // namespace mhc::cuda
