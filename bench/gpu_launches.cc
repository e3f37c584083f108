#include "bench/gpu_launches.h"

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "absl/strings/str_cat.h"
#include "mhc/cuda.h"

namespace mhc::bench {
namespace {

absl::Status CudaError(cudaError_t error, const char* what) {
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(error),
                                          " (", cudaGetErrorString(error),
                                          ")"));
}

// Adds the nodes of `graph` to `count`, child graphs included (a capture
// makes none today, but a backend that launches a graph would).
absl::Status CountNodes(cudaGraph_t graph, LaunchCount& count) {
  size_t size = 0;
  cudaError_t error = cudaGraphGetNodes(graph, nullptr, &size);
  if (error != cudaSuccess) return CudaError(error, "cudaGraphGetNodes");
  std::vector<cudaGraphNode_t> nodes(size);
  if (size > 0) {
    error = cudaGraphGetNodes(graph, nodes.data(), &size);
    if (error != cudaSuccess) return CudaError(error, "cudaGraphGetNodes");
    nodes.resize(size);
  }
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    error = cudaGraphNodeGetType(node, &type);
    if (error != cudaSuccess) return CudaError(error, "cudaGraphNodeGetType");
    switch (type) {
      case cudaGraphNodeTypeKernel:
        ++count.kernels;
        break;
      case cudaGraphNodeTypeMemset:
        ++count.memsets;
        break;
      case cudaGraphNodeTypeMemcpy:
        ++count.memcpys;
        break;
      case cudaGraphNodeTypeEmpty:  // a join of dependencies, no work
        break;
      case cudaGraphNodeTypeGraph: {
        cudaGraph_t child = nullptr;
        error = cudaGraphChildGraphNodeGetGraph(node, &child);
        if (error != cudaSuccess) {
          return CudaError(error, "cudaGraphChildGraphNodeGetGraph");
        }
        absl::Status st = CountNodes(child, count);
        if (!st.ok()) return st;
        break;
      }
      default:
        ++count.other;
        break;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LaunchCount> CountLaunches(
    Backend& cuda_backend, const std::function<absl::Status()>& run) {
  absl::StatusOr<void*> op_stream = CudaOpStream(cuda_backend);
  if (!op_stream.ok()) return op_stream.status();
  const auto stream = static_cast<cudaStream_t>(*op_stream);
  // Nothing of earlier work may still be in flight: an error it raises
  // would otherwise be taken for the capture's.
  absl::Status st = cuda_backend.Synchronize();
  if (!st.ok()) return st;
  // Relaxed: the backend may allocate or query the device while it
  // enqueues (legal outside a capture), which the global mode refuses.
  cudaError_t error =
      cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed);
  if (error != cudaSuccess) {
    // A refused capture leaves its error as the thread's last error; it is
    // not sticky, so clearing it restores the stream. The value returned
    // is the error already reported.
    static_cast<void>(cudaGetLastError());
    return CudaError(error, "cudaStreamBeginCapture");
  }
  const absl::Status ran = run();
  // The capture is ended whatever the op did, so the stream leaves capture
  // mode even after an op that broke it (by synchronising, say): that op's
  // error, or the invalidated capture, is the answer.
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  // Same as above: what broke the capture is reported below, not left for
  // the backend's next launch check to find.
  static_cast<void>(cudaGetLastError());
  LaunchCount count;
  if (ran.ok() && ended == cudaSuccess && graph != nullptr) {
    st = CountNodes(graph, count);
  }
  if (graph != nullptr) {
    const cudaError_t destroyed = cudaGraphDestroy(graph);
    if (st.ok() && destroyed != cudaSuccess) {
      st = CudaError(destroyed, "cudaGraphDestroy");
    }
  }
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  error = cudaStreamIsCapturing(stream, &status);
  if (error != cudaSuccess) return CudaError(error, "cudaStreamIsCapturing");
  if (status != cudaStreamCaptureStatusNone) {
    return absl::InternalError("the op stream is still capturing");
  }
  if (!ran.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the op failed under stream capture: ", ran.message()));
  }
  if (ended != cudaSuccess) return CudaError(ended, "cudaStreamEndCapture");
  if (graph == nullptr) {
    return absl::InternalError("cudaStreamEndCapture: no graph");
  }
  if (!st.ok()) return st;
  return count;
}

}  // namespace mhc::bench
