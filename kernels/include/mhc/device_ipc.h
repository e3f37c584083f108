// The device work behind shared memory: opening another process's device
// allocations and interprocess events on this node, and page-locking host
// memory so that devices copy it by DMA. With Backend, the daemon's only
// way to a device; the CUDA implementation (CUDA IPC handles, events and
// cudaHostRegister) is MakeCudaDeviceIpc in mhc/cuda.h.
//
// Calls on one thread may switch its current device; a caller that opens
// from several threads at once serialises the opens itself.
#ifndef MHC_DEVICE_IPC_H_
#define MHC_DEVICE_IPC_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "mhc/backend.h"

namespace mhc {

class DeviceIpc {
 public:
  virtual ~DeviceIpc() = default;

  // Devices of this process; 0 when there is no driver or no device.
  virtual int DeviceCount() const = 0;

  // Opens another process's allocation from its handle (a 64-byte
  // cudaIpcMemHandle_t on CUDA) on `device`. `available` is the bytes from
  // `ptr` to the end of the allocation, 0 when the size is unknown. One
  // process may open a handle only once: a caller that needs it again
  // shares the mapping.
  struct OpenedMemory {
    void* ptr = nullptr;
    uint64_t available = 0;
  };
  virtual absl::StatusOr<OpenedMemory> OpenMemory(absl::string_view handle,
                                                  int device) = 0;
  // Closes what OpenMemory opened, once the device has finished the work
  // queued so far, which may still read the memory.
  virtual void CloseMemory(int device, void* ptr) = 0;

  // Opens another process's interprocess event from its handle (a 64-byte
  // cudaIpcEventHandle_t on CUDA) on `device`.
  virtual absl::StatusOr<DeviceEvent> OpenEvent(absl::string_view handle,
                                                int device) = 0;
  // Makes an interprocess event on `device` and returns it with the handle
  // another process opens.
  struct ExportedEvent {
    DeviceEvent event = nullptr;
    std::string handle;
  };
  virtual absl::StatusOr<ExportedEvent> CreateEvent(int device) = 0;
  // Destroys an event of OpenEvent or CreateEvent; work still queued to
  // wait for or record it keeps it until done.
  virtual void DestroyEvent(int device, DeviceEvent event) = 0;

  // Page-locks [base, base + bytes) for every device of the process, through
  // `device`'s context (so that no other device gets one just for this).
  // `read_only`: the memory is not writable, so devices may only read it.
  virtual absl::Status PinHost(int device, void* base, size_t bytes,
                               bool read_only) = 0;
  // Undoes PinHost(device, base, ...).
  virtual absl::Status UnpinHost(int device, void* base) = 0;
  // The address devices use for `host`, inside memory of PinHost (the
  // target of Backend::WriteWordAfterWork). UNIMPLEMENTED where devices
  // cannot address host memory.
  virtual absl::StatusOr<void*> HostDeviceAddress(int /*device*/,
                                                  void* /*host*/) {
    return absl::UnimplementedError("devices cannot address host memory");
  }
};

}  // namespace mhc

#endif  // MHC_DEVICE_IPC_H_
