// DeviceIpc through the CUDA runtime: IPC memory and event handles, and
// cudaHostRegister for host memory (the driver only through the runtime's
// entry points, so a daemon starts on machines without a driver).
#include "mhc/device_ipc.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "mhc/cuda.h"
#include "mhc/status.h"

namespace mhc {
namespace {

// Makes `device` current for the calling thread. Not restored afterwards:
// every CUDA user in the daemon sets its device first (backends in each
// call), and restoring a thread's default device 0 would create a context on
// GPU 0 even where the daemon does not serve it.
cudaError_t UseDevice(int device) {
  const cudaError_t error = cudaSetDevice(device);
  if (error != cudaSuccess) cudaGetLastError();
  return error;
}

absl::Status UseDeviceOrFail(int device) {
  if (cudaError_t e = UseDevice(device); e != cudaSuccess) {
    return absl::InvalidArgumentError(
        absl::StrCat("device_id: cannot use CUDA device ", device, ": ",
                     cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

class CudaDeviceIpc final : public DeviceIpc {
 public:
  int DeviceCount() const override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
    return count;
  }

  absl::StatusOr<OpenedMemory> OpenMemory(absl::string_view handle,
                                          int device) override {
    cudaIpcMemHandle_t ipc;
    static_assert(sizeof(ipc) == 64, "cudaIpcMemHandle_t is 64 bytes");
    if (handle.size() != sizeof(ipc)) {
      return absl::InvalidArgumentError("raw_handle: expected 64 bytes");
    }
    std::memcpy(&ipc, handle.data(), sizeof(ipc));
    MHC_RETURN_IF_ERROR(UseDeviceOrFail(device));
    OpenedMemory opened;
    cudaError_t e =
        cudaIpcOpenMemHandle(&opened.ptr, ipc, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();  // not sticky; clear it for later calls
      return absl::InvalidArgumentError(
          absl::StrCat("raw_handle: cudaIpcOpenMemHandle on device ", device,
                       " failed: ", cudaGetErrorString(e)));
    }
    absl::StatusOr<CudaAllocation> allocation = FindCudaAllocation(opened.ptr);
    if (allocation.ok()) {
      opened.available = allocation->bytes -
                         static_cast<uint64_t>(static_cast<char*>(opened.ptr) -
                                               allocation->base);
    }
    return opened;
  }

  void CloseMemory(int device, void* ptr) override {
    UseDevice(device);  // on failure the calls below fail too
    // Requests are answered once their work is queued, so work that reads
    // this memory may still be running. Closing is rare (a client drops an
    // allocation or its session ends), so waiting here is cheap.
    cudaDeviceSynchronize();
    cudaIpcCloseMemHandle(ptr);
  }

  absl::StatusOr<DeviceEvent> OpenEvent(absl::string_view handle,
                                        int device) override {
    cudaIpcEventHandle_t ipc;
    static_assert(sizeof(ipc) == 64, "cudaIpcEventHandle_t is 64 bytes");
    if (handle.size() != sizeof(ipc)) {
      return absl::InvalidArgumentError("expected 64 bytes");
    }
    std::memcpy(&ipc, handle.data(), sizeof(ipc));
    MHC_RETURN_IF_ERROR(UseDeviceOrFail(device));
    cudaEvent_t event = nullptr;
    if (cudaError_t e = cudaIpcOpenEventHandle(&event, ipc); e != cudaSuccess) {
      cudaGetLastError();
      return absl::InvalidArgumentError(
          absl::StrCat("cudaIpcOpenEventHandle on device ", device,
                       " failed: ", cudaGetErrorString(e)));
    }
    return DeviceEvent{event};
  }

  absl::StatusOr<ExportedEvent> CreateEvent(int device) override {
    MHC_RETURN_IF_ERROR(UseDeviceOrFail(device));
    cudaEvent_t event = nullptr;
    cudaError_t e = cudaEventCreateWithFlags(
        &event, cudaEventInterprocess | cudaEventDisableTiming);
    cudaIpcEventHandle_t ipc;
    if (e == cudaSuccess) {
      e = cudaIpcGetEventHandle(&ipc, event);
      if (e != cudaSuccess) cudaEventDestroy(event);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot make an interprocess event on device ", device,
                       ": ", cudaGetErrorString(e)));
    }
    return ExportedEvent{
        event, std::string(reinterpret_cast<const char*>(&ipc), sizeof(ipc))};
  }

  void DestroyEvent(int device, DeviceEvent event) override {
    if (UseDevice(device) == cudaSuccess) {
      cudaEventDestroy(static_cast<cudaEvent_t>(event));
    }
  }

  absl::Status PinHost(int device, void* base, size_t bytes,
                       bool read_only) override {
    if (const cudaError_t error = UseDevice(device); error != cudaSuccess) {
      return absl::UnavailableError(absl::StrCat(
          "cannot use CUDA device ", device, ": ", cudaGetErrorString(error)));
    }
    // Portable: every device's executor copies from it at full speed.
    // Mapped: a device stream may write a word of it (HostDeviceAddress).
    unsigned int flags = cudaHostRegisterPortable | cudaHostRegisterMapped;
    if (read_only) flags |= cudaHostRegisterReadOnly;
    const cudaError_t error = cudaHostRegister(base, bytes, flags);
    if (error != cudaSuccess) {
      cudaGetLastError();  // not sticky; keep it from later calls
      return absl::ResourceExhaustedError(absl::StrCat(
          "cudaHostRegister of ", bytes, " bytes failed: ",
          cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<void*> HostDeviceAddress(int device, void* host) override {
    MHC_RETURN_IF_ERROR(UseDeviceOrFail(device));
    void* address = nullptr;
    const cudaError_t error = cudaHostGetDevicePointer(&address, host, 0);
    if (error != cudaSuccess) {
      cudaGetLastError();  // not sticky; keep it from later calls
      return absl::FailedPreconditionError(
          absl::StrCat("cudaHostGetDevicePointer: ", cudaGetErrorName(error),
                       " (", cudaGetErrorString(error), ")"));
    }
    return address;
  }

  absl::Status UnpinHost(int device, void* base) override {
    UseDevice(device);  // on failure the unregister below fails and says so
    const cudaError_t error = cudaHostUnregister(base);
    if (error != cudaSuccess) {
      cudaGetLastError();  // not sticky; keep it from later calls
      return absl::InternalError(
          absl::StrCat("cudaHostUnregister: ", cudaGetErrorName(error), " (",
                       cudaGetErrorString(error), ")"));
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<DeviceIpc> MakeCudaDeviceIpc() {
  return std::make_unique<CudaDeviceIpc>();
}

}  // namespace mhc
