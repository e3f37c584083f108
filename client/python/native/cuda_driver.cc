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

struct Driver {
  CuResult (*get_error_name)(CuResult, const char**) = nullptr;
  CuResult (*pointer_get_attributes)(unsigned, int*, void**,
                                     unsigned long long) = nullptr;
  CuResult (*event_record)(void*, void*) = nullptr;
  CuResult (*stream_wait_event)(void*, void*, unsigned) = nullptr;
  std::string error;  // why the driver is not usable, if it is not
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

}  // namespace mhc::client::python
