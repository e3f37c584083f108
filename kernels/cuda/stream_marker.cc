// What a collective library beside a CUDA backend's ops needs of the device
// (mhc/cuda.h): the thread's current device and a polled marker on the op
// stream, through the CUDA runtime.
#include <cuda_runtime.h>

#include <memory>

#include "absl/strings/str_cat.h"
#include "mhc/cuda.h"
#include "mhc/status.h"

namespace mhc {
namespace {

absl::Status CudaStatus(cudaError_t error) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("CUDA: ", cudaGetErrorString(error)));
}

class CudaEventMarker final : public CudaStreamMarker {
 public:
  CudaEventMarker(int device, cudaEvent_t event)
      : device_(device), event_(event) {}
  ~CudaEventMarker() override {
    cudaSetDevice(device_);
    cudaEventDestroy(event_);
  }

  absl::Status Record(void* stream) override {
    MHC_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_)));
    return CudaStatus(
        cudaEventRecord(event_, static_cast<cudaStream_t>(stream)));
  }

  absl::StatusOr<bool> Done() override {
    const cudaError_t query = cudaEventQuery(event_);
    if (query == cudaErrorNotReady) return false;
    MHC_RETURN_IF_ERROR(CudaStatus(query));
    return true;
  }

 private:
  const int device_;
  const cudaEvent_t event_;
};

}  // namespace

absl::Status UseCudaDevice(int device) {
  return CudaStatus(cudaSetDevice(device));
}

absl::StatusOr<std::unique_ptr<CudaStreamMarker>> MakeCudaStreamMarker(
    int device) {
  MHC_RETURN_IF_ERROR(UseCudaDevice(device));
  cudaEvent_t event = nullptr;
  MHC_RETURN_IF_ERROR(
      CudaStatus(cudaEventCreateWithFlags(&event, cudaEventDisableTiming)));
  return std::unique_ptr<CudaStreamMarker>(new CudaEventMarker(device, event));
}

}  // namespace mhc
