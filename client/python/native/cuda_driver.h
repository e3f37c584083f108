// The few CUDA driver entry points the native call path uses, loaded from
// libcuda.so.1 at first use: the extension builds and imports without CUDA,
// and in a process with CUDA tensors the driver is already mapped.
#ifndef MHC_CLIENT_PYTHON_NATIVE_CUDA_DRIVER_H_
#define MHC_CLIENT_PYTHON_NATIVE_CUDA_DRIVER_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace mhc::client::python {

// What the driver says about the allocation holding a device address.
struct CudaAllocation {
  uint64_t buffer_id = 0;  // unique in the process, never reused
  uint64_t base = 0;       // the allocation's first byte
};

// Handles as the driver and the runtime share them (CUevent, CUstream); a
// stream of 0 is the legacy default stream of the thread's context.
using CudaEventHandle = uintptr_t;
using CudaStreamHandle = uintptr_t;

// INVALID_ARGUMENT when `address` is not in a CUDA allocation of this
// process; FAILED_PRECONDITION without a driver.
absl::StatusOr<CudaAllocation> AllocationOf(uint64_t address);

// cuEventRecord(event, stream) and cuStreamWaitEvent(stream, event, 0).
absl::Status RecordEvent(CudaEventHandle event, CudaStreamHandle stream);
absl::Status WaitEvent(CudaStreamHandle stream, CudaEventHandle event);

// The stream waits on a word of host memory that another process's device
// stream writes (a call ring's done word). PinHostPage page-locks
// [page, page + bytes) for every context (the thread's context must be
// current) and returns the address devices use for `word` inside it;
// UnpinHostPage undoes it once no stream waits on the word any more.
absl::StatusOr<uint64_t> PinHostPage(void* page, size_t bytes, void* word);
absl::Status UnpinHostPage(void* page);
// Work queued on `stream` later starts once the word at device address
// `word` reaches `value` (cuStreamWaitValue32, cyclic greater or equal).
absl::Status WaitWord(CudaStreamHandle stream, uint64_t word, uint32_t value);
// cuCtxSynchronize of the thread's current context.
absl::Status SynchronizeContext();

}  // namespace mhc::client::python

#endif  // MHC_CLIENT_PYTHON_NATIVE_CUDA_DRIVER_H_
