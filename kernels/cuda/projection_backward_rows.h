// The projection backward of n = 4 layers on warpgroup mmas with dx rows
// stored from the accumulators (projection_backward_rows.cu): dx and the
// per-chunk dphi partials of dynamic, stream-major layers with 16-bit
// activations under TF32, their rows on 16 bytes, without the fused pre
// backward's terms. LaunchDxAndPhiPartials takes it before the mma.sync
// kernel, which covers every request this one does.
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_ROWS_H_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_ROWS_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "launch.h"

namespace mhc::cuda {

bool UseRowsWgmmaDx(const DxArgs& a);
absl::Status LaunchRowsWgmmaDxAndPhiPartials(const DxArgs& a,
                                             cudaStream_t stream);

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_ROWS_H_
