// Selection and launch of the tensor-core dx / dphi kernel
// (projection_backward_mma.cuh): which layers and requests it takes, how
// its activation rows are copied, and the build of the request's dtype.
#include <cstdint>

#include "common.cuh"
#include "dispatch.cuh"
#include "launch.h"
#include "projection_backward_tiles.cuh"

namespace mhc::cuda {

using namespace dx_mma;  // NOLINT: this file launches the kernel of those tiles

namespace {

// Vector rows where every staged row segment is 16-byte aligned (whole
// vectors per channel run, C and the CTA width, and aligned bases); slots
// where tensors are aligned to their elements and, for 16-bit stream-major
// tiles, the row pad holds a word per stream run; element copies otherwise.
RowCopy ChooseRowCopy(const DxArgs& a, const DevSpec& s) {
  const int width = VectorWidth(a.act_dtype);
  const bool aligned16 = Aligned16(a.x) && Aligned16(a.dx) &&
                         (a.dy == nullptr || Aligned16(a.dy)) &&
                         (a.dx_next == nullptr || Aligned16(a.dx_next));
  if (s.C % width == 0 && (kCols / s.n) % width == 0 && aligned16) {
    return RowCopy::kVector;
  }
  const size_t esize = DTypeSize(a.act_dtype);
  auto element_aligned = [&](const void* p) {
    return p == nullptr || reinterpret_cast<uintptr_t>(p) % esize == 0;
  };
  const bool runs_fit =
      s.minor || esize == 4 || s.n <= PadRuns<__half>(TilesFor(s.N));
  return element_aligned(a.x) && element_aligned(a.dy) &&
                 element_aligned(a.dx_next) && runs_fit
             ? RowCopy::kSlots
             : RowCopy::kElements;
}

}  // namespace

bool MmaDxSuitsLayer(const LayerSpec& spec) {
  // Whole channels per CTA: 128 / n columns of each stream.
  const int n = spec.n;
  const bool pow2 = n >= 1 && n <= 16 && (n & (n - 1)) == 0;
  return spec.dynamic && pow2 && spec.NumLogits() <= kMaxTiles * 8;
}

bool UseMmaDx(const DxArgs& a) {
  const LayerSpec& spec = *a.spec;
  const int n = spec.n;
  const int N = static_cast<int>(spec.NumLogits());
  // The offsets of a stage's elements from its first row fit an int.
  if (a.dh == nullptr || !MmaDxSuitsLayer(spec) ||
      spec.K() > INT32_MAX / kStageTokens) {
    return false;
  }
  // fp32 tiles with both extra terms at n = 1 and n = 8 outgrow one SM's
  // memory.
  const bool ieee = spec.matmul_precision == MatmulPrecision::kIeee;
  const bool aggregate = a.h_pre != nullptr, residual = a.r != nullptr;
  int bytes = 0;
  DispatchDType(a.act_dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    bytes = PlanSmem<T>(n, N, ieee, aggregate, residual).total;
  });
  return bytes <= kMaxSmemPerBlock;
}

absl::Status LaunchMmaDxAndPhiPartials(const DxArgs& a, cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*a.spec);
  const MmaDxDev d{a.phi,
                   s.has_gamma ? a.gamma : nullptr,
                   a.dh,
                   a.dms,
                   a.h_pre,
                   a.dy,
                   a.r,
                   a.dx_next,
                   a.dx,
                   a.dphi_partial,
                   ChooseRowCopy(a, s),
                   Aligned16(a.dh) && Aligned16(a.dms) &&
                       (a.h_pre == nullptr || Aligned16(a.h_pre)) &&
                       (a.r == nullptr || Aligned16(a.r))};
  const bool ieee = a.spec->matmul_precision == MatmulPrecision::kIeee;
  cudaError_t err = cudaSuccess;
  DispatchDType(a.act_dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    err = LaunchDxMmaFor<T>(s, a.tokens, a.x, d, ieee, stream);
  });
  MHC_CUDA_RETURN_IF_ERROR(err, "dx (mma)",
                           ShapeString(*a.spec, a.tokens, a.act_dtype));
  return absl::OkStatus();
}

}  // namespace mhc::cuda
