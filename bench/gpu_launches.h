// Kernel launches per op for the GPU benchmark (bench/gpu_bench.cc): one run
// of the op is captured into a CUDA graph on the backend's op stream, never
// executed, and the graph's nodes are counted by type. Apart from
// gpu_launches.cc, the benchmark never calls the CUDA runtime itself.
#ifndef MHC_BENCH_GPU_LAUNCHES_H_
#define MHC_BENCH_GPU_LAUNCHES_H_

#include <functional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "mhc/backend.h"

namespace mhc::bench {

struct LaunchCount {
  int kernels = 0;  // kernel nodes: the launches
  int memsets = 0;
  int memcpys = 0;
  int other = 0;  // host, event, conditional and allocation nodes
};

// Captures what `run` enqueues on the op stream of `cuda_backend` (made by
// MakeCudaBackend) and counts it. An op that synchronises, waits on work
// outside the capture or launches on another stream cannot be captured:
// the error says so, and the stream is left out of capture mode with no
// pending CUDA error, ready for the next op.
absl::StatusOr<LaunchCount> CountLaunches(
    Backend& cuda_backend, const std::function<absl::Status()>& run);

}  // namespace mhc::bench

#endif  // MHC_BENCH_GPU_LAUNCHES_H_
