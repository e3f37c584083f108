#include "server/shm_cuda.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace mhc::server {
namespace {

// cuMemGetAddressRange through the runtime's driver entry point, so mhcd
// does not link libcuda and still starts on machines without a driver.
PFN_cuMemGetAddressRange_v3020 AddressRangeFunction() {
  static const PFN_cuMemGetAddressRange_v3020 function = [] {
    void* pointer = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &pointer,
                                         12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return PFN_cuMemGetAddressRange_v3020{nullptr};
    }
    return reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(pointer);
  }();
  return function;
}

class CudaIpcOpener final : public DeviceMemoryOpener {
 public:
  int DeviceCount() const override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
    return count;
  }

  absl::StatusOr<void*> Open(absl::string_view handle, int device,
                             uint64_t byte_size) override {
    cudaIpcMemHandle_t ipc;
    static_assert(sizeof(ipc) == 64, "cudaIpcMemHandle_t is 64 bytes");
    if (handle.size() != sizeof(ipc)) {
      return absl::InvalidArgumentError("raw_handle: expected 64 bytes");
    }
    std::memcpy(&ipc, handle.data(), sizeof(ipc));
    // The current device is per thread and gRPC threads are shared: set it
    // for this call and restore it, under one lock so opens do not mix.
    absl::MutexLock lock(&mu_);
    int previous = 0;
    cudaGetDevice(&previous);
    if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
      return absl::InvalidArgumentError(
          absl::StrCat("device_id: cannot use CUDA device ", device, ": ",
                       cudaGetErrorString(e)));
    }
    void* ptr = nullptr;
    cudaError_t e =
        cudaIpcOpenMemHandle(&ptr, ipc, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();  // not sticky; clear it for later calls
      cudaSetDevice(previous);
      return absl::InvalidArgumentError(
          absl::StrCat("raw_handle: cudaIpcOpenMemHandle on device ", device,
                       " failed: ", cudaGetErrorString(e)));
    }
    CUdeviceptr base = 0;
    size_t size = 0;
    const PFN_cuMemGetAddressRange_v3020 address_range = AddressRangeFunction();
    const CUresult r =
        address_range == nullptr
            ? CUDA_ERROR_NOT_SUPPORTED
            : address_range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr));
    const uint64_t available =
        r == CUDA_SUCCESS ? size - (reinterpret_cast<CUdeviceptr>(ptr) - base)
                          : 0;
    if (r != CUDA_SUCCESS || byte_size > available) {
      cudaIpcCloseMemHandle(ptr);
      cudaSetDevice(previous);
      return absl::InvalidArgumentError(
          absl::StrCat("byte_size: ", byte_size,
                       " exceeds the allocation behind the "
                       "handle (",
                       available, " bytes)"));
    }
    cudaSetDevice(previous);
    return ptr;
  }

  void Close(int device, void* ptr) override {
    absl::MutexLock lock(&mu_);
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    cudaIpcCloseMemHandle(ptr);
    cudaSetDevice(previous);
  }

 private:
  absl::Mutex mu_;
};

}  // namespace

std::unique_ptr<DeviceMemoryOpener> MakeCudaIpcOpener() {
  return std::make_unique<CudaIpcOpener>();
}

}  // namespace mhc::server
