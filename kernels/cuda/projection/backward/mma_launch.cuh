// The launch of the tensor-core dx / dphi kernel (mma.cuh): the tensor maps
// of its tensor-copy build, the small-batch split of dx and dphi, and the
// build per logit tiles, precision, copy mode and terms. mma_bf16 / _f16 /
// _f32.cu instantiate it once per activation dtype.
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MMA_LAUNCH_CUH_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MMA_LAUNCH_CUH_

#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "dispatch.cuh"
#include "primitives/kernel_fit.h"
#include "primitives/tensor_map.h"
#include "primitives/wgmma.cuh"
#include "projection/backward/mma.cuh"
#include "projection/backward/mma_tiles.cuh"
#include "projection/geometry.h"
#include "projection/run_maps.h"

namespace mhc::cuda::dx_mma {

static_assert(kTileAlignBytes == kSwizzleAtomBytes,
              "the plan's alignment atom is AtomAligned's");
static_assert(kTokenChunk % proj::kDxApartTokens == 0 &&
                  proj::kDxStageTokens == kStageTokens,
              "stages tile every dx chunk");

// The float runs of the summed build's maps (dh, dms, H_pre, R: a box of a
// stage's rows each), for either copy build.
template <typename Maps>
bool EncodeDxFloatRuns(const DevSpec& s, int64_t tokens, const MmaDxDev& d,
                       Maps* maps) {
  const CUtensorMapDataType f32 = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  constexpr CUtensorMapSwizzle kPlain = CU_TENSOR_MAP_SWIZZLE_NONE;
  auto run = [&](const float* base, int width, CUtensorMap* map) {
    const int64_t dims[2] = {width, tokens};
    const int64_t strides[1] = {int64_t{width} * 4};
    const int box[2] = {width, kStageTokens};
    return EncodeTiledMap(base, f32, 2, dims, strides, box, kPlain, map);
  };
  const int64_t dms_dims[1] = {tokens};
  const int dms_box[1] = {kStageTokens};
  return run(d.dh, s.N, &maps->dh) && run(d.h_pre, 4, &maps->h_pre) &&
         run(d.r, 16, &maps->r) &&
         EncodeTiledMap(d.dms, f32, 1, dms_dims, nullptr, dms_box, kPlain,
                        &maps->dms);
}

// The summed build's maps (mma_tiles.cuh) for 16-bit vector rows and runs on
// 16 bytes; false where the driver has no encoder.
inline bool EncodeDxTensorMaps(const DevSpec& s, int64_t tokens, const void* x,
                               const MmaDxDev& d, DxTensorMaps* maps) {
  if (s.n != 4 || s.minor || s.N != kSummedLogits) return false;
  const CUtensorMapDataType act = CU_TENSOR_MAP_DATA_TYPE_UINT16;
  constexpr CUtensorMapSwizzle kPlain = CU_TENSOR_MAP_SWIZZLE_NONE;
  const int wc = kCols / 4;
  // {channels, tokens, streams}: a stream's run of a token is its innermost
  // box row, so the tile lands stream by stream.
  const int64_t tile_dims[3] = {s.C, tokens, 4};
  const int64_t tile_strides[2] = {s.K * 2, s.C * 2};
  const int tile_box[3] = {wc, kStageTokens, 4};
  const int64_t dy_dims[2] = {s.C, tokens};
  const int64_t dy_strides[1] = {s.C * 2};
  const int dy_box[2] = {wc, kStageTokens};
  return EncodeTiledMap(x, act, 3, tile_dims, tile_strides, tile_box,
                        CU_TENSOR_MAP_SWIZZLE_64B, &maps->x) &&
         EncodeTiledMap(d.dx_next, act, 3, tile_dims, tile_strides, tile_box,
                        CU_TENSOR_MAP_SWIZZLE_64B, &maps->dx_next) &&
         EncodeTiledMap(d.dy, act, 2, dy_dims, dy_strides, dy_box, kPlain,
                        &maps->dy) &&
         EncodeDxFloatRuns(s, tokens, d, maps);
}

// The run-map build's maps (projection/run_maps.h): a map per residue of
// the rows of x and dx_next (4 C wide) and of dy (C wide); false where the
// driver has no encoder.
inline bool EncodeDxRunMaps(const DevSpec& s, int64_t tokens, const void* x,
                            const MmaDxDev& d, DxRunMaps* maps) {
  const int gx = proj::DxRowGroup(s.K), gy = proj::DxRowGroup(s.C);
  if (s.n != 4 || s.minor || s.N != kSummedLogits || gx > kMaxActGroup ||
      gy > kMaxDyGroup || tokens < proj::kDxRunMapMinTokens) {
    return false;
  }
  auto residue = [&](const void* base, int64_t width, int group, int r,
                     CUtensorMap* map) {
    const proj::DxRunMap m = proj::DxRunMapOf(tokens, width, group, r);
    const int64_t dims[2] = {m.inner, m.rows};
    const int64_t strides[1] = {m.stride_bytes};
    const int box[2] = {proj::kDxLandElems, kStageTokens / group};
    return EncodeTiledMap(base, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, dims,
                          strides, box, CU_TENSOR_MAP_SWIZZLE_NONE, map);
  };
  for (int r = 0; r < gx; ++r) {
    if (!residue(x, s.K, gx, r, &maps->x[r]) ||
        !residue(d.dx_next, s.K, gx, r, &maps->dx_next[r])) {
      return false;
    }
  }
  for (int r = 0; r < gy; ++r) {
    if (!residue(d.dy, s.C, gy, r, &maps->dy[r])) return false;
  }
  return EncodeDxFloatRuns(s, tokens, d, maps);
}

// A CTA walks its token chunk in order, which fixes each column's dphi sum,
// so a small batch leaves most SMs idle. With the plan's dx_apart_tokens the
// launch runs dphi alone (the same walk and bits, without the dx epilogue),
// then dx alone over chunks of that many tokens (a token's dx never depends
// on its chunk). dphi goes first: it reads x, which dx may overwrite.
template <typename T, int NT, bool kIeee, bool kVectorRows, bool kTerms>
cudaError_t LaunchTyped(const DevSpec& s, int64_t tokens, const void* x,
                        const MmaDxDev& d, cudaStream_t stream) {
  // Two CTAs per SM (up to 24 logits) need nearly all of its shared memory.
  const int wc = kCols / s.n;
  const unsigned columns = GridSize((s.C + wc - 1) / wc);
  auto launch = [&](MmaDxDev dev, int chunk) {
    dev.token_chunk = chunk;
    const dim3 grid(columns, GridSize((tokens + chunk - 1) / chunk));
    // The build of (summed terms, tensor copies, run maps) with its maps.
    auto with = [&](auto summed_tag, auto tensor_tag, auto run_tag,
                    const auto& maps) {
      constexpr bool kSummed = decltype(summed_tag)::value;
      constexpr bool kTensor = decltype(tensor_tag)::value;
      constexpr bool kRun = decltype(run_tag)::value;
      const SmemPlan plan = PlanSmem<T, kSummed, kTensor, kRun>(
          s.n, s.N, kIeee, dev.h_pre != nullptr, dev.r != nullptr);
      return LaunchLargeSmem(dx_dphi_mma_kernel<T, NT, kIeee, kVectorRows,
                                                kTerms, kSummed, kTensor, kRun>,
                             grid, kThreads, plan.total, stream, s, tokens,
                             static_cast<const T*>(x), dev, maps);
    };
    const std::false_type no;
    const std::true_type yes;
    if constexpr (NT == 3 && kTerms && sizeof(T) == 2) {
      // Not the dphi-only launch of dx apart, which stages no terms. Every
      // tensor of these builds is on 16 bytes, so only a driver without the
      // encoder (which cannot run these kernels either) fails the maps.
      if (proj::DxSumsTerms(s.n, !s.minor, dev.h_pre != nullptr,
                            dev.r != nullptr)) {
        if constexpr (kVectorRows) {
          if (dev.runs16) {
            DxTensorMaps maps{};
            if (!EncodeDxTensorMaps(s, tokens, x, dev, &maps)) {
              return cudaErrorNotSupported;
            }
            return with(yes, yes, no, maps);
          }
        } else if (dev.copy == RowCopy::kRunMaps) {
          DxRunMaps maps{};
          if (!EncodeDxRunMaps(s, tokens, x, dev, &maps)) {
            return cudaErrorNotSupported;
          }
          return with(yes, no, yes, maps);
        }
      }
    }
    // The run maps come with the summed terms; without them the same rows
    // go through the slots (the plan picks run maps only where they can).
    if (dev.copy == RowCopy::kRunMaps) dev.copy = RowCopy::kSlots;
    const DxTensorMaps none{};
    if constexpr (NT == 3 && kTerms) {
      if (proj::DxSumsTerms(s.n, !s.minor, dev.h_pre != nullptr,
                            dev.r != nullptr)) {
        return with(yes, no, no, none);
      }
    }
    return with(no, no, no, none);
  };
  if (d.apart_tokens == 0 || d.dphi_partial == nullptr) {
    return launch(d, kTokenChunk);
  }
  MmaDxDev dphi = d;
  dphi.h_pre = nullptr;
  dphi.dy = nullptr;
  dphi.r = nullptr;
  dphi.dx_next = nullptr;
  dphi.skip_dx = true;
  const cudaError_t e = launch(dphi, kTokenChunk);
  if (e != cudaSuccess) return e;
  MmaDxDev dx = d;
  dx.dphi_partial = nullptr;
  return launch(dx, d.apart_tokens);
}

// The kernel built for T, its logit tiles, precision, copy mode and terms.
template <typename T>
cudaError_t LaunchDxMmaFor(const DevSpec& s, int64_t tokens, const void* x,
                           const MmaDxDev& d, bool ieee, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  auto go = [&](auto nt_tag) {
    DispatchBool(ieee, [&](auto ieee_tag) {
      auto launch = [&](auto vector_tag, auto terms_tag) {
        err = LaunchTyped<T, decltype(nt_tag)::value, decltype(ieee_tag)::value,
                          decltype(vector_tag)::value,
                          decltype(terms_tag)::value>(s, tokens, x, d, stream);
      };
      if (d.copy == RowCopy::kVector) {
        launch(std::true_type{}, std::true_type{});
      } else {
        DispatchBool(d.h_pre != nullptr || d.r != nullptr, [&](auto terms_tag) {
          launch(std::false_type{}, terms_tag);
        });
      }
    });
  };
  switch (TilesFor(s.N)) {
    case 1:
      go(IntTag<1>{});
      break;
    case 3:
      go(IntTag<3>{});
      break;
    default:
      go(IntTag<kMaxTiles>{});
  }
  return err;
}

}  // namespace mhc::cuda::dx_mma

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MMA_LAUNCH_CUH_
