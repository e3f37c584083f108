// The CUDA backend (kernels/cuda), built only when CUDA is enabled
// (MHC_HAVE_CUDA is then defined for every user of mhc_kernels).
#ifndef MHC_CUDA_H_
#define MHC_CUDA_H_

#include <memory>

#include "absl/status/statusor.h"
#include "mhc/backend.h"

namespace mhc {

// Number of usable CUDA devices; 0 when there is no driver or no GPU. Never
// crashes or aborts.
int CudaDeviceCount();

// A backend that owns one stream on `device`. Pointers given to its ops are
// device memory from Allocate (or any device allocation on that device).
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device);

// Bytes read plus written per second by a 256 MiB device-to-device copy on
// `device`, best of a few: the roofline denominator. Takes tens of ms.
absl::StatusOr<double> MeasureCudaCopyBandwidth(int device);

}  // namespace mhc

#endif  // MHC_CUDA_H_
