// The device's copy bandwidth: the roofline denominator
// (bytes read plus written by a large device-to-device copy), measured once
// when a daemon starts serving the device.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common.cuh"
#include "mhc/cuda_tools.h"

namespace mhc {
namespace {

constexpr size_t kCopyBytes = size_t{256} << 20;  // well past any L2
constexpr int kRepeats = 5;

// Frees what it holds on every path, so an error leaks nothing.
struct CopyScratch {
  void* src = nullptr;
  void* dst = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  ~CopyScratch() {
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
    if (src != nullptr) cudaFree(src);
    if (dst != nullptr) cudaFree(dst);
  }
};

}  // namespace

absl::StatusOr<double> MeasureCudaCopyBandwidth(int device) {
  const std::string what = absl::StrCat("device ", device);
  constexpr const char* kOp = "copy bandwidth";
  MHC_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), kOp, what);
  CopyScratch s;
  MHC_CUDA_RETURN_IF_ERROR(cudaMalloc(&s.src, kCopyBytes), kOp, what);
  MHC_CUDA_RETURN_IF_ERROR(cudaMalloc(&s.dst, kCopyBytes), kOp, what);
  MHC_CUDA_RETURN_IF_ERROR(cudaMemset(s.src, 0x5a, kCopyBytes), kOp, what);
  MHC_CUDA_RETURN_IF_ERROR(cudaEventCreate(&s.start), kOp, what);
  MHC_CUDA_RETURN_IF_ERROR(cudaEventCreate(&s.stop), kOp, what);
  float best_ms = 0;
  for (int i = 0; i <= kRepeats; ++i) {  // the first copy only warms up
    MHC_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.start), kOp, what);
    MHC_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(s.dst, s.src, kCopyBytes, cudaMemcpyDeviceToDevice),
        kOp, what);
    MHC_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.stop), kOp, what);
    MHC_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(s.stop), kOp, what);
    float ms = 0;
    MHC_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, s.start, s.stop), kOp,
                             what);
    if (i > 0) best_ms = best_ms == 0 ? ms : std::min(best_ms, ms);
  }
  return 2.0 * static_cast<double>(kCopyBytes) / (best_ms * 1e-3);
}

}  // namespace mhc
