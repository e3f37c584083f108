#include "cuda_driver.h"

#include <dlfcn.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace mhc::client::python {
namespace {

// From the driver's ABI (cuda.h), declared here so that the build needs no
// CUDA toolkit.
using CuResult = int;
constexpr CuResult kCudaSuccess = 0;
constexpr int kAttributeBufferId = 7;
constexpr int kAttributeRangeStart = 11;
constexpr unsigned kHostRegisterPortable = 1;
constexpr unsigned kHostRegisterDeviceMap = 2;
constexpr unsigned kStreamWaitValueGeq = 0;

struct Driver {
  CuResult (*get_error_name)(CuResult, const char**) = nullptr;
  CuResult (*pointer_get_attributes)(unsigned, int*, void**,
                                     unsigned long long) = nullptr;
  CuResult (*event_record)(void*, void*) = nullptr;
  CuResult (*stream_wait_event)(void*, void*, unsigned) = nullptr;
  std::string error;  // why the driver is not usable, if it is not
  // For waits on a host word; optional (word_error says why they are not
  // usable) so that an older driver still serves the rest.
  CuResult (*host_register)(void*, size_t, unsigned) = nullptr;
  CuResult (*host_get_device_pointer)(uint64_t*, void*, unsigned) = nullptr;
  CuResult (*host_unregister)(void*) = nullptr;
  CuResult (*stream_wait_value)(void*, uint64_t, uint32_t, unsigned) = nullptr;
  CuResult (*ctx_synchronize)() = nullptr;
  std::string word_error;
};

template <typename F>
void Resolve(void* library, const char* name, F& function, std::string& error) {
  function = reinterpret_cast<F>(dlsym(library, name));
  if (function == nullptr && error.empty()) {
    error = absl::StrCat("libcuda.so.1 has no ", name);
  }
}

const Driver& LoadedDriver() {
  static const Driver* driver = [] {
    auto* loaded = new Driver;
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      loaded->error = absl::StrCat("cannot load libcuda.so.1: ", dlerror());
      return loaded;
    }
    Resolve(library, "cuGetErrorName", loaded->get_error_name, loaded->error);
    Resolve(library, "cuPointerGetAttributes", loaded->pointer_get_attributes,
            loaded->error);
    Resolve(library, "cuEventRecord", loaded->event_record, loaded->error);
    Resolve(library, "cuStreamWaitEvent", loaded->stream_wait_event,
            loaded->error);
    Resolve(library, "cuMemHostRegister_v2", loaded->host_register,
            loaded->word_error);
    Resolve(library, "cuMemHostGetDevicePointer_v2",
            loaded->host_get_device_pointer, loaded->word_error);
    Resolve(library, "cuMemHostUnregister", loaded->host_unregister,
            loaded->word_error);
    Resolve(library, "cuStreamWaitValue32_v2", loaded->stream_wait_value,
            loaded->word_error);
    Resolve(library, "cuCtxSynchronize", loaded->ctx_synchronize,
            loaded->word_error);
    return loaded;
  }();
  return *driver;
}

absl::StatusOr<const Driver*> UsableDriver() {
  const Driver& driver = LoadedDriver();
  if (!driver.error.empty()) {
    return absl::FailedPreconditionError(driver.error);
  }
  return &driver;
}

absl::StatusOr<const Driver*> WordDriver() {
  absl::StatusOr<const Driver*> driver = UsableDriver();
  if (driver.ok() && !(*driver)->word_error.empty()) {
    return absl::FailedPreconditionError((*driver)->word_error);
  }
  return driver;
}

absl::Status Check(const Driver& driver, CuResult result, const char* what) {
  if (result == kCudaSuccess) return absl::OkStatus();
  const char* name = nullptr;
  if (driver.get_error_name(result, &name) != kCudaSuccess || name == nullptr) {
    name = "unknown CUresult";
  }
  return absl::InternalError(absl::StrCat(what, ": ", name, " (", result, ")"));
}

}  // namespace

absl::StatusOr<CudaAllocation> AllocationOf(uint64_t address) {
  absl::StatusOr<const Driver*> driver = UsableDriver();
  if (!driver.ok()) return driver.status();
  CudaAllocation allocation;
  int attributes[] = {kAttributeBufferId, kAttributeRangeStart};
  void* values[] = {&allocation.buffer_id, &allocation.base};
  absl::Status status =
      Check(**driver,
            (*driver)->pointer_get_attributes(2, attributes, values, address),
            "cuPointerGetAttributes");
  if (!status.ok()) return status;
  if (allocation.buffer_id == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("address 0x", absl::Hex(address),
                     " is not in a CUDA allocation of this process"));
  }
  return allocation;
}

absl::Status RecordEvent(CudaEventHandle event, CudaStreamHandle stream) {
  absl::StatusOr<const Driver*> driver = UsableDriver();
  if (!driver.ok()) return driver.status();
  return Check(**driver,
               (*driver)->event_record(reinterpret_cast<void*>(event),
                                       reinterpret_cast<void*>(stream)),
               "cuEventRecord");
}

absl::Status WaitEvent(CudaStreamHandle stream, CudaEventHandle event) {
  absl::StatusOr<const Driver*> driver = UsableDriver();
  if (!driver.ok()) return driver.status();
  return Check(**driver,
               (*driver)->stream_wait_event(reinterpret_cast<void*>(stream),
                                            reinterpret_cast<void*>(event), 0),
               "cuStreamWaitEvent");
}

absl::StatusOr<uint64_t> PinHostPage(void* page, size_t bytes, void* word) {
  absl::StatusOr<const Driver*> driver = WordDriver();
  if (!driver.ok()) return driver.status();
  absl::Status status =
      Check(**driver,
            (*driver)->host_register(
                page, bytes, kHostRegisterPortable | kHostRegisterDeviceMap),
            "cuMemHostRegister");
  if (!status.ok()) return status;
  uint64_t address = 0;
  status =
      Check(**driver, (*driver)->host_get_device_pointer(&address, word, 0),
            "cuMemHostGetDevicePointer");
  if (!status.ok()) {
    (*driver)->host_unregister(page);
    return status;
  }
  return address;
}

absl::Status UnpinHostPage(void* page) {
  absl::StatusOr<const Driver*> driver = WordDriver();
  if (!driver.ok()) return driver.status();
  return Check(**driver, (*driver)->host_unregister(page),
               "cuMemHostUnregister");
}

absl::Status WaitWord(CudaStreamHandle stream, uint64_t word, uint32_t value) {
  absl::StatusOr<const Driver*> driver = WordDriver();
  if (!driver.ok()) return driver.status();
  return Check(**driver,
               (*driver)->stream_wait_value(reinterpret_cast<void*>(stream),
                                            word, value, kStreamWaitValueGeq),
               "cuStreamWaitValue32");
}

absl::Status SynchronizeContext() {
  absl::StatusOr<const Driver*> driver = WordDriver();
  if (!driver.ok()) return driver.status();
  return Check(**driver, (*driver)->ctx_synchronize(), "cuCtxSynchronize");
}

}  // namespace mhc::client::python
