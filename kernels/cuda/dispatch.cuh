// Compile-time dispatch of the activation dtype and the stream shape. n = 2,
// 4 (the production case) and 8 get vector instantiations with n == NT when
// the rows are aligned: 16-byte accesses, 8-byte ones at n = 8, where the
// post backward holds 2 x 8 streams of V channels. Every other case runs the
// generic path with runtime n and element accesses, at the smallest stream
// capacity that holds it (2, 4, 8 or 16): the row kernels keep NT + NT^2
// per-thread sums, so capacity 16 for n = 2 would cost 272 registers' worth
// of local memory per thread.
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

// True when every given activation row of the op may use vector accesses.
template <typename... P>
bool CanVectorize(const LayerSpec& spec, DType dtype, P... pointers) {
  const bool vector_n = spec.n == 2 || spec.n == 4 || spec.n == 8;
  if (!vector_n || spec.hidden % VectorWidth(dtype) != 0) return false;
  return (... && (pointers == nullptr || Aligned16(pointers)));
}

// f(TypeTag<T>, IntTag<NT>, IntTag<V>); NT == 4 means n == 4 exactly, and
// so does V > 1 for every NT.
template <typename F>
void DispatchStreams(DType dtype, int n, bool vec, F&& f) {
  DispatchDType(dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    constexpr int kV = 16 / sizeof(T);
    if (vec && n == 4) {
      f(type_tag, IntTag<4>{}, IntTag<kV>{});
    } else if (vec && n == 2) {
      f(type_tag, IntTag<2>{}, IntTag<kV>{});
    } else if (vec && n == 8) {
      f(type_tag, IntTag<8>{}, IntTag<kV / 2>{});
    } else if (n == 4) {
      f(type_tag, IntTag<4>{}, IntTag<1>{});
    } else if (n <= 2) {
      f(type_tag, IntTag<2>{}, IntTag<1>{});
    } else if (n <= 8) {
      f(type_tag, IntTag<8>{}, IntTag<1>{});
    } else {
      f(type_tag, IntTag<kMaxStreams>{}, IntTag<1>{});
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
