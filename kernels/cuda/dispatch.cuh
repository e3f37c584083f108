// Compile-time dispatch of the activation dtype and the stream shape. n = 2,
// 4 (the production case) and 8 get instantiations with n == NT and V
// channels per thread, vector or strided (primitives/row_access.cuh): 16-byte
// accesses, 8-byte ones at n = 8, where the post backward holds 2 x 8 streams
// of V channels. n = 16 gets them (8-byte accesses) in the kernels whose
// per-thread state grows with n alone (kStreamsLinear): a thread of the
// post's FFMA backward keeps NT^2 sums, which at 16 streams of V channels
// would spill. Every other case runs the generic path with runtime n and
// element accesses, at the smallest stream capacity that holds it (2, 4, 8
// or 16): capacity 16 for n = 2 would cost the post 272 registers' worth of
// local memory per thread.
#ifndef MHC_KERNELS_CUDA_DISPATCH_CUH_
#define MHC_KERNELS_CUDA_DISPATCH_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "common.cuh"
#include "mhc/types.h"

namespace mhc::cuda {

template <typename T>
struct TypeTag {
  using type = T;
};
template <int I>
using IntTag = std::integral_constant<int, I>;
template <bool B>
using BoolTag = std::integral_constant<bool, B>;

// f(BoolTag<b>).
template <typename F>
void DispatchBool(bool b, F&& f) {
  if (b) {
    f(BoolTag<true>{});
  } else {
    f(BoolTag<false>{});
  }
}

template <typename F>
void DispatchDType(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32:
      f(TypeTag<float>{});
      return;
    case DType::kF16:
      f(TypeTag<__half>{});
      return;
    case DType::kBF16:
      f(TypeTag<__nv_bfloat16>{});
      return;
  }
}

// Channels per thread of the vector path: one 16-byte access per stream.
inline int VectorWidth(DType dtype) {
  return 16 / static_cast<int>(DTypeSize(dtype));
}

// How the row kernels of one launch touch their activation rows
// (primitives/row_access.cuh).
enum class RowAccess { kElement, kVector, kStrided };

// For n = 2, 4, 8 and 16: vector accesses where C is a multiple of the
// vector width and every given activation tensor starts on 16 bytes, strided
// element accesses otherwise; element accesses for every other n (and for n =
// 16 in the kernels DispatchStreams does not build it for).
template <typename... P>
RowAccess ChooseRowAccess(const LayerSpec& spec, DType dtype, P... pointers) {
  const bool vector_n =
      spec.n == 2 || spec.n == 4 || spec.n == 8 || spec.n == 16;
  if (!vector_n) return RowAccess::kElement;
  if (spec.hidden % VectorWidth(dtype) == 0 &&
      (... && (pointers == nullptr || Aligned16(pointers)))) {
    return RowAccess::kVector;
  }
  return RowAccess::kStrided;
}

// Whether a row kernel's per-thread state grows with n alone, so that n = 16
// fits the vector and strided paths. kLinearWide: linear, and a kernel that
// reduces the streams of a channel to one value (the aggregate forward, the
// expand backward), light enough to take 16-byte accesses on aligned rows
// at n = 8 and 16 too (DispatchStreams' `wide`), where the others take
// 8-byte ones for their registers.
enum class StreamState { kQuadratic, kLinear, kLinearWide };

// Whether 16-byte accesses keep a row kernel's passes over the C channels
// full: at most a tenth of the thread slots idle in them. Where they do, the
// wider accesses measured faster; at a sixth idle (C = 2560) slower
// (docs/decisions.md).
inline bool WideStreams(int64_t hidden, DType dtype) {
  const int64_t per_pass = int64_t{kRowThreads} * VectorWidth(dtype);
  const int64_t passes = (hidden + per_pass - 1) / per_pass;
  return 10 * hidden >= 9 * passes * per_pass;
}

// f(TypeTag<T>, IntTag<NT>, IntTag<V>, BoolTag<kStrided>); NT == 4 means
// n == 4 exactly, and so does V > 1 for every NT. `wide` (kLinearWide only):
// the vector path's V is the full 16 bytes at n = 8 and 16 too.
template <StreamState kState = StreamState::kQuadratic, typename F>
void DispatchStreams(DType dtype, int n, RowAccess access, F&& f,
                     bool wide = false) {
  if (n == 16 && kState == StreamState::kQuadratic) {
    access = RowAccess::kElement;
  }
  DispatchDType(dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    constexpr int kV = 16 / sizeof(T);
    // n = 8 or kMaxStreams at V = kV / 2, or kV where `wide` allows.
    auto wide_or_half = [&](auto nt, auto strided) {
      if constexpr (kState == StreamState::kLinearWide &&
                    !decltype(strided)::value) {
        if (wide) {
          f(type_tag, nt, IntTag<kV>{}, strided);
          return;
        }
      }
      f(type_tag, nt, IntTag<kV / 2>{}, strided);
    };
    auto vector = [&](auto strided) {
      if (n == 4) {
        f(type_tag, IntTag<4>{}, IntTag<kV>{}, strided);
      } else if (n == 2) {
        f(type_tag, IntTag<2>{}, IntTag<kV>{}, strided);
      } else if (n == 8) {
        wide_or_half(IntTag<8>{}, strided);
      } else if constexpr (kState != StreamState::kQuadratic) {
        wide_or_half(IntTag<kMaxStreams>{}, strided);
      }
    };
    if (access == RowAccess::kVector) {
      vector(BoolTag<false>{});
    } else if (access == RowAccess::kStrided) {
      vector(BoolTag<true>{});
    } else if (n == 4) {
      f(type_tag, IntTag<4>{}, IntTag<1>{}, BoolTag<false>{});
    } else if (n <= 2) {
      f(type_tag, IntTag<2>{}, IntTag<1>{}, BoolTag<false>{});
    } else if (n <= 8) {
      f(type_tag, IntTag<8>{}, IntTag<1>{}, BoolTag<false>{});
    } else {
      f(type_tag, IntTag<kMaxStreams>{}, IntTag<1>{}, BoolTag<false>{});
    }
  });
}

// f(IntTag<NT>) for the per-token mixing kernels.
template <typename F>
void DispatchMix(int n, F&& f) {
  if (n == 4) {
    f(IntTag<4>{});
  } else {
    f(IntTag<kMaxStreams>{});
  }
}

inline std::string ShapeString(const LayerSpec& spec, int64_t tokens,
                               DType dtype) {
  return absl::StrCat("[M=", tokens, " n=", spec.n, " C=", spec.hidden, " ",
                      DTypeName(dtype), " ", LayoutName(spec.layout), "]");
}

inline unsigned GridSize(int64_t blocks) {
  return static_cast<unsigned>(blocks);
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_DISPATCH_CUH_
