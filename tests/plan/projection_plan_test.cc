// The projection's kernel plan on the host: every table row's example
// reaches that row; a grid of launches keeps the variants, launch shapes
// and workspace the dispatch chose before the plan existed; alignment never
// changes the workspace. No GPU needed.
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "projection/geometry.h"
#include "projection/plan.h"

namespace mhc::cuda {
namespace {

using BV = ProjectionBackwardVariant;
using FV = ProjectionForwardVariant;
using Dphi = ProjectionDphiVariant;

LayerSpec Layer(int n, int64_t C,
                MatmulPrecision precision = MatmulPrecision::kTf32,
                LayerKind kind = LayerKind::kMhc) {
  LayerSpec spec = PresetSpec("deepseek_v4", n, C).value();
  spec.matmul_precision = precision;
  spec.kind = kind;
  return spec;
}
constexpr MatmulPrecision kIeee = MatmulPrecision::kIeee;
constexpr MatmulPrecision kTf32 = MatmulPrecision::kTf32;

ProjectionForwardAlignment XAt(int x) {
  ProjectionForwardAlignment a;
  a.x = x;
  return a;
}
ProjectionBackwardAlignment RowsAt(int x) {
  ProjectionBackwardAlignment a;
  a.x = x;
  a.dx = x;
  return a;
}
DxTerms Terms(bool aggregate, bool residual) {
  DxTerms t;
  t.aggregate = aggregate;
  t.residual = residual;
  return t;
}

TEST(ProjectionPlan, EveryForwardRowReachesItsVariant) {
  const auto& rows = ProjectionForwardRows();
  ASSERT_EQ(rows.size(), size_t{kNumProjectionForwardVariants});
  for (size_t i = 0; i < rows.size(); ++i) {
    const PlanExample& e = rows[i].example;
    const ProjectionForwardPlan plan =
        PlanProjectionForward(e.Spec(), e.dtype, 4096, XAt(e.x_alignment));
    EXPECT_EQ(plan.row, static_cast<int>(i)) << rows[i].when;
    EXPECT_EQ(plan.variant, rows[i].variant) << rows[i].when;
  }
}

TEST(ProjectionPlan, EveryBackwardRowReachesItsVariant) {
  const auto& rows = ProjectionBackwardRows();
  ASSERT_EQ(rows.size(), size_t{kNumProjectionBackwardVariants});
  for (size_t i = 0; i < rows.size(); ++i) {
    const PlanExample& e = rows[i].example;
    const ProjectionBackwardPlan plan = PlanProjectionBackward(
        e.Spec(), e.dtype, 4096, RowsAt(e.x_alignment), e.terms);
    EXPECT_EQ(plan.row, static_cast<int>(i)) << rows[i].when;
    EXPECT_EQ(plan.variant, rows[i].variant) << rows[i].when;
  }
}

TEST(ProjectionPlan, VariantNamesAreDistinct) {
  std::set<std::string> forward, backward;
  for (const auto& row : ProjectionForwardRows()) {
    forward.insert(std::string(ToString(row.variant)));
  }
  for (const auto& row : ProjectionBackwardRows()) {
    backward.insert(std::string(ToString(row.variant)));
  }
  EXPECT_EQ(forward.size(), size_t{kNumProjectionForwardVariants});
  EXPECT_EQ(backward.size(), size_t{kNumProjectionBackwardVariants});
  EXPECT_EQ(forward.count("unknown") + backward.count("unknown"), 0u);
}

TEST(ProjectionPlan, AddressAlignment) {
  EXPECT_EQ(AddressAlignment(nullptr), 16);
  EXPECT_EQ(AddressAlignment(reinterpret_cast<void*>(0x1000)), 16);
  EXPECT_EQ(AddressAlignment(reinterpret_cast<void*>(0x1008)), 8);
  EXPECT_EQ(AddressAlignment(reinterpret_cast<void*>(0x1004)), 4);
  EXPECT_EQ(AddressAlignment(reinterpret_cast<void*>(0x1002)), 2);
  EXPECT_EQ(AddressAlignment(reinterpret_cast<void*>(0x1001)), 1);
}

struct ForwardCase {
  LayerSpec spec;
  DType dtype;
  ProjectionForwardAlignment alignment;
  FV variant;
  int x_copy_bytes;
};

// The choices of the dispatch chain the plan replaced, case by case.
TEST(ProjectionPlan, ForwardKeepsTheChoices) {
  ProjectionForwardAlignment phi_off;
  phi_off.phi = 4;
  LayerSpec static_layer = Layer(4, 4096);
  static_layer.dynamic = false;
  const std::vector<ForwardCase> cases = {
      {Layer(4, 4096), DType::kBF16, {}, FV::kWgmmaBf16, 16},
      {Layer(4, 4095), DType::kBF16, {}, FV::kWgmmaBf16, 8},
      {Layer(2, 4095), DType::kBF16, {}, FV::kWgmmaBf16, 4},
      {Layer(4, 4096), DType::kBF16, XAt(8), FV::kWgmmaBf16, 8},
      {Layer(4, 4096), DType::kBF16, XAt(2), FV::kMma, 0},
      {Layer(1, 7), DType::kBF16, {}, FV::kMma, 0},
      {Layer(4, 4096, kIeee), DType::kBF16, {}, FV::kWgmmaBf16, 16},
      {Layer(4, 4096), DType::kF16, {}, FV::kWgmmaTf32, 16},
      {Layer(4, 4096), DType::kF32, {}, FV::kWgmmaTf32, 16},
      {Layer(2, 4096), DType::kF16, {}, FV::kWgmmaTf32, 16},
      {Layer(4, 4096), DType::kF16, XAt(8), FV::kMma, 8},
      {Layer(4, 4096, kIeee), DType::kF16, {}, FV::kMma, 16},
      {Layer(4, 4095), DType::kF32, XAt(4), FV::kMma, 4},
      {Layer(16, 4096, kTf32, LayerKind::kHead),
       DType::kF32,
       {},
       FV::kWgmmaTf32,
       16},
      {Layer(5, 1024), DType::kBF16, {}, FV::kMma, 16},
      {Layer(6, 1024), DType::kBF16, {}, FV::kMma, 16},
      {Layer(7, 1024), DType::kBF16, {}, FV::kWgmmaBf16Wide, 16},
      {Layer(8, 4096), DType::kBF16, {}, FV::kWgmmaBf16Wide, 16},
      {Layer(8, 4096), DType::kBF16, XAt(8), FV::kWgmmaBf16Wide, 8},
      {Layer(8, 4096, kIeee), DType::kBF16, {}, FV::kWgmmaBf16Wide, 16},
      {Layer(8, 4096), DType::kBF16, phi_off, FV::kMmaWide, 16},
      {Layer(9, 1024), DType::kBF16, {}, FV::kWgmmaTf32Wide, 16},
      {Layer(9, 1024, kIeee), DType::kBF16, {}, FV::kMmaWide, 16},
      {Layer(16, 4096), DType::kBF16, {}, FV::kWgmmaTf32Wide, 16},
      {Layer(8, 4096), DType::kF32, {}, FV::kWgmmaTf32Wide, 16},
      {Layer(8, 4096, kIeee), DType::kF32, {}, FV::kMmaWide, 16},
      {Layer(8, 4096), DType::kF16, XAt(8), FV::kMmaWide, 8},
      {Layer(9, 4095), DType::kF16, {}, FV::kMmaWide, 0},
      {Layer(16, 4096, kTf32, LayerKind::kHead),
       DType::kBF16,
       {},
       FV::kWgmmaBf16,
       16},
      {static_layer, DType::kBF16, {}, FV::kNone, 16},
  };
  for (const ForwardCase& c : cases) {
    const ProjectionForwardPlan plan =
        PlanProjectionForward(c.spec, c.dtype, 4096, c.alignment);
    const std::string what = std::string(DTypeName(c.dtype)) +
                             " n=" + std::to_string(c.spec.n) +
                             " C=" + std::to_string(c.spec.hidden) + " x@" +
                             std::to_string(c.alignment.x);
    EXPECT_EQ(ToString(plan.variant), ToString(c.variant)) << what;
    EXPECT_EQ(plan.x_copy_bytes, c.x_copy_bytes) << what;
  }
}

TEST(ProjectionPlan, ForwardWideTilesAndVectors) {
  auto tile = [](int n, MatmulPrecision precision) {
    return PlanProjectionForward(Layer(n, 1024, precision), DType::kF32, 64, {})
        .tile_logits;
  };
  // mma_wide: 80 logits in one unit of 96 beat two of 64; 63 take one of
  // 64; 99 two of 64 (128 computed, not 192).
  EXPECT_EQ(tile(8, kIeee), 96);
  EXPECT_EQ(tile(7, kIeee), 64);
  EXPECT_EQ(tile(9, kIeee), 64);
  // wgmma_tf32_wide: 80 logits in 96, 99 in 144 (not two of 96).
  EXPECT_EQ(tile(8, kTf32), 96);
  EXPECT_EQ(tile(9, kTf32), 144);
  EXPECT_EQ(
      PlanProjectionForward(Layer(4, 1024), DType::kF32, 64, {}).tile_logits,
      0);
  ProjectionForwardAlignment gamma_off;
  gamma_off.gamma = 8;
  const ProjectionForwardPlan plan =
      PlanProjectionForward(Layer(8, 1024, kIeee), DType::kF32, 64, gamma_off);
  EXPECT_FALSE(plan.vector_rows);
  EXPECT_FALSE(plan.phi_vector);
}

// wgmma_bf16 with tensor copies, wgmma_tf32 and wgmma_tf32_wide: a deep
// ring while the units number fewer than an H200's SMs.
TEST(ProjectionPlan, ForwardDeepRing) {
  auto deep = [](int64_t C, int64_t M, int x_alignment = 16) {
    ProjectionForwardAlignment a;
    a.x = x_alignment;
    const ProjectionForwardPlan plan =
        PlanProjectionForward(Layer(4, C), DType::kBF16, M, a);
    EXPECT_EQ(plan.variant, FV::kWgmmaBf16);
    return plan.deep_ring;
  };
  EXPECT_TRUE(deep(16, 512));        // K = 64: one flush group, no split
  EXPECT_FALSE(deep(1024, 512));     // 8 tiles x 2 chunks: split units
  EXPECT_FALSE(deep(4096, 2048));    // 32 x 8
  EXPECT_FALSE(deep(1024, 4200));    // 66 x 2
  EXPECT_FALSE(deep(1024, 512, 8));  // cp.async pieces
  // The TF32 units of fp16 / fp32 the same way.
  for (DType dtype : {DType::kF16, DType::kF32}) {
    const ProjectionForwardPlan few =
        PlanProjectionForward(Layer(4, 1024), dtype, 512, {});
    EXPECT_EQ(few.variant, FV::kWgmmaTf32);
    EXPECT_TRUE(few.deep_ring);
    EXPECT_FALSE(
        PlanProjectionForward(Layer(4, 4096), dtype, 2048, {}).deep_ring);
  }
  // The wide TF32 units (128 tokens x a K chunk x a logit group): n = 16 at
  // C = 1024 is one chunk of two groups, so 65 tiles make 130 units and 66
  // make 132.
  auto wide = [](int n, int64_t C, DType dtype, int64_t M) {
    const ProjectionForwardPlan plan =
        PlanProjectionForward(Layer(n, C), dtype, M, {});
    EXPECT_EQ(plan.variant, FV::kWgmmaTf32Wide);
    return plan.deep_ring;
  };
  EXPECT_TRUE(wide(16, 1024, DType::kBF16, 512));
  EXPECT_TRUE(wide(16, 1024, DType::kBF16, 65 * 128));
  EXPECT_FALSE(wide(16, 1024, DType::kBF16, 65 * 128 + 1));
  EXPECT_FALSE(wide(16, 4096, DType::kBF16, 8192));
  EXPECT_TRUE(wide(8, 1024, DType::kF16, 512));
  EXPECT_FALSE(wide(8, 1024, DType::kF32, 512));  // fp32 x: never
}

// wgmma_bf16 with tensor copies and fewer units than SMs: each unit's
// 256-k flush groups over a cluster, as many CTAs as three per SM hold, up
// to 8, none idle.
TEST(ProjectionPlan, ForwardUnitCtas) {
  auto ctas = [](int64_t C, int64_t M, int x_alignment = 16) {
    ProjectionForwardAlignment a;
    a.x = x_alignment;
    return PlanProjectionForward(Layer(4, C), DType::kBF16, M, a).unit_ctas;
  };
  EXPECT_EQ(ctas(1024, 512), 8);   // 16 units, 8 groups a chunk
  EXPECT_EQ(ctas(2560, 1024), 4);  // 80 units: 396 / 80
  EXPECT_EQ(ctas(12288, 1), 6);    // 16 units, 12 groups: 2 a CTA
  EXPECT_EQ(ctas(1280, 512), 7);   // 24 units, 7 groups (27 stages)
  EXPECT_EQ(ctas(1024, 1), 8);
  EXPECT_EQ(ctas(16, 512), 1);       // one group
  EXPECT_EQ(ctas(4096, 2048), 1);    // 256 units
  EXPECT_EQ(ctas(1024, 512, 8), 1);  // cp.async pieces
  for (DType dtype : {DType::kF16, DType::kF32}) {
    EXPECT_EQ(PlanProjectionForward(Layer(4, 1024), dtype, 512, {}).unit_ctas,
              1);
  }
}

// Odd C at n = 4 leaves bf16 rows 8 bytes off 16 every other token: with x
// on 16 bytes and at least two tokens, tensor copies of the even rows and of
// token pairs take them.
TEST(ProjectionPlan, ForwardPairRows) {
  auto pairs = [](int64_t C, int64_t M, int x_alignment = 16,
                  DType dtype = DType::kBF16) {
    ProjectionForwardAlignment a;
    a.x = x_alignment;
    return PlanProjectionForward(Layer(4, C), dtype, M, a);
  };
  const ProjectionForwardPlan odd_c = pairs(5129, 8192);
  EXPECT_EQ(odd_c.variant, FV::kWgmmaBf16);
  EXPECT_EQ(odd_c.x_copy_bytes, 8);
  EXPECT_TRUE(odd_c.pair_rows);
  EXPECT_TRUE(pairs(1025, 2).pair_rows);
  EXPECT_TRUE(pairs(5129, 8191).pair_rows);      // the last token even
  EXPECT_FALSE(pairs(5129, 1).pair_rows);        // no pair at all
  EXPECT_FALSE(pairs(5129, 8192, 8).pair_rows);  // even tokens off 16 bytes
  EXPECT_FALSE(pairs(5120, 8192).pair_rows);     // every row on 16 bytes
  ProjectionForwardAlignment on16;
  on16.x = 16;  // n = 2: rows 4 bytes off, pairs still off 16
  EXPECT_FALSE(PlanProjectionForward(Layer(2, 5129), DType::kBF16, 8192, on16)
                   .pair_rows);
  EXPECT_FALSE(pairs(5129, 8192, 16, DType::kF16).pair_rows);
}

TEST(ProjectionPlan, ForwardWorkspace) {
  // n = 4, C = 4096: 8 chunks of 2048 k, 25 partials per token and chunk;
  // bf16 splits phi' once (256 stages of 6 KB) at every M > 0.
  const ProjectionForwardPlan big =
      PlanProjectionForward(Layer(4, 4096), DType::kBF16, 4096, {});
  EXPECT_EQ(big.workspace.partials, size_t{4} * 4096 * 8 * 25);
  EXPECT_EQ(big.workspace.phi_split, size_t{256} * 6144);
  EXPECT_TRUE(big.split_phi);
  EXPECT_EQ(big.workspace.counter_offset,
            big.workspace.partials + big.workspace.phi_split);
  EXPECT_EQ(big.workspace.total, big.workspace.counter_offset + 256);
  const ProjectionForwardPlan small =
      PlanProjectionForward(Layer(4, 4096), DType::kBF16, 1, {});
  EXPECT_EQ(small.workspace.partials, size_t{1024});  // 800 B, aligned
  EXPECT_EQ(small.workspace.phi_split, size_t{256} * 6144);
  EXPECT_TRUE(small.split_phi);
  EXPECT_EQ(small.workspace.total, small.workspace.counter_offset + 256);
  // No tokens, no split.
  EXPECT_FALSE(
      PlanProjectionForward(Layer(4, 4096), DType::kBF16, 0, {}).split_phi);
  // IEEE splits into three terms (9 KB per stage); fp16 / fp32 round phi'
  // into 6 KB per stage under TF32, and keep it unsplit under IEEE.
  EXPECT_EQ(PlanProjectionForward(Layer(4, 4096, kIeee), DType::kBF16, 4096, {})
                .workspace.phi_split,
            size_t{256} * 9216);
  EXPECT_EQ(PlanProjectionForward(Layer(4, 4096), DType::kF16, 4096, {})
                .workspace.phi_split,
            size_t{256} * 6144);
  EXPECT_EQ(PlanProjectionForward(Layer(4, 4096), DType::kF32, 4096, {})
                .workspace.phi_split,
            size_t{256} * 6144);
  EXPECT_EQ(PlanProjectionForward(Layer(4, 4096, kIeee), DType::kF16, 4096, {})
                .workspace.phi_split,
            0u);
  LayerSpec static_layer = Layer(4, 4096);
  static_layer.dynamic = false;
  EXPECT_EQ(PlanProjectionForward(static_layer, DType::kBF16, 4096, {})
                .workspace.total,
            0u);
  // TF32 layers past two logit groups round phi' once into [N][K] floats,
  // after the partials: at one logit group (fp32 n = 8) at every M, at two
  // from 264 units (token tiles of 128 x K chunks x 2 groups), and either
  // way only where the rounded rows keep the forward scratch within its
  // share of x (large M); the bf16 wide unit's layers (N <= 80) and IEEE
  // do not, nor does M = 0. n = 16, C = 2048, fp32: 2 K chunks, so 66
  // tiles reach 264 units (the share already fits); C = 4096: 3 chunks,
  // 264 units from 44 tiles, the share from M = 5974.
  auto rounded = [](int n, int64_t C, DType dtype, int64_t M) {
    return PlanProjectionForward(Layer(n, C), dtype, M, {}).workspace;
  };
  const ProjectionForwardWorkspaceLayout wide =
      rounded(16, 2048, DType::kF32, 8321);
  EXPECT_EQ(wide.phi_split, 0u);
  EXPECT_EQ(wide.phi_rounded, size_t{4} * 288 * 32768);
  EXPECT_EQ(wide.phi_rounded_offset, wide.partials);
  EXPECT_EQ(wide.counter_offset, wide.phi_rounded_offset + wide.phi_rounded);
  EXPECT_EQ(wide.total, wide.counter_offset + 256);
  EXPECT_EQ(rounded(16, 2048, DType::kF32, 8320).phi_rounded, 0u);
  EXPECT_GT(rounded(16, 4096, DType::kF32, 5974).phi_rounded, 0u);
  EXPECT_EQ(rounded(16, 4096, DType::kF32, 5973).phi_rounded, 0u);
  // One group: the share alone (n = 8, C = 4096, fp32: from M = 2624).
  EXPECT_EQ(rounded(8, 4096, DType::kF32, 2624).phi_rounded,
            size_t{4} * 80 * 32768);
  EXPECT_EQ(rounded(8, 4096, DType::kF32, 2623).phi_rounded, 0u);
  EXPECT_EQ(rounded(8, 256, DType::kF32, 1 << 20).phi_rounded, 0u);
  EXPECT_EQ(rounded(8, 4096, DType::kBF16, 32768).phi_rounded, 0u);
  EXPECT_EQ(
      PlanProjectionForward(Layer(16, 2048, kIeee), DType::kF32, 32768, {})
          .workspace.phi_rounded,
      0u);
  EXPECT_EQ(rounded(16, 2048, DType::kF32, 0).phi_rounded, 0u);
}

struct BackwardCase {
  LayerSpec spec;
  DType dtype;
  ProjectionBackwardAlignment alignment;
  DxTerms terms;
  BV variant;
  Dphi dphi;
};

TEST(ProjectionPlan, BackwardKeepsTheChoices) {
  LayerSpec minor = Layer(4, 4096);
  minor.layout = Layout::kStreamMinor;
  LayerSpec static_layer = Layer(4, 4096);
  static_layer.dynamic = false;
  ProjectionBackwardAlignment dh_off;
  dh_off.dh = 8;
  ProjectionBackwardAlignment r_off;
  r_off.r = 4;
  const DxTerms none;
  const DxTerms aggregate = Terms(true, false);
  const DxTerms both = Terms(true, true);
  const DxTerms residual_only = Terms(false, true);
  const std::vector<BackwardCase> cases = {
      {Layer(4, 4096), DType::kBF16, {}, none, BV::kWgmmaN4, Dphi::kWithDx},
      {Layer(4, 4096), DType::kF16, {}, none, BV::kWgmmaN4, Dphi::kWithDx},
      {Layer(4, 4096), DType::kBF16, {}, aggregate, BV::kMma, Dphi::kWithDx},
      {Layer(4, 4096), DType::kBF16, {}, both, BV::kMma, Dphi::kWithDx},
      {Layer(4, 4096), DType::kF32, {}, none, BV::kMma, Dphi::kWithDx},
      {Layer(4, 4096, kIeee), DType::kBF16, {}, none, BV::kMma, Dphi::kWithDx},
      {minor, DType::kBF16, {}, none, BV::kMma, Dphi::kWithDx},
      {Layer(4, 4092), DType::kBF16, {}, none, BV::kMma, Dphi::kWithDx},
      {Layer(4, 4096), DType::kBF16, RowsAt(8), none, BV::kMma, Dphi::kWithDx},
      {Layer(4, 4096), DType::kBF16, dh_off, none, BV::kMma, Dphi::kWithDx},
      {Layer(4, 4096, kTf32, LayerKind::kHead),
       DType::kBF16,
       {},
       none,
       BV::kMma,
       Dphi::kWithDx},
      {Layer(8, 4096), DType::kBF16, {}, none, BV::kWgmmaN8, Dphi::kWithDx},
      {Layer(8, 4096), DType::kBF16, {}, both, BV::kWgmmaN8, Dphi::kWithDx},
      {Layer(8, 4096), DType::kBF16, r_off, both, BV::kMma, Dphi::kWithDx},
      {Layer(8, 4096),
       DType::kBF16,
       {},
       residual_only,
       BV::kMma,
       Dphi::kWithDx},
      {Layer(8, 4096), DType::kF32, {}, none, BV::kMma, Dphi::kWithDx},
      {Layer(8, 4096), DType::kF32, {}, aggregate, BV::kMma, Dphi::kWithDx},
      {Layer(8, 4096), DType::kF32, {}, both, BV::kMmaWide, Dphi::kWgmmaWide},
      {Layer(8, 4096, kIeee),
       DType::kF32,
       {},
       residual_only,
       BV::kMmaWide,
       Dphi::kMmaWide},
      {Layer(16, 4096, kTf32, LayerKind::kHead),
       DType::kF32,
       {},
       both,
       BV::kMmaWide,
       Dphi::kWgmmaWide},
      {Layer(16, 4096, kIeee, LayerKind::kHead),
       DType::kBF16,
       {},
       both,
       BV::kMmaWide,
       Dphi::kMmaWide},
      {Layer(16, 4096, kTf32, LayerKind::kHead),
       DType::kBF16,
       {},
       both,
       BV::kMma,
       Dphi::kWithDx},
      {Layer(3, 1024), DType::kBF16, {}, none, BV::kMmaWide, Dphi::kWgmmaWide},
      {Layer(3, 1023), DType::kBF16, {}, none, BV::kMmaWide, Dphi::kMmaWide},
      {Layer(3, 1024), DType::kBF16, RowsAt(8), none, BV::kMmaWide,
       Dphi::kMmaWide},
      {Layer(11, 1024), DType::kBF16, {}, none, BV::kMmaWide, Dphi::kWgmmaWide},
      {Layer(12, 1024),
       DType::kBF16,
       {},
       none,
       BV::kWgmmaWide,
       Dphi::kWgmmaWide},
      {Layer(12, 1024, kIeee),
       DType::kBF16,
       {},
       none,
       BV::kMmaWide,
       Dphi::kMmaWide},
      {Layer(16, 4096),
       DType::kF32,
       {},
       both,
       BV::kWgmmaWide,
       Dphi::kWgmmaWide},
      {static_layer, DType::kBF16, {}, aggregate, BV::kFma, Dphi::kNone},
      {static_layer, DType::kBF16, {}, both, BV::kFma, Dphi::kNone},
  };
  for (const BackwardCase& c : cases) {
    const ProjectionBackwardPlan plan =
        PlanProjectionBackward(c.spec, c.dtype, 4096, c.alignment, c.terms);
    const std::string what = std::string(DTypeName(c.dtype)) +
                             " n=" + std::to_string(c.spec.n) +
                             " C=" + std::to_string(c.spec.hidden) +
                             " terms=" + std::to_string(c.terms.aggregate) +
                             std::to_string(c.terms.residual);
    EXPECT_EQ(ToString(plan.variant), ToString(c.variant)) << what;
    EXPECT_EQ(ToString(plan.dphi), ToString(c.dphi)) << what;
  }
}

// mma: dphi and dx apart while the CTAs (128 columns x 1024 tokens) number
// fewer than an H200's SMs and dx would take finer chunks (M > 128).
// The fused terms of 16-bit n = 4 layers: wgmma_n4_terms while the mma
// kernel's grid is below two CTAs per SM (128 columns x 1024 tokens each),
// the mma kernel above.
TEST(ProjectionPlan, BackwardTermsByGrid) {
  const DxTerms aggregate = Terms(true, false);
  const DxTerms both = Terms(true, true);
  auto variant = [&](int64_t C, DType dtype, int64_t M, DxTerms terms,
                     const ProjectionBackwardAlignment& a = {}) {
    return PlanProjectionBackward(Layer(4, C), dtype, M, a, terms).variant;
  };
  EXPECT_EQ(variant(4096, DType::kBF16, 2048, both), BV::kWgmmaN4Terms);
  EXPECT_EQ(variant(4096, DType::kF16, 2048, aggregate), BV::kWgmmaN4Terms);
  EXPECT_EQ(variant(4096, DType::kBF16, 2049, both), BV::kMma);  // 128 x 3
  EXPECT_EQ(variant(1024, DType::kBF16, 8192, both), BV::kWgmmaN4Terms);
  EXPECT_EQ(variant(1024, DType::kBF16, 8193, both), BV::kMma);  // 32 x 9
  EXPECT_EQ(variant(8448, DType::kBF16, 1, both), BV::kMma);     // 264 x 1
  EXPECT_EQ(variant(1024, DType::kF32, 512, both), BV::kMma);
  EXPECT_EQ(variant(1024, DType::kBF16, 512, {}), BV::kWgmmaN4);
  ProjectionBackwardAlignment r_off;
  r_off.r = 4;
  EXPECT_EQ(variant(1024, DType::kBF16, 512, both, r_off), BV::kMma);
  EXPECT_EQ(variant(1024, DType::kBF16, 512, aggregate, r_off),
            BV::kWgmmaN4Terms);
}

TEST(ProjectionPlan, BackwardChunkCtas) {
  const DxTerms both = Terms(true, true);
  auto split = [&](int64_t C, int64_t M, DxTerms terms, BV want) {
    const ProjectionBackwardPlan plan =
        PlanProjectionBackward(Layer(4, C), DType::kBF16, M, {}, terms);
    EXPECT_EQ(plan.variant, want) << C << " " << M;
    return plan.chunk_ctas;
  };
  // Chunks (CTAs of 32 channels x 1024 tokens) split over as many CTAs as
  // fit one per SM, up to four and a stage each, where that is three or
  // more; else over as many as fit two per SM.
  EXPECT_EQ(split(1024, 512, both, BV::kWgmmaN4Terms), 4);   // 32 tiles
  EXPECT_EQ(split(1056, 1024, both, BV::kWgmmaN4Terms), 4);  // 33
  EXPECT_EQ(split(1088, 1024, both, BV::kWgmmaN4Terms), 3);  // 34
  EXPECT_EQ(split(1408, 1024, both, BV::kWgmmaN4Terms), 3);  // 44
  EXPECT_EQ(split(1440, 1024, both, BV::kWgmmaN4Terms), 4);  // 45, shared
  EXPECT_EQ(split(2112, 1024, both, BV::kWgmmaN4Terms), 4);  // 66
  EXPECT_EQ(split(2144, 1024, both, BV::kWgmmaN4Terms), 3);  // 67
  EXPECT_EQ(split(2560, 1024, both, BV::kWgmmaN4Terms), 3);  // 80
  EXPECT_EQ(split(2848, 1024, both, BV::kWgmmaN4Terms), 2);  // 89
  EXPECT_EQ(split(4224, 1024, both, BV::kWgmmaN4Terms), 2);  // 132
  EXPECT_EQ(split(4256, 1024, both, BV::kWgmmaN4Terms), 1);  // 133
  EXPECT_EQ(split(4096, 2048, both, BV::kWgmmaN4Terms), 1);
  EXPECT_EQ(split(1024, 2048, both, BV::kWgmmaN4Terms), 4);  // 2 chunks
  EXPECT_EQ(split(1024, 64, both, BV::kWgmmaN4Terms), 1);
  EXPECT_EQ(split(1024, 65, both, BV::kWgmmaN4Terms), 2);
  EXPECT_EQ(split(1024, 129, both, BV::kWgmmaN4Terms), 3);
  EXPECT_EQ(split(1024, 512, {}, BV::kWgmmaN4), 4);
  EXPECT_EQ(split(1024, 8193, both, BV::kMma), 1);
}

// Every split the plan takes fits its launch: no more CTAs per chunk than
// stages, at most two per SM, and one arrival counter per (channel tile,
// chunk) within the kSplitArrivals the fused workspace and the backend
// hold; the split's scratch is each CTA's 24 x 128 dphi^T.
TEST(ProjectionPlan, EverySplitFitsItsCounters) {
  int splits = 0;
  for (int64_t C = 8; C <= 8192; C += 8) {
    for (int64_t M :
         {1, 63, 64, 65, 200, 512, 1000, 1024, 1025, 2048, 3000, 4096, 8192}) {
      const int ctas = ChunkCtasFor(Layer(4, C), M);
      const int64_t tiles = (C + proj::kWgmmaN4Chans - 1) / proj::kWgmmaN4Chans;
      const int64_t groups = tiles * ((M + 1023) / 1024);
      const int64_t stages = (std::min<int64_t>(M, 1024) + 63) / 64;
      ASSERT_GE(ctas, 1);
      ASSERT_LE(ctas, std::min<int64_t>(proj::kMaxChunkCtas, stages))
          << C << " " << M;
      if (ctas == 1) {
        EXPECT_EQ(SplitPartialBytes(Layer(4, C), M), 0u);
        continue;
      }
      ++splits;
      ASSERT_LE(groups, proj::kSplitArrivals) << C << " " << M;
      ASSERT_LE(groups * ctas, proj::kWgmmaN4CtasPerSm * proj::kTunedSms)
          << C << " " << M;
      EXPECT_EQ(SplitPartialBytes(Layer(4, C), M),
                sizeof(float) * groups * ctas * 24 * 128);
    }
  }
  EXPECT_GT(splits, 1000);
}

TEST(ProjectionPlan, BackwardGradsInKernel) {
  const DxTerms both = Terms(true, true);
  auto in_kernel = [&](int n, int64_t C, int64_t M, DType dt, DxTerms terms) {
    return PlanProjectionBackward(Layer(n, C), dt, M, {}, terms)
        .grads_in_kernel;
  };
  // The n = 4 warpgroup kernels while one token chunk holds the batch.
  EXPECT_TRUE(in_kernel(4, 1024, 512, DType::kBF16, both));
  EXPECT_TRUE(in_kernel(4, 2560, 1024, DType::kF16, both));
  EXPECT_TRUE(in_kernel(4, 1024, 1, DType::kBF16, {}));
  EXPECT_FALSE(in_kernel(4, 1024, 1025, DType::kBF16, both));
  EXPECT_FALSE(in_kernel(4, 4096, 2048, DType::kBF16, {}));
  // The other kernels reduce their partials in a launch of their own.
  EXPECT_FALSE(in_kernel(4, 1024, 512, DType::kF32, both));
  EXPECT_FALSE(in_kernel(8, 1024, 512, DType::kBF16, both));
}

TEST(ProjectionPlan, BackwardDxApart) {
  const DxTerms both = Terms(true, true);
  // fp32 layers: 16-bit ones of n = 4 take wgmma_n4_terms.
  auto apart = [&](int n, int64_t C, int64_t M) {
    const ProjectionBackwardPlan plan =
        PlanProjectionBackward(Layer(n, C), DType::kF32, M, {}, both);
    EXPECT_EQ(plan.variant, BV::kMma);
    return plan.dx_apart_tokens;
  };
  // dx chunks: 128 tokens, halved while fewer than a CTA per SM.
  EXPECT_EQ(apart(4, 1024, 512), 64);    // 32 CTAs; dx 32 x 8
  EXPECT_EQ(apart(4, 1024, 200), 32);    // dx 32 x 7
  EXPECT_EQ(apart(4, 1024, 1000), 128);  // dx 32 x 8
  EXPECT_EQ(apart(4, 2560, 1024), 128);  // 80; dx 80 x 8
  EXPECT_EQ(apart(4, 4096, 2048), 0);    // 128 x 2 = 256
  EXPECT_EQ(apart(4, 1024, 128), 0);     // one dx chunk already
  EXPECT_EQ(apart(4, 8192, 1024), 0);    // 256
  EXPECT_EQ(apart(4, 1024, 4096), 128);  // 32 x 4; dx 32 x 32
  EXPECT_EQ(apart(4, 1024, 5000), 0);    // 32 x 5 = 160
  EXPECT_EQ(apart(4, 256, 200), 32);     // 8; dx down to one stage
  // The warpgroup-mma rows never do.
  EXPECT_EQ(PlanProjectionBackward(Layer(4, 1024), DType::kBF16, 512, {})
                .dx_apart_tokens,
            0);
}

TEST(ProjectionPlan, BackwardRowCopiesAndVectors) {
  auto copy = [](const LayerSpec& spec, DType dtype,
                 const ProjectionBackwardAlignment& a) {
    return PlanProjectionBackward(spec, dtype, 64, a).row_copy;
  };
  EXPECT_EQ(copy(Layer(4, 4096), DType::kF32, {}), DxRowCopy::kVector);
  // Odd C: the n = 4 tile's pad holds a word per stream run; n = 8 (80
  // logits) pads wider; a HEAD of 16 streams has too many runs.
  EXPECT_EQ(copy(Layer(4, 4095, kIeee), DType::kBF16, {}), DxRowCopy::kSlots);
  EXPECT_EQ(copy(Layer(8, 1023, kIeee), DType::kBF16, {}), DxRowCopy::kSlots);
  EXPECT_EQ(copy(Layer(16, 1023, kIeee, LayerKind::kHead), DType::kBF16, {}),
            DxRowCopy::kElements);
  EXPECT_EQ(copy(Layer(4, 4096, kIeee), DType::kBF16, RowsAt(1)),
            DxRowCopy::kElements);
  EXPECT_EQ(copy(Layer(4, 4096, kIeee), DType::kBF16, RowsAt(2)),
            DxRowCopy::kSlots);
  // The summed n = 4 build's 16-bit rows off 16 bytes: run maps, where
  // every base is on 16 bytes (dx need not be) and the batch has a row for
  // each residue map; else (no terms, fp32, a base off, fewer tokens) slots.
  const DxTerms both = Terms(true, true);
  auto plan = [&](int64_t C, DType dtype, int64_t tokens,
                  const ProjectionBackwardAlignment& a, DxTerms terms) {
    return PlanProjectionBackward(Layer(4, C), dtype, tokens, a, terms)
        .row_copy;
  };
  ProjectionBackwardAlignment dx_off;
  dx_off.dx = 2;
  ProjectionBackwardAlignment dy_off;
  dy_off.dy = 8;
  for (int64_t C : {5129, 1030, 1036}) {
    EXPECT_EQ(plan(C, DType::kBF16, 64, {}, both), DxRowCopy::kRunMaps) << C;
    EXPECT_EQ(plan(C, DType::kF16, 8, dx_off, both), DxRowCopy::kRunMaps);
    EXPECT_EQ(plan(C, DType::kBF16, 7, {}, both), DxRowCopy::kSlots);
    EXPECT_EQ(plan(C, DType::kBF16, 64, dy_off, both), DxRowCopy::kSlots);
    EXPECT_EQ(plan(C, DType::kBF16, 64, RowsAt(8), both), DxRowCopy::kSlots);
    EXPECT_EQ(plan(C, DType::kBF16, 64, {}, Terms(true, false)),
              DxRowCopy::kSlots);
    EXPECT_EQ(plan(C, DType::kBF16, 64, {}, {}), DxRowCopy::kSlots);
  }
  EXPECT_EQ(plan(5120, DType::kBF16, 64, {}, both), DxRowCopy::kVector);
  EXPECT_NE(plan(5129, DType::kF32, 64, {}, both), DxRowCopy::kRunMaps);
  ProjectionBackwardAlignment dms_off;
  dms_off.dms = 4;
  EXPECT_TRUE(
      PlanProjectionBackward(Layer(4, 4096), DType::kF32, 64, {}).runs16);
  EXPECT_FALSE(
      PlanProjectionBackward(Layer(4, 4096), DType::kF32, 64, dms_off).runs16);
  // Wide: dx vectors need C whole vectors with a term (stream major).
  const ProjectionBackwardPlan odd = PlanProjectionBackward(
      Layer(4, 1022), DType::kBF16, 64, {}, Terms(true, false));
  EXPECT_TRUE(odd.vector_x);
  EXPECT_FALSE(odd.vector_dx);
  EXPECT_TRUE(
      PlanProjectionBackward(Layer(4, 1022), DType::kBF16, 64, {}).vector_dx);
  // FMA: two k per thread on 16-byte rows and an even K.
  LayerSpec static_layer = Layer(4, 4096);
  static_layer.dynamic = false;
  EXPECT_EQ(
      PlanProjectionBackward(static_layer, DType::kBF16, 64, {}).fma_vector, 2);
  EXPECT_EQ(PlanProjectionBackward(static_layer, DType::kBF16, 64, RowsAt(8))
                .fma_vector,
            1);
  EXPECT_EQ(PlanProjectionBackward(Layer(8, 4096), DType::kBF16, 64, {},
                                   Terms(true, true))
                .terms,
            2);
}

TEST(ProjectionPlan, PhiChunkTokens) {
  EXPECT_EQ(PhiChunkTokens(Layer(4, 4096)), 1024);
  EXPECT_EQ(PhiChunkTokens(Layer(8, 4096)), 1024);
  EXPECT_EQ(PhiChunkTokens(Layer(3, 1024)), 1024);
  EXPECT_EQ(PhiChunkTokens(Layer(9, 4096)), 2048);
  EXPECT_EQ(PhiChunkTokens(Layer(16, 4096)), 8192);
  EXPECT_EQ(NumPhiChunks(Layer(16, 4096), 8193), 2);
}

TEST(ProjectionPlan, BackwardWorkspace) {
  // n = 4: the dphi partials only, 4 chunks of 24 x 16384 floats.
  const ProjectionBackwardPlan n4 =
      PlanProjectionBackward(Layer(4, 4096), DType::kBF16, 4096, {});
  EXPECT_EQ(n4.workspace.dphi_partials, size_t{4} * 4 * 24 * 16384);
  EXPECT_EQ(n4.workspace.wide_scratch, 0u);
  EXPECT_EQ(n4.workspace.split_partials, 0u);
  EXPECT_EQ(n4.workspace.total, n4.workspace.dphi_partials);
  // n = 4, M = 512, C = 1024: one chunk split over four CTAs, each leaving
  // its 24 x 128 dphi^T for the last, beside the chunk's partial.
  const ProjectionBackwardPlan split =
      PlanProjectionBackward(Layer(4, 1024), DType::kBF16, 512, {});
  ASSERT_EQ(split.chunk_ctas, 4);
  EXPECT_EQ(split.workspace.dphi_partials, size_t{4} * 24 * 4096);
  EXPECT_EQ(split.workspace.split_partials, size_t{4} * 32 * 4 * 24 * 128);
  EXPECT_EQ(split.workspace.total,
            split.workspace.dphi_partials + split.workspace.split_partials);
  // Whichever variant runs: the mma kernel's layers and heads split nothing.
  EXPECT_EQ(SplitPartialBytes(Layer(4, 1024), 512),
            split.workspace.split_partials);
  EXPECT_EQ(SplitPartialBytes(Layer(4, 1024), 8192), 0u);
  EXPECT_EQ(SplitPartialBytes(Layer(8, 1024), 512), 0u);
  // n = 3, M = 100, C = 64 under IEEE: two parts of dh [100][32], dh^T
  // [32][104] and phi'^T [192][32], each rounded to 256 bytes; the residual
  // term adds one chunk of 8 channels per stream and token.
  const ProjectionBackwardPlan wide = PlanProjectionBackward(
      Layer(3, 64, kIeee), DType::kBF16, 100, {}, Terms(true, true));
  EXPECT_EQ(wide.workspace.parts, 2);
  EXPECT_EQ(wide.workspace.part_dh, size_t{12800});
  EXPECT_EQ(wide.workspace.part_dh_t, size_t{13312});
  EXPECT_EQ(wide.workspace.part_phi_t, size_t{24576});
  EXPECT_EQ(wide.workspace.terms, size_t{9728});
  EXPECT_EQ(wide.workspace.wide_scratch,
            size_t{2} * (12800 + 13312 + 24576) + 9728);
}

// The workspace is sized before the tensors exist: alignment may change
// the variant but never the bytes.
TEST(ProjectionPlan, AlignmentNeverChangesTheWorkspace) {
  std::vector<ProjectionBackwardAlignment> alignments(6);
  alignments[1] = RowsAt(8);
  alignments[2] = RowsAt(2);
  alignments[3].dh = 4;
  alignments[4].r = 4;
  alignments[4].dy = 8;
  alignments[5] = RowsAt(1);
  for (int n = 1; n <= 16; ++n) {
    for (LayerKind kind : {LayerKind::kMhc, LayerKind::kHead}) {
      for (MatmulPrecision precision : {kTf32, kIeee}) {
        for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
          for (int t = 0; t < 3; ++t) {
            const LayerSpec spec = Layer(n, 520, precision, kind);
            const DxTerms terms = Terms(t >= 1, t == 2);
            const size_t bytes =
                PlanProjectionBackward(spec, dtype, 333, {}, terms)
                    .workspace.total;
            for (const auto& a : alignments) {
              EXPECT_EQ(PlanProjectionBackward(spec, dtype, 333, a, terms)
                            .workspace.total,
                        bytes)
                  << "n=" << n << " " << DTypeName(dtype);
            }
            ProjectionForwardAlignment x_off;
            x_off.x = 2;
            EXPECT_EQ(
                PlanProjectionForward(spec, dtype, 333, x_off).workspace.total,
                PlanProjectionForward(spec, dtype, 333, {}).workspace.total);
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace mhc::cuda
