// Test-only fault injection in the CUDA backend (mhcd --fault_injection,
// InjectCudaFaults in mhc/cuda.h). The backend asks InjectFault at its
// allocation, op launch and copy entry points; with nothing armed, as in
// production, that is one relaxed load of a flag that never changes.
#ifndef MHC_KERNELS_CUDA_FAULT_INJECTION_H_
#define MHC_KERNELS_CUDA_FAULT_INJECTION_H_

#include <cuda_runtime.h>

#include <atomic>

#include "absl/base/optimization.h"

namespace mhc::cuda {

enum class FaultSite { kAlloc, kLaunch, kCopy };

namespace fault_internal {
extern std::atomic<bool> armed;
// Counts one event at `site`; true for the one that is to fail.
bool Fire(FaultSite site);
}  // namespace fault_internal

// Whether the event at `site` that is happening now is to fail.
inline bool InjectFault(FaultSite site) {
  return ABSL_PREDICT_FALSE(
             fault_internal::armed.load(std::memory_order_relaxed)) &&
         fault_internal::Fire(site);
}

// Loses the CUDA context as a kernel that faults does: runs a kernel that
// traps on `stream` and waits for it. Returns the resulting error, which is
// sticky: every later call of the process sees it.
cudaError_t BreakContext(cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_FAULT_INJECTION_H_
