#include <cstdint>

#include "fault_injection.h"
#include "mhc/cuda.h"

namespace mhc {
namespace cuda {
namespace fault_internal {

std::atomic<bool> armed{false};

namespace {

// Events left at each site until the one that fails (1: the next); 0 or
// less: none fails.
std::atomic<int64_t> countdown[3];

}  // namespace

bool Fire(FaultSite site) {
  return countdown[static_cast<int>(site)].fetch_sub(1) == 1;
}

}  // namespace fault_internal

namespace {

__global__ void trap_kernel() { __trap(); }

}  // namespace

cudaError_t BreakContext(cudaStream_t stream) {
  trap_kernel<<<1, 1, 0, stream>>>();
  const cudaError_t error = cudaStreamSynchronize(stream);
  return error != cudaSuccess ? error : cudaErrorLaunchFailure;
}

}  // namespace cuda

void InjectCudaFaults(const CudaFaultPlan& plan) {
  using cuda::FaultSite;
  using cuda::fault_internal::countdown;
  countdown[static_cast<int>(FaultSite::kAlloc)].store(plan.alloc);
  countdown[static_cast<int>(FaultSite::kLaunch)].store(plan.launch);
  countdown[static_cast<int>(FaultSite::kCopy)].store(plan.copy);
  cuda::fault_internal::armed.store(plan.alloc > 0 || plan.launch > 0 ||
                                    plan.copy > 0);
}

}  // namespace mhc
