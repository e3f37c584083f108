#include "server/shm/device_memory.h"

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "mhc/status.h"
#include "server/log.h"

namespace mhc::server {
namespace {

class IpcMemoryOpener final : public DeviceMemoryOpener {
 public:
  explicit IpcMemoryOpener(std::shared_ptr<DeviceIpc> ipc)
      : ipc_(std::move(ipc)) {}

  int DeviceCount() const override { return ipc_->DeviceCount(); }

  absl::StatusOr<Opened> Open(absl::string_view handle, int device,
                              uint64_t byte_size) override {
    absl::MutexLock lock(&mu_);
    // One process may open a handle only once, but a client registers the
    // same allocation again (a longer range, another tensor in it): share
    // the mapping and count its regions.
    const std::string key = absl::StrCat(device, ":", handle);
    auto it = open_.find(key);
    if (it == open_.end()) {
      MHC_ASSIGN_OR_RETURN(Mapping mapping, OpenLocked(handle, device));
      it = open_.emplace(key, mapping).first;
    }
    Mapping& mapping = it->second;
    if (byte_size > mapping.available || mapping.available == 0) {
      if (mapping.regions == 0) {
        ipc_->CloseMemory(device, mapping.ptr);
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

  // The device is current per thread and the calls below switch it: they
  // run under mu_ so that opens do not mix.
  absl::StatusOr<DeviceEvent> OpenEvent(absl::string_view handle,
                                        int device) override {
    absl::MutexLock lock(&mu_);
    return ipc_->OpenEvent(handle, device);
  }

  absl::StatusOr<ExportedEvent> CreateEvent(int device) override {
    absl::MutexLock lock(&mu_);
    MHC_ASSIGN_OR_RETURN(DeviceIpc::ExportedEvent own,
                         ipc_->CreateEvent(device));
    return ExportedEvent{own.event, std::move(own.handle)};
  }

  void DestroyEvent(int device, DeviceEvent event) override {
    absl::MutexLock lock(&mu_);
    ipc_->DestroyEvent(device, event);
  }

  void Close(int device, void* ptr) override {
    absl::MutexLock lock(&mu_);
    for (auto it = open_.begin(); it != open_.end(); ++it) {
      if (it->second.ptr != ptr || it->second.device != device) continue;
      if (--it->second.regions == 0) {
        ipc_->CloseMemory(device, ptr);
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

  absl::StatusOr<Mapping> OpenLocked(absl::string_view handle, int device)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    MHC_ASSIGN_OR_RETURN(DeviceIpc::OpenedMemory opened,
                         ipc_->OpenMemory(handle, device));
    Mapping mapping;
    mapping.ptr = opened.ptr;
    mapping.device = device;
    mapping.available = opened.available;
    return mapping;
  }

  const std::shared_ptr<DeviceIpc> ipc_;
  mutable absl::Mutex mu_;
  std::map<std::string, Mapping> open_ ABSL_GUARDED_BY(mu_);
};

class IpcHostPinner final : public HostMemoryPinner {
 public:
  IpcHostPinner(std::shared_ptr<DeviceIpc> ipc, int device)
      : ipc_(std::move(ipc)), device_(device) {}

  absl::Status Pin(void* base, size_t bytes, bool read_only) override {
    return ipc_->PinHost(device_, base, bytes, read_only);
  }

  absl::StatusOr<void*> DeviceAddress(void* host) override {
    return ipc_->HostDeviceAddress(device_, host);
  }

  void Unpin(void* base) override {
    const absl::Status status = ipc_->UnpinHost(device_, base);
    if (!status.ok()) {
      // The pages may stay locked until the process exits; nothing else is
      // affected, and the caller is a destructor with no one to tell.
      Log(LogLevel::kWarning,
          absl::StrCat("unpinning a shared-memory mapping failed: ",
                       status.message()));
    }
  }

 private:
  const std::shared_ptr<DeviceIpc> ipc_;
  const int device_;
};

}  // namespace

std::unique_ptr<DeviceMemoryOpener> MakeDeviceMemoryOpener(
    std::shared_ptr<DeviceIpc> ipc) {
  return std::make_unique<IpcMemoryOpener>(std::move(ipc));
}

std::unique_ptr<HostMemoryPinner> MakeHostMemoryPinner(
    std::shared_ptr<DeviceIpc> ipc, int device) {
  return std::make_unique<IpcHostPinner>(std::move(ipc), device);
}

}  // namespace mhc::server
