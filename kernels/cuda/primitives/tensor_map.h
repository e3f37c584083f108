// Tensor maps for the tensor copies of primitives/tma.cuh: a row-major
// [rows, cols] tensor read in boxes of box_rows x box_cols elements that
// land in wgmma's 128-byte swizzle (primitives/wgmma.cuh), elements past the
// tensor's end as zeros. Host code: the driver's encoder is looked up once.
#ifndef MHC_KERNELS_CUDA_PRIMITIVES_TENSOR_MAP_H_
#define MHC_KERNELS_CUDA_PRIMITIVES_TENSOR_MAP_H_

#include <cuda.h>

#include <cstdint>

namespace mhc::cuda {

// False where the driver has no encoder or the tensor does not fit a map:
// base off 16 bytes, rows (cols * esize bytes) off 16 bytes, coordinates
// past 32 bits, or a box row other than 128 bytes.
bool EncodeSwizzledRowTiles(const void* base, CUtensorMapDataType type,
                            int esize, int64_t cols, int64_t rows, int box_cols,
                            int box_rows, CUtensorMap* map);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PRIMITIVES_TENSOR_MAP_H_
