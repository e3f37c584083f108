// The probes' timing loop: runs after a write flush of L2, timed by events
// on the default stream, the first only warming up.
#ifndef MHC_KERNELS_CUDA_TOOLS_FLUSHED_RUNS_CUH_
#define MHC_KERNELS_CUDA_TOOLS_FLUSHED_RUNS_CUH_

#include <algorithm>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common.cuh"
#include "mhc/status.h"

namespace mhc::cuda {

// The median of `repeats` timed runs in microseconds. Before each, flush
// (flush_bytes of device memory, rewritten: L2 full of another buffer's dirty
// lines, as a kernel of a real step finds it) and then reset() (untimed);
// launch() is what the events time. Both return an absl::Status.
template <typename Reset, typename Launch>
absl::StatusOr<double> MedianFlushedRunUs(void* flush, size_t flush_bytes,
                                          cudaEvent_t start, cudaEvent_t stop,
                                          int repeats, const char* op,
                                          const std::string& what, Reset reset,
                                          Launch launch) {
  std::vector<double> us;
  for (int i = 0; i <= repeats; ++i) {
    MHC_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(flush, i, flush_bytes), op, what);
    MHC_RETURN_IF_ERROR(reset());
    MHC_CUDA_RETURN_IF_ERROR(cudaEventRecord(start), op, what);
    MHC_RETURN_IF_ERROR(launch());
    MHC_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop), op, what);
    MHC_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop), op, what);
    float ms = 0;
    MHC_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop), op, what);
    if (i > 0) us.push_back(ms * 1e3);
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_TOOLS_FLUSHED_RUNS_CUH_
