// Compile-time dispatch of the activation dtype and of the stream shape the
// row access plan (plans/row_access.h) picks for a row kernel. n = 2, 4
// (the production case) and 8 get instantiations with n == NT and V
// channels per thread, vector or strided (primitives/row_access.cuh):
// 16-byte accesses, 8-byte ones at n = 8, where the post backward holds
// 2 x 8 streams of V channels. n = 16 gets them (8-byte accesses) in the
// kernels whose per-thread state grows with n alone (StreamState): a thread
// of the post's FFMA backward keeps NT^2 sums, which at 16 streams of V
// channels would spill. Every other case runs the generic path with runtime
// n and element accesses, at the smallest stream capacity that holds it (2,
// 4, 8 or 16): capacity 16 for n = 2 would cost the post 272 registers'
// worth of local memory per thread.
#ifndef MHC_KERNELS_CUDA_DISPATCH_CUH_
#define MHC_KERNELS_CUDA_DISPATCH_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common.cuh"
#include "mhc/types.h"
#include "plans/row_access.h"
#include "plans/table.h"

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

static_assert(kRowThreads == kRowPlanThreads,
              "the row access plan counts the row kernels' threads");

// The row access plan (plans/row_access.h) of a launch of `kKernel` on
// these activation tensors.
template <RowKernel kKernel, typename... P>
RowAccessPlan RowAccessOf(const LayerSpec& spec, DType dtype, P... tensors) {
  return PlanRowAccess(kKernel, spec, dtype,
                       LeastAlignment({static_cast<const void*>(tensors)...}));
}

// f(TypeTag<T>, IntTag<NT>, IntTag<V>, BoolTag<kStrided>, BoolTag<kStaged>)
// with the plan's stream count NT and channels V: NT == 4 means n == 4
// exactly, and so does V > 1 for every NT; kStaged, strided rows the plan
// stages. Builds, per dtype, the shapes the plan gives
// `kKernel`: the vector and strided paths at n = 2, 4, 8 and (not for
// kQuadratic kernels) 16, at n = 8 and 16 with 8-byte accesses, or 16-byte
// ones on the vector path of kLinearWide kernels; the element path at every
// stream capacity. False, with nothing launched, for a shape not built.
template <RowKernel kKernel, typename F>
bool DispatchRows(DType dtype, const RowAccessPlan& plan, F&& f) {
  constexpr StreamState kState = StateOf(kKernel);
  bool built = false;
  DispatchDType(dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    constexpr int kV = 16 / sizeof(T);
    auto run = [&](auto nt, auto vt, auto strided) {
      if (decltype(vt)::value != plan.channels) return;
      if constexpr (decltype(strided)::value && StagesRows(kKernel) &&
                    sizeof(T) == 2) {
        if (plan.staged) {
          f(type_tag, nt, vt, strided, BoolTag<true>{});
          built = true;
          return;
        }
      }
      f(type_tag, nt, vt, strided, BoolTag<false>{});
      built = true;
    };
    auto half_or_wide = [&](auto nt, auto strided) {
      if constexpr (kState == StreamState::kLinearWide &&
                    !decltype(strided)::value) {
        if (plan.channels == kV) {
          run(nt, IntTag<kV>{}, strided);
          return;
        }
      }
      run(nt, IntTag<kV / 2>{}, strided);
    };
    auto vector = [&](auto strided) {
      switch (plan.streams) {
        case 4:
          run(IntTag<4>{}, IntTag<kV>{}, strided);
          return;
        case 2:
          run(IntTag<2>{}, IntTag<kV>{}, strided);
          return;
        case 8:
          half_or_wide(IntTag<8>{}, strided);
          return;
        case kMaxStreams:
          if constexpr (kState != StreamState::kQuadratic) {
            half_or_wide(IntTag<kMaxStreams>{}, strided);
          }
          return;
      }
    };
    auto element = [&](auto nt) { run(nt, IntTag<1>{}, BoolTag<false>{}); };
    switch (plan.access) {
      case RowAccess::kVector:
        vector(BoolTag<false>{});
        return;
      case RowAccess::kStrided:
        vector(BoolTag<true>{});
        return;
      case RowAccess::kElement:
        switch (plan.streams) {
          case 4:
            element(IntTag<4>{});
            return;
          case 2:
            element(IntTag<2>{});
            return;
          case 8:
            element(IntTag<8>{});
            return;
          case kMaxStreams:
            element(IntTag<kMaxStreams>{});
            return;
        }
    }
  });
  return built;
}

// What a row kernel's launcher returns where DispatchRows built nothing.
inline absl::Status NoRowKernel(absl::string_view op, const LaunchShape& shape,
                                const RowAccessPlan& plan) {
  return absl::InternalError(
      absl::StrCat("cuda ", op, " ", ShapeText(shape), ": no kernel built for ",
                   ToString(plan.access), " rows of ", plan.streams,
                   " streams x ", plan.channels, " channels"));
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

inline unsigned GridSize(int64_t blocks) {
  return static_cast<unsigned>(blocks);
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_DISPATCH_CUH_
