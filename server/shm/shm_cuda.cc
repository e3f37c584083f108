#include "server/shm/shm_cuda.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "mhc/cuda.h"
#include "mhc/status.h"
#include "server/log.h"

namespace mhc::server {
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

class CudaIpcOpener final : public DeviceMemoryOpener {
 public:
  int DeviceCount() const override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
    return count;
  }

  absl::StatusOr<Opened> Open(absl::string_view handle, int device,
                              uint64_t byte_size) override {
    cudaIpcMemHandle_t ipc;
    static_assert(sizeof(ipc) == 64, "cudaIpcMemHandle_t is 64 bytes");
    if (handle.size() != sizeof(ipc)) {
      return absl::InvalidArgumentError("raw_handle: expected 64 bytes");
    }
    std::memcpy(&ipc, handle.data(), sizeof(ipc));
    absl::MutexLock lock(&mu_);
    // One process may open a handle only once, but a client registers the
    // same allocation again (a longer range, another tensor in it): share
    // the mapping and count its regions.
    const std::string key = absl::StrCat(device, ":", handle);
    auto it = open_.find(key);
    if (it == open_.end()) {
      MHC_ASSIGN_OR_RETURN(Mapping mapping, OpenLocked(ipc, device));
      it = open_.emplace(key, mapping).first;
    }
    Mapping& mapping = it->second;
    if (byte_size > mapping.available || mapping.available == 0) {
      if (mapping.regions == 0) {
        CloseLocked(device, mapping.ptr);
        open_.erase(it);
      }
      return absl::InvalidArgumentError(
          absl::StrCat("byte_size: ", byte_size,
                       " exceeds the allocation behind the handle (",
                       mapping.available, " bytes)"));
    }
    ++mapping.regions;
    return Opened{mapping.ptr, byte_size == 0 ? mapping.available : byte_size};
  }

  std::pair<int, uint64_t> MappedTotals() const override {
    absl::MutexLock lock(&mu_);
    std::pair<int, uint64_t> totals{0, 0};
    for (const auto& [key, mapping] : open_) {
      ++totals.first;
      totals.second += mapping.available;
    }
    return totals;
  }

  absl::StatusOr<DeviceEvent> OpenEvent(absl::string_view handle,
                                        int device) override {
    cudaIpcEventHandle_t ipc;
    static_assert(sizeof(ipc) == 64, "cudaIpcEventHandle_t is 64 bytes");
    if (handle.size() != sizeof(ipc)) {
      return absl::InvalidArgumentError("expected 64 bytes");
    }
    std::memcpy(&ipc, handle.data(), sizeof(ipc));
    absl::MutexLock lock(&mu_);
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
    absl::MutexLock lock(&mu_);
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
    absl::MutexLock lock(&mu_);
    // Work still queued to wait for or record it keeps it until done.
    if (UseDevice(device) == cudaSuccess) {
      cudaEventDestroy(static_cast<cudaEvent_t>(event));
    }
  }

  void Close(int device, void* ptr) override {
    absl::MutexLock lock(&mu_);
    for (auto it = open_.begin(); it != open_.end(); ++it) {
      if (it->second.ptr != ptr || it->second.device != device) continue;
      if (--it->second.regions == 0) {
        CloseLocked(device, ptr);
        open_.erase(it);
      }
      return;
    }
  }

 private:
  struct Mapping {
    void* ptr = nullptr;
    int device = 0;
    uint64_t available = 0;  // bytes from ptr to the allocation's end
    int regions = 0;
  };

  // The current device is per thread: set for the call (UseDevice: never
  // restored), under mu_ so opens do not mix.
  absl::StatusOr<Mapping> OpenLocked(const cudaIpcMemHandle_t& ipc, int device)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (cudaError_t e = UseDevice(device); e != cudaSuccess) {
      return absl::InvalidArgumentError(
          absl::StrCat("device_id: cannot use CUDA device ", device, ": ",
                       cudaGetErrorString(e)));
    }
    Mapping mapping;
    mapping.device = device;
    cudaError_t e =
        cudaIpcOpenMemHandle(&mapping.ptr, ipc, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();  // not sticky; clear it for later calls
      return absl::InvalidArgumentError(
          absl::StrCat("raw_handle: cudaIpcOpenMemHandle on device ", device,
                       " failed: ", cudaGetErrorString(e)));
    }
    absl::StatusOr<CudaAllocation> allocation = FindCudaAllocation(mapping.ptr);
    if (allocation.ok()) {
      mapping.available =
          allocation->bytes -
          static_cast<uint64_t>(static_cast<char*>(mapping.ptr) -
                                allocation->base);
    }
    return mapping;
  }

  absl::Status UseDeviceOrFail(int device) {
    if (cudaError_t e = UseDevice(device); e != cudaSuccess) {
      return absl::InvalidArgumentError(
          absl::StrCat("device_id: cannot use CUDA device ", device, ": ",
                       cudaGetErrorString(e)));
    }
    return absl::OkStatus();
  }

  void CloseLocked(int device, void* ptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    UseDevice(device);  // on failure the calls below fail too
    // Requests are answered once their work is queued, so work that reads
    // this memory may still be running. Closing is rare (a client drops an
    // allocation or its session ends), so waiting here is cheap.
    cudaDeviceSynchronize();
    cudaIpcCloseMemHandle(ptr);
  }

  mutable absl::Mutex mu_;
  std::map<std::string, Mapping> open_ ABSL_GUARDED_BY(mu_);
};

class CudaHostPinner final : public HostMemoryPinner {
 public:
  explicit CudaHostPinner(int device) : device_(device) {}

  absl::Status Pin(void* base, size_t bytes, bool read_only) override {
    if (const cudaError_t error = UseDevice(device_); error != cudaSuccess) {
      return absl::UnavailableError(absl::StrCat(
          "cannot use CUDA device ", device_, ": ", cudaGetErrorString(error)));
    }
    // Portable: every device's executor copies from it at full speed.
    unsigned int flags = cudaHostRegisterPortable;
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

  void Unpin(void* base) override {
    UseDevice(device_);  // on failure the unregister below fails and says so
    const cudaError_t error = cudaHostUnregister(base);
    if (error != cudaSuccess) {
      // The pages may stay locked until the process exits; nothing else is
      // affected, and the caller is a destructor with no one to tell.
      cudaGetLastError();
      Log(LogLevel::kWarning,
          absl::StrCat("cudaHostUnregister of a shared-memory mapping "
                       "failed: ",
                       cudaGetErrorName(error), " (", cudaGetErrorString(error),
                       ")"));
    }
  }

 private:
  const int device_;
};

}  // namespace

std::unique_ptr<DeviceMemoryOpener> MakeCudaIpcOpener() {
  return std::make_unique<CudaIpcOpener>();
}

std::unique_ptr<HostMemoryPinner> MakeCudaHostPinner(int device) {
  return std::make_unique<CudaHostPinner>(device);
}

}  // namespace mhc::server
