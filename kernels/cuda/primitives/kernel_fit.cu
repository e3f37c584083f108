#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>

#include "primitives/kernel_fit.h"

namespace mhc::cuda {
namespace {

std::mutex fit_mu;
// (kernel, device) pairs with their attributes set.
std::set<std::pair<const void*, int>> prepared;
// (kernel, device, threads, smem) -> CTAs resident on the device.
std::map<std::tuple<const void*, int, int, size_t>, int64_t> resident_ctas;

cudaError_t SetAttributes(const void* kernel, int device) {
  int max_smem = 0;
  cudaError_t e = cudaDeviceGetAttribute(
      &max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e != cudaSuccess) return e;
  // The opt-in limit covers the kernel's static shared memory too.
  cudaFuncAttributes attributes;
  e = cudaFuncGetAttributes(&attributes, kernel);
  if (e != cudaSuccess) return e;
  e = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
      max_smem - static_cast<int>(attributes.sharedSizeBytes));
  if (e != cudaSuccess) return e;
  return cudaFuncSetAttribute(kernel,
                              cudaFuncAttributePreferredSharedMemoryCarveout,
                              cudaSharedmemCarveoutMaxShared);
}

cudaError_t CountResident(const void* kernel, int device, int threads,
                          size_t smem, int64_t* out) {
  int sms = 0, per_sm = 0;
  cudaError_t e =
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return e;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads,
                                                    smem);
  if (e != cudaSuccess) return e;
  *out = int64_t{sms} * (per_sm > 0 ? per_sm : 1);
  return cudaSuccess;
}

}  // namespace

cudaError_t FitLargeSmemKernel(const void* kernel, int threads, size_t smem,
                               int64_t* resident) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(fit_mu);
  if (prepared.count({kernel, device}) == 0) {
    e = SetAttributes(kernel, device);
    if (e != cudaSuccess) return e;
    prepared.insert({kernel, device});
  }
  if (resident == nullptr) return cudaSuccess;
  const auto key = std::make_tuple(kernel, device, threads, smem);
  auto it = resident_ctas.find(key);
  if (it == resident_ctas.end()) {
    int64_t count = 0;
    e = CountResident(kernel, device, threads, smem, &count);
    if (e != cudaSuccess) return e;
    it = resident_ctas.emplace(key, count).first;
  }
  *resident = it->second;
  return cudaSuccess;
}

}  // namespace mhc::cuda
