// Pieces of the GPU benchmark's timing method that need a kernel on a CUDA
// backend's stream: the empty kernel that measures what an event-timed
// repetition costs when the op costs nothing, the spin that gives the host
// a head start, and a read-only L2 flush.
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common.cuh"
#include "mhc/cuda.h"
#include "mhc/cuda_tools.h"

namespace mhc {
namespace {

__global__ void empty_kernel() {}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spin_kernel(uint64_t ns) {
  const uint64_t start = GlobalTimerNs();
  while (GlobalTimerNs() - start < ns) {
  }
}

// Reads every 16 bytes of [p, p + words) once; stores only when the xor of
// everything read equals a value no fill produces in practice, which the
// compiler cannot rule out, so the loads stay and nothing is written.
__global__ void read_flush_kernel(const uint4* p, int64_t words,
                                  unsigned* sink) {
  unsigned acc = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < words; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u && sink != nullptr) *sink = acc;
}

absl::StatusOr<cudaStream_t> StreamOf(Backend& backend) {
  MHC_ASSIGN_OR_RETURN(void* stream, CudaOpStream(backend));
  return static_cast<cudaStream_t>(stream);
}

}  // namespace

absl::Status EnqueueCudaEmptyKernel(Backend& cuda_backend) {
  absl::StatusOr<cudaStream_t> stream = StreamOf(cuda_backend);
  if (!stream.ok()) return stream.status();
  empty_kernel<<<1, 32, 0, *stream>>>();
  MHC_CUDA_CHECK_LAUNCH("empty kernel", "");
  return absl::OkStatus();
}

absl::Status EnqueueCudaSpin(Backend& cuda_backend, double microseconds) {
  absl::StatusOr<cudaStream_t> stream = StreamOf(cuda_backend);
  if (!stream.ok()) return stream.status();
  spin_kernel<<<1, 1, 0, *stream>>>(static_cast<uint64_t>(microseconds * 1e3));
  MHC_CUDA_CHECK_LAUNCH("spin", absl::StrCat(microseconds, " us"));
  return absl::OkStatus();
}

absl::Status EnqueueCudaReadFlush(Backend& cuda_backend, const void* buffer,
                                  size_t bytes) {
  absl::StatusOr<cudaStream_t> stream = StreamOf(cuda_backend);
  if (!stream.ok()) return stream.status();
  const int64_t words = static_cast<int64_t>(bytes / sizeof(uint4));
  // Enough resident blocks to keep every SM of any current part streaming.
  read_flush_kernel<<<1024, 256, 0, *stream>>>(
      static_cast<const uint4*>(buffer), words, nullptr);
  MHC_CUDA_CHECK_LAUNCH("read flush", absl::StrCat(bytes, " bytes"));
  return absl::OkStatus();
}

}  // namespace mhc
