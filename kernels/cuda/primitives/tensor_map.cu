// The driver's tensor-map encoder, looked up through the runtime so that
// the static runtime needs no link-time libcuda.
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <climits>

#include "primitives/tensor_map.h"

namespace mhc::cuda {

bool EncodeSwizzledRowTiles(const void* base, CUtensorMapDataType type,
                            int esize, int64_t cols, int64_t rows, int box_cols,
                            int box_rows, CUtensorMap* map) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                         cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  const auto address = reinterpret_cast<uintptr_t>(base);
  if (encode == nullptr || address % 16 != 0 || (cols * esize) % 16 != 0 ||
      cols >= INT32_MAX || rows >= INT32_MAX || box_cols * esize != 128) {
    return false;
  }
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols),
                              static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * esize};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols),
                             static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t steps[2] = {1, 1};
  return encode(map, type, 2, const_cast<void*>(base), dims, strides, box,
                steps, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace mhc::cuda
