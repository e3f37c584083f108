// Tensor maps for the tensor copies of primitives/tma.cuh. Host code: the
// driver's encoder is looked up once.
#ifndef MHC_KERNELS_CUDA_PRIMITIVES_TENSOR_MAP_H_
#define MHC_KERNELS_CUDA_PRIMITIVES_TENSOR_MAP_H_

#include <cuda.h>

#include <cstdint>

namespace mhc::cuda {

// A tensor of `rank` (1 to 5) dimensions, dims[0] innermost and contiguous,
// read in boxes of box[] elements that land densely in shared memory (in the
// swizzle asked for), elements past the tensor's end as zeros. strides[i]
// is the byte step of dimension i + 1; `promotion` the L2's fill size for
// the copies. False where the driver has no encoder or the tensor does not
// fit a map: base or a stride off 16 bytes, a dimension past 32 bits, or a
// box the driver refuses.
bool EncodeTiledMap(
    const void* base, CUtensorMapDataType type, int rank, const int64_t* dims,
    const int64_t* strides, const int* box, CUtensorMapSwizzle swizzle,
    CUtensorMap* map,
    CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B);

// A row-major [rows, cols] tensor read in boxes of box_rows x box_cols
// elements that land in wgmma's 128-byte swizzle (primitives/wgmma.cuh):
// as EncodeTiledMap, and false for a box row other than 128 bytes.
bool EncodeSwizzledRowTiles(const void* base, CUtensorMapDataType type,
                            int esize, int64_t cols, int64_t rows, int box_cols,
                            int box_rows, CUtensorMap* map);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PRIMITIVES_TENSOR_MAP_H_
