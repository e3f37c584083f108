// The kernel plans of the op families besides the projection (scale,
// Sinkhorn, row access, post, fused) on the host: every row's example reaches
// its row, every variant has a row, no plan reads M, and a grid of layers,
// dtypes and alignments takes the kernels the launchers' inline choices took
// before the plans existed (transcribed below). No GPU needed.
#include <cfloat>
#include <cstdint>
#include <initializer_list>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "plans/fused.h"
#include "plans/post.h"
#include "plans/row_access.h"
#include "plans/scale.h"
#include "plans/sinkhorn.h"
#include "projection/plan.h"

namespace mhc::cuda {
namespace {

// Batch invariance: a variant may depend on the layer, the dtype and the
// alignment, never on M. These plans take no token count at all; a change
// that gives them one has to face this test.
static_assert(
    std::is_same_v<decltype(&PlanScale), ScalePlan (*)(const LayerSpec&, int)>);
static_assert(std::is_same_v<decltype(&PlanSinkhornForward),
                             SinkhornPlan (*)(const LayerSpec&, int)>);
static_assert(std::is_same_v<decltype(&PlanSinkhornBackward),
                             SinkhornPlan (*)(const LayerSpec&, int)>);
static_assert(
    std::is_same_v<decltype(&PlanRowAccess),
                   RowAccessPlan (*)(RowKernel, const LayerSpec&, DType, int)>);
static_assert(
    std::is_same_v<decltype(&PlanPost), PostPlan (*)(const LayerSpec&, DType,
                                                     const PostAlignment&)>);
static_assert(std::is_same_v<decltype(&PlanFusedForward),
                             FusedPlan (*)(const LayerSpec&)>);
static_assert(std::is_same_v<decltype(&PlanFusedBackward),
                             FusedPlan (*)(const LayerSpec&)>);

constexpr DType kDtypes[] = {DType::kF32, DType::kF16, DType::kBF16};
constexpr int kAlignments[] = {1, 2, 4, 8, 16};
constexpr int64_t kHiddens[] = {1, 7, 8, 16, 255, 256, 520, 2560, 4096, 5129};
constexpr RowKernel kRowKernels[] = {RowKernel::kAggregateForward,
                                     RowKernel::kAggregateBackward,
                                     RowKernel::kExpandForward,
                                     RowKernel::kExpandBackward,
                                     RowKernel::kPost,
                                     RowKernel::kPre};

template <typename Row>
std::set<std::string> VariantNames(const std::vector<Row>& rows) {
  std::set<std::string> names;
  for (const Row& row : rows) names.insert(std::string(ToString(row.variant)));
  return names;
}

std::string Describe(const LayerSpec& s, DType dtype, int alignment) {
  return absl::StrCat(s.kind == LayerKind::kHead ? "HEAD" : "mHC", " n=", s.n,
                      " C=", s.hidden, " ", DTypeName(dtype), " ",
                      LayoutName(s.layout), " T=", s.sinkhorn_iterations,
                      s.sinkhorn_mode == SinkhornMode::kLog ? " LOG" : "",
                      " eps_sk=", s.eps_sk, s.dynamic ? "" : " static",
                      " aligned ", alignment);
}

// ---- Every row reachable, every variant a row.

TEST(KernelPlans, EveryScaleRowReachesItsVariant) {
  const auto& rows = ScaleRows();
  ASSERT_EQ(rows.size(), size_t{kNumScaleVariants});
  EXPECT_EQ(VariantNames(rows).size(), size_t{kNumScaleVariants});
  for (size_t i = 0; i < rows.size(); ++i) {
    const LayerExample& e = rows[i].example;
    const ScalePlan plan = PlanScale(e.Spec(), e.alignment);
    EXPECT_EQ(plan.row, static_cast<int>(i)) << rows[i].when;
    EXPECT_EQ(plan.variant, rows[i].variant) << rows[i].when;
  }
}

TEST(KernelPlans, EverySinkhornRowReachesItsVariant) {
  const auto& rows = SinkhornRows();
  ASSERT_EQ(rows.size(), size_t{kNumSinkhornVariants});
  EXPECT_EQ(VariantNames(rows).size(), size_t{kNumSinkhornVariants});
  for (size_t i = 0; i < rows.size(); ++i) {
    const LayerExample& e = rows[i].example;
    for (const SinkhornPlan& plan :
         {PlanSinkhornForward(e.Spec(), e.alignment),
          PlanSinkhornBackward(e.Spec(), e.alignment)}) {
      EXPECT_EQ(plan.row, static_cast<int>(i)) << rows[i].when;
      EXPECT_EQ(plan.variant, rows[i].variant) << rows[i].when;
    }
  }
}

TEST(KernelPlans, EveryRowAccessRowReachesItsVariant) {
  const auto& rows = RowAccessRows();
  ASSERT_EQ(rows.size(), size_t{kNumRowAccesses});
  EXPECT_EQ(VariantNames(rows).size(), size_t{kNumRowAccesses});
  for (size_t i = 0; i < rows.size(); ++i) {
    const LayerExample& e = rows[i].example;
    for (RowKernel kernel : kRowKernels) {
      const RowAccessPlan plan =
          PlanRowAccess(kernel, e.Spec(), e.dtype, e.alignment);
      EXPECT_EQ(plan.row, static_cast<int>(i)) << rows[i].when;
      EXPECT_EQ(plan.access, rows[i].variant) << rows[i].when;
    }
  }
}

TEST(KernelPlans, EveryPostRowReachesItsVariant) {
  const auto& rows = PostRows();
  ASSERT_EQ(rows.size(), size_t{kNumPostVariants});
  EXPECT_EQ(VariantNames(rows).size(), size_t{kNumPostVariants});
  for (size_t i = 0; i < rows.size(); ++i) {
    const LayerExample& e = rows[i].example;
    PostAlignment alignment;
    alignment.rows = e.alignment;
    const PostPlan plan = PlanPost(e.Spec(), e.dtype, alignment);
    EXPECT_EQ(plan.row, static_cast<int>(i)) << rows[i].when;
    EXPECT_EQ(plan.variant, rows[i].variant) << rows[i].when;
  }
}

TEST(KernelPlans, EveryFusedRowReachesItsVariant) {
  const auto& forward = FusedForwardRows();
  const auto& backward = FusedBackwardRows();
  // The static forward has no backward counterpart: a static layer's
  // backward mixes as the others do.
  EXPECT_EQ(VariantNames(forward).size(), size_t{kNumFusedVariants});
  EXPECT_EQ(forward.size(), size_t{kNumFusedVariants});
  EXPECT_EQ(backward.size(), size_t{kNumFusedVariants - 1});
  for (size_t i = 0; i < forward.size(); ++i) {
    const FusedPlan plan = PlanFusedForward(forward[i].example.Spec());
    EXPECT_EQ(plan.row, static_cast<int>(i)) << forward[i].when;
    EXPECT_EQ(plan.variant, forward[i].variant) << forward[i].when;
  }
  for (size_t i = 0; i < backward.size(); ++i) {
    const FusedPlan plan = PlanFusedBackward(backward[i].example.Spec());
    EXPECT_EQ(plan.row, static_cast<int>(i)) << backward[i].when;
    EXPECT_EQ(plan.variant, backward[i].variant) << backward[i].when;
  }
}

TEST(KernelPlans, VariantNamesAreKnown) {
  for (const auto& names :
       {VariantNames(ScaleRows()), VariantNames(SinkhornRows()),
        VariantNames(RowAccessRows()), VariantNames(PostRows()),
        VariantNames(FusedForwardRows()), VariantNames(FusedBackwardRows())}) {
    EXPECT_EQ(names.count("unknown"), 0u);
    EXPECT_EQ(names.count(""), 0u);
  }
}

// The projection plan takes M for its workspace alone: its variants and
// their launch shapes stay the same at every M.
TEST(KernelPlans, ProjectionVariantsNeverReadM) {
  for (int n = 1; n <= 16; ++n) {
    for (LayerKind kind : {LayerKind::kMhc, LayerKind::kHead}) {
      for (DType dtype : kDtypes) {
        for (int64_t hidden : {int64_t{7}, int64_t{256}, int64_t{4096}}) {
          LayerSpec spec = PresetSpec("deepseek_v4", n, hidden).value();
          spec.kind = kind;
          const std::string what = Describe(spec, dtype, 16);
          const auto forward = PlanProjectionForward(spec, dtype, 1, {});
          const auto backward = PlanProjectionBackward(spec, dtype, 1, {});
          for (int64_t tokens :
               {int64_t{13}, int64_t{4096}, int64_t{1} << 20}) {
            const auto f = PlanProjectionForward(spec, dtype, tokens, {});
            EXPECT_EQ(f.row, forward.row) << what << " M=" << tokens;
            EXPECT_EQ(f.x_copy_bytes, forward.x_copy_bytes) << what;
            EXPECT_EQ(f.tile_logits, forward.tile_logits) << what;
            const auto b = PlanProjectionBackward(spec, dtype, tokens, {});
            EXPECT_EQ(b.row, backward.row) << what << " M=" << tokens;
            EXPECT_EQ(b.dphi, backward.dphi) << what;
            EXPECT_EQ(b.row_copy, backward.row_copy) << what;
          }
        }
      }
    }
  }
}

// ---- The choices the launchers made before the plans, transcribed.

// scale.cu: UseScale4 (n == 4), then the vector form where every row the
// kernel moves is Aligned16 (a null one counts as aligned), quarters
// s.head ? 1 : 6; else the one-thread-per-token kernels.
struct OldScale {
  bool n4 = false;
  bool vec = false;
  int quarters = 0;
};
OldScale OldScaleChoice(const LayerSpec& s,
                        std::initializer_list<const float*> rows) {
  OldScale old;
  if (s.n != 4) return old;
  old.n4 = true;
  old.vec = true;
  for (const float* row : rows) {
    old.vec = old.vec && (reinterpret_cast<uintptr_t>(row) & 15u) == 0;
  }
  old.quarters = s.kind == LayerKind::kHead ? 1 : 6;
  return old;
}

// A float pointer at `offset` bytes past a 256-byte boundary, or null.
const float* At(int offset) {
  if (offset < 0) return nullptr;
  return reinterpret_cast<const float*>(uintptr_t{1} << 20 | offset);
}

// `alignment`: LeastAlignment of `rows`, as the launchers' PlanOf.
void ExpectScaleKeeps(const LayerSpec& spec, const std::string& what,
                      int alignment, std::initializer_list<const float*> rows) {
  const ScalePlan plan = PlanScale(spec, alignment);
  const OldScale old = OldScaleChoice(spec, rows);
  const ScaleVariant want = !old.n4   ? ScaleVariant::kThread
                            : old.vec ? ScaleVariant::kN4Vector
                                      : ScaleVariant::kN4Scalar;
  ASSERT_EQ(plan.variant, want) << what;
  EXPECT_EQ(plan.quarters, old.quarters) << what;
}

TEST(KernelPlans, ScaleKeepsTheChoices) {
  // Each row's start: 16-byte aligned, 4 or 8 bytes past, or null.
  constexpr int kOffsets[] = {0, 4, 8, 16, 36, -1};
  for (const char* preset : {"deepseek_v4", "transformer_engine"}) {
    for (LayerKind kind : {LayerKind::kMhc, LayerKind::kHead}) {
      for (int n = 1; n <= 16; ++n) {
        for (bool dynamic : {true, false}) {
          for (Layout layout : {Layout::kStreamMajor, Layout::kStreamMinor}) {
            LayerSpec spec = PresetSpec(preset, n, 64).value();
            spec.kind = kind;
            spec.dynamic = dynamic;
            spec.layout = layout;
            const std::string layer = Describe(spec, DType::kF32, 0);
            // Forward: h, h_pre, h_post, logits.
            for (int h : kOffsets) {
              for (int pre : kOffsets) {
                for (int post : kOffsets) {
                  for (int lg : kOffsets) {
                    ExpectScaleKeeps(
                        spec,
                        absl::StrCat(layer, " forward ", h, " ", pre, " ", post,
                                     " ", lg),
                        LeastAlignment({At(h), At(pre), At(post), At(lg)}),
                        {At(h), At(pre), At(post), At(lg)});
                  }
                }
              }
            }
            // Backward: h, dh, dh_pre, dh_post, dlogits.
            for (int h : kOffsets) {
              for (int dh : kOffsets) {
                for (int pre : kOffsets) {
                  for (int post : kOffsets) {
                    for (int dlg : kOffsets) {
                      ExpectScaleKeeps(
                          spec,
                          absl::StrCat(layer, " backward ", h, " ", dh, " ",
                                       pre, " ", post, " ", dlg),
                          LeastAlignment(
                              {At(h), At(dh), At(pre), At(post), At(dlg)}),
                          {At(h), At(dh), At(pre), At(post), At(dlg)});
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  }
}

// The scale tensors are fp32 at every activation dtype: the plan takes no
// dtype, and every fp32 alignment (4, 8, 16) of every n takes its row.
TEST(KernelPlans, ScalePlanFollowsNAndAlignment) {
  for (int n = 1; n <= 16; ++n) {
    for (int alignment : {4, 8, 16}) {
      for (LayerKind kind : {LayerKind::kMhc, LayerKind::kHead}) {
        LayerSpec spec = PresetSpec("deepseek_v4", n, 256).value();
        spec.kind = kind;
        const ScalePlan plan = PlanScale(spec, alignment);
        const std::string what = Describe(spec, DType::kF32, alignment);
        EXPECT_EQ(plan.variant, n != 4            ? ScaleVariant::kThread
                                : alignment >= 16 ? ScaleVariant::kN4Vector
                                                  : ScaleVariant::kN4Scalar)
            << what;
        EXPECT_EQ(plan.row, static_cast<int>(plan.variant)) << what;
      }
    }
  }
}

// sinkhorn.cu: sk4::Applies, then DispatchLanes, then DispatchMix.
struct OldSinkhorn {
  SinkhornVariant variant;
  bool vector_rows = false;
  int block = 0, lanes = 0;
  bool padded = false;
  int streams = 0;
};
OldSinkhorn OldSinkhornChoice(const LayerSpec& s, bool backward,
                              int alignment) {
  const bool log = s.sinkhorn_mode == SinkhornMode::kLog;
  const int T = s.sinkhorn_iterations;
  OldSinkhorn old;
  if (s.n == 4 && !log && T >= 1 && s.eps_sk >= FLT_MIN &&
      (!backward || T <= 20)) {
    old.variant = SinkhornVariant::kN4;
    old.vector_rows = alignment >= 16;
  } else if (!(log || T > 20 || T < 1 || s.n < 2 || s.n > 16)) {
    old.variant = SinkhornVariant::kLanes;
    old.padded = (s.n & (s.n - 1)) != 0;
    old.block = s.n <= 2 ? 2 : s.n <= 4 ? 4 : s.n <= 8 ? 8 : 16;
    old.lanes = s.n <= 2 ? 1 : s.n <= 4 ? 2 : s.n <= 8 ? 4 : 8;
  } else {
    old.variant = SinkhornVariant::kThread;
    old.streams = s.n == 4 ? 4 : 16;
  }
  return old;
}

TEST(KernelPlans, SinkhornKeepsTheChoices) {
  for (const char* preset : {"deepseek_v4", "transformer_engine"}) {
    for (int n = 1; n <= 16; ++n) {
      for (int T : {1, 10, 20, 21, 1000}) {
        for (float eps : {0.0f, FLT_MIN / 2, FLT_MIN, 1e-6f}) {
          for (int alignment : {4, 8, 16}) {
            LayerSpec spec = PresetSpec(preset, n, 64).value();
            spec.sinkhorn_iterations = T;
            spec.eps_sk = eps;
            const std::string what = Describe(spec, DType::kF32, alignment);
            for (bool backward : {false, true}) {
              const SinkhornPlan plan =
                  backward ? PlanSinkhornBackward(spec, alignment)
                           : PlanSinkhornForward(spec, alignment);
              const OldSinkhorn old =
                  OldSinkhornChoice(spec, backward, alignment);
              ASSERT_EQ(plan.variant, old.variant) << what;
              EXPECT_EQ(plan.vector_rows, old.vector_rows) << what;
              EXPECT_EQ(plan.block, old.block) << what;
              EXPECT_EQ(plan.padded, old.padded) << what;
              if (plan.variant == SinkhornVariant::kLanes) {
                EXPECT_EQ(SinkhornLanesPerToken(plan.block), old.lanes);
              }
              EXPECT_EQ(plan.streams, old.streams) << what;
            }
          }
        }
      }
    }
  }
}

// dispatch.cuh: ChooseRowAccess, then DispatchStreams<state>(.., wide).
struct OldRows {
  RowAccess access;
  int streams;
  int channels;
};
OldRows OldRowChoice(RowKernel kernel, const LayerSpec& s, DType dtype,
                     int alignment) {
  const int kv = 16 / static_cast<int>(DTypeSize(dtype));
  const int n = s.n;
  RowAccess access = RowAccess::kElement;
  if (n == 2 || n == 4 || n == 8 || n == 16) {
    access = s.hidden % kv == 0 && alignment >= 16 ? RowAccess::kVector
                                                   : RowAccess::kStrided;
  }
  if (n == 16 && kernel == RowKernel::kPost) access = RowAccess::kElement;
  if (access == RowAccess::kElement) {
    return {access, n == 4 ? 4 : n <= 2 ? 2 : n <= 8 ? 8 : 16, 1};
  }
  // WideStreams: passes of 128 threads x kv channels at least 90 % full.
  const int64_t per_pass = 128 * kv;
  const int64_t passes = (s.hidden + per_pass - 1) / per_pass;
  const bool full = 10 * s.hidden >= 9 * passes * per_pass;
  bool wide = false;
  if (kernel == RowKernel::kAggregateForward) wide = full;
  if (kernel == RowKernel::kExpandBackward) wide = n == 16 && full;
  const bool linear_wide = kernel == RowKernel::kAggregateForward ||
                           kernel == RowKernel::kExpandBackward;
  if (n == 2 || n == 4) return {access, n, kv};
  const bool strided = access == RowAccess::kStrided;
  return {access, n, linear_wide && !strided && wide ? kv : kv / 2};
}

TEST(KernelPlans, RowAccessKeepsTheChoices) {
  for (RowKernel kernel : kRowKernels) {
    for (int n = 1; n <= 16; ++n) {
      for (int64_t hidden : kHiddens) {
        for (DType dtype : kDtypes) {
          for (int alignment : kAlignments) {
            const LayerSpec spec = PresetSpec("deepseek_v4", n, hidden).value();
            const std::string what =
                absl::StrCat("kernel ", static_cast<int>(kernel), " ",
                             Describe(spec, dtype, alignment));
            const RowAccessPlan plan =
                PlanRowAccess(kernel, spec, dtype, alignment);
            const OldRows old = OldRowChoice(kernel, spec, dtype, alignment);
            EXPECT_EQ(plan.access, old.access) << what;
            EXPECT_EQ(plan.streams, old.streams) << what;
            EXPECT_EQ(plan.channels, old.channels) << what;
            EXPECT_EQ(plan.access_bytes,
                      plan.access == RowAccess::kVector
                          ? plan.channels * static_cast<int>(DTypeSize(dtype))
                          : static_cast<int>(DTypeSize(dtype)))
                << what;
            // Strided 16-bit rows stage where every tensor sits on 16
            // bytes, and never in the stream-minor layout or the expand
            // forward.
            EXPECT_EQ(plan.staged, plan.access == RowAccess::kStrided &&
                                       alignment >= 16 &&
                                       DTypeSize(dtype) == 2 &&
                                       kernel != RowKernel::kExpandForward)
                << what;
            LayerSpec minor = spec;
            minor.layout = Layout::kStreamMinor;
            EXPECT_FALSE(PlanRowAccess(kernel, minor, dtype, alignment).staged)
                << what;
          }
        }
      }
    }
  }
}

// post.cu / post_mma.cu: PostOnTensorCores, else the FFMA row kernels.
TEST(KernelPlans, PostKeepsTheChoices) {
  for (Layout layout : {Layout::kStreamMajor, Layout::kStreamMinor}) {
    for (int n = 1; n <= 16; ++n) {
      for (int64_t hidden : kHiddens) {
        for (DType dtype : kDtypes) {
          for (int rows : kAlignments) {
            for (int bias : {4, 16}) {
              LayerSpec spec = PresetSpec("deepseek_v4", n, hidden).value();
              spec.layout = layout;
              PostAlignment alignment;
              alignment.rows = rows;
              alignment.bias = bias;
              const std::string what = absl::StrCat(Describe(spec, dtype, rows),
                                                    " bias aligned ", bias);
              const PostPlan plan = PlanPost(spec, dtype, alignment);
              const bool tensor_cores =
                  dtype == DType::kBF16 && layout == Layout::kStreamMajor &&
                  !(n <= 2 || n == 4 || hidden % 8 != 0) && rows >= 16 &&
                  bias >= 16;
              const OldRows old =
                  OldRowChoice(RowKernel::kPost, spec, dtype, rows);
              const PostVariant want =
                  tensor_cores                        ? PostVariant::kMma
                  : old.access == RowAccess::kVector  ? PostVariant::kVector
                  : old.access == RowAccess::kStrided ? PostVariant::kStrided
                                                      : PostVariant::kElement;
              EXPECT_EQ(plan.variant, want) << what;
              EXPECT_EQ(plan.rows.access, old.access) << what;
              EXPECT_EQ(plan.rows.streams, old.streams) << what;
              EXPECT_EQ(plan.rows.channels, old.channels) << what;
            }
          }
        }
      }
    }
  }
}

// fused_pre.cu: static layers one kernel forward; SplitMix (mHC, n != 4,
// the lane kernels cover the Sinkhorn) the op kernels; else the fused
// mixing kernels.
TEST(KernelPlans, FusedKeepsTheChoices) {
  for (const char* preset : {"deepseek_v4", "transformer_engine"}) {
    for (LayerKind kind : {LayerKind::kMhc, LayerKind::kHead}) {
      for (int n = 1; n <= 16; ++n) {
        for (int T : {1, 20, 21}) {
          for (bool dynamic : {true, false}) {
            if (kind == LayerKind::kHead && !dynamic) continue;
            LayerSpec spec = PresetSpec(preset, n, 64).value();
            spec.kind = kind;
            spec.dynamic = dynamic;
            spec.sinkhorn_iterations = T;
            const std::string what = Describe(spec, DType::kF32, 16);
            const bool lanes = spec.sinkhorn_mode == SinkhornMode::kLinear &&
                               T <= 20 && n >= 2 && n <= 16;
            const bool split = kind == LayerKind::kMhc && n != 4 && lanes;
            EXPECT_EQ(SplitMix(spec), split) << what;
            EXPECT_EQ(PlanFusedForward(spec).variant,
                      !dynamic ? FusedVariant::kStatic
                      : split  ? FusedVariant::kSplitMix
                               : FusedVariant::kMix)
                << what;
            EXPECT_EQ(PlanFusedBackward(spec).variant,
                      split ? FusedVariant::kSplitMix : FusedVariant::kMix)
                << what;
            // The split mixing runs the Sinkhorn plan's lanes row.
            if (split) {
              EXPECT_EQ(PlanSinkhornBackward(spec, 16).variant,
                        SinkhornVariant::kLanes)
                  << what;
            }
          }
        }
      }
    }
  }
}

// Quads of lanes per token for the backward mixing of mHC n = 4 layers on
// sinkhorn4.cuh's form, up to kQuadMixMaxTokens; one thread past it and for
// every other layer.
TEST(KernelPlans, BackwardMixLanesFollowM) {
  const LayerSpec base = PresetSpec("deepseek_v4", 4, 64).value();
  for (bool dynamic : {true, false}) {
    LayerSpec spec = base;
    spec.dynamic = dynamic;
    EXPECT_EQ(BackwardMixLanes(spec, 1), 4);
    EXPECT_EQ(BackwardMixLanes(spec, kQuadMixMaxTokens), 4);
    EXPECT_EQ(BackwardMixLanes(spec, kQuadMixMaxTokens + 1), 1);
  }
  LayerSpec head = base;
  head.kind = LayerKind::kHead;
  EXPECT_EQ(BackwardMixLanes(head, 512), 1);
  LayerSpec log = base;
  log.sinkhorn_mode = SinkhornMode::kLog;
  EXPECT_EQ(BackwardMixLanes(log, 512), 1);
  // The reverse mode keeps at most kLaneMaxIterations steps' denominators.
  LayerSpec long_run = base;
  long_run.sinkhorn_iterations = kLaneMaxIterations + 1;
  EXPECT_EQ(BackwardMixLanes(long_run, 512), 1);
  for (int n : {2, 3, 8, 16}) {
    EXPECT_EQ(BackwardMixLanes(PresetSpec("deepseek_v4", n, 64).value(), 512),
              1)
        << n;
  }
}

}  // namespace
}  // namespace mhc::cuda
