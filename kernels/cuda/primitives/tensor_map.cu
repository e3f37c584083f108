// The driver's tensor-map encoder, looked up through the runtime so that
// the static runtime needs no link-time libcuda.
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <climits>

#include "primitives/tensor_map.h"

namespace mhc::cuda {

bool EncodeTiledMap(const void* base, CUtensorMapDataType type, int rank,
                    const int64_t* dims, const int64_t* strides, const int* box,
                    CUtensorMapSwizzle swizzle, CUtensorMap* map,
                    CUtensorMapL2promotion promotion) {
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
  constexpr int kMaxRank = 5;
  if (encode == nullptr || rank < 1 || rank > kMaxRank ||
      reinterpret_cast<uintptr_t>(base) % 16 != 0) {
    return false;
  }
  cuuint64_t d[kMaxRank], st[kMaxRank];
  cuuint32_t b[kMaxRank], steps[kMaxRank];
  for (int i = 0; i < rank; ++i) {
    if (dims[i] < 1 || dims[i] >= INT32_MAX || box[i] < 1) return false;
    if (i + 1 < rank && (strides[i] <= 0 || strides[i] % 16 != 0)) {
      return false;
    }
    d[i] = static_cast<cuuint64_t>(dims[i]);
    if (i + 1 < rank) st[i] = static_cast<cuuint64_t>(strides[i]);
    b[i] = static_cast<cuuint32_t>(box[i]);
    steps[i] = 1;
  }
  return encode(map, type, static_cast<cuuint32_t>(rank),
                const_cast<void*>(base), d, st, b, steps,
                CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, promotion,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

bool EncodeSwizzledRowTiles(const void* base, CUtensorMapDataType type,
                            int esize, int64_t cols, int64_t rows, int box_cols,
                            int box_rows, CUtensorMap* map) {
  if (box_cols * esize != 128) return false;
  const int64_t dims[2] = {cols, rows};
  const int64_t strides[1] = {cols * esize};
  const int box[2] = {box_cols, box_rows};
  return EncodeTiledMap(base, type, 2, dims, strides, box,
                        CU_TENSOR_MAP_SWIZZLE_128B, map);
}

}  // namespace mhc::cuda
