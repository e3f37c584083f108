// The projection plan's tables on the device: for every row, the row's
// example launch reaches that row's variant (the plan with the tensors'
// real alignment, and the variant the CUDA backend reports for the
// launch), and its results match the float64 reference. The other
// families' tables: cuda_dispatch_families_test.cc. Skips without a GPU.
#include <cmath>
#include <string>
#include <vector>

#include "cuda/cuda_cases.h"
#include "cuda/cuda_harness.h"
#include "cuda/cuda_placed.h"
#include "gtest/gtest.h"
#include "projection/plan.h"

namespace mhc::testing {
namespace {

using cuda::AddressAlignment;
using cuda::PlanExample;

constexpr int64_t kTokens = 300;

std::string RowName(size_t i, const PlanExample& e, absl::string_view variant) {
  return absl::StrCat("row ", i + 1, " (", variant,
                      "): ", CaseName(e.Spec(), kTokens, e.dtype));
}

TEST(CudaDispatchTest, EveryForwardRowRunsItsVariant) {
  MHC_SKIP_WITHOUT_GPU();
  const auto& rows = cuda::ProjectionForwardRows();
  for (size_t i = 0; i < rows.size(); ++i) {
    const PlanExample& e = rows[i].example;
    const LayerSpec spec = e.Spec();
    const std::string want(cuda::ToString(rows[i].variant));
    SCOPED_TRACE(RowName(i, e, want));
    const int64_t M = kTokens, K = spec.K(), N = spec.NumLogits();
    Harness h;
    Placed x = PlaceAct(h, e.dtype, M * K, e.x_alignment);
    const float scale = 1.0f / std::sqrt(static_cast<float>(K));
    Pair phi = h.Floats(N * K, FreshSeed(), -scale, scale);
    Pair gamma = h.Floats(K, FreshSeed(), 0.5f, 1.5f);
    Pair hh = h.Output(M * N * 4);
    Pair ms = h.Output(M * 4);
    ProjectionForwardParams p[2];
    for (int b = 0; b < 2; ++b) {
      p[b].spec = &spec;
      p[b].tokens = M;
      p[b].act_dtype = e.dtype;
      p[b].x = x.ptr(b);
      p[b].weights.phi = phi.f(b);
      p[b].weights.gamma = gamma.f(b);
      p[b].h = hh.f(b);
      p[b].mean_square = ms.f(b);
    }
    cuda::ProjectionForwardAlignment alignment;
    alignment.x = AddressAlignment(p[1].x);
    alignment.phi = AddressAlignment(p[1].weights.phi);
    alignment.gamma =
        AddressAlignment(spec.has_gamma ? p[1].weights.gamma : nullptr);
    EXPECT_EQ(alignment.x, e.x_alignment);
    const cuda::ProjectionForwardPlan plan =
        cuda::PlanProjectionForward(spec, e.dtype, M, alignment);
    EXPECT_EQ(plan.row, static_cast<int>(i));
    EXPECT_EQ(cuda::ToString(plan.variant), want);
    EXPECT_EQ(h.cuda().KernelVariant(p[1]), want);
    if (!spec.dynamic) {
      // No projection to run: the backend refuses the launch.
      EXPECT_FALSE(h.cuda().ProjectionForward(p[1], Workspace{}).ok());
      continue;
    }
    for (int b = 0; b < 2; ++b) {
      Workspace ws = h.Scratch(b, OpKind::kProjectionForward, spec, M, e.dtype);
      const absl::Status status = h.backend(b).ProjectionForward(p[b], ws);
      ASSERT_TRUE(status.ok()) << status;
    }
    ASSERT_TRUE(h.cuda().Synchronize().ok());
    const double tol =
        spec.matmul_precision == MatmulPrecision::kIeee ? 1e-5 : 2e-3;
    ExpectClose(h, hh, DType::kF32, M * N, tol, false, "h");
    ExpectClose(h, ms, DType::kF32, M, 1e-5, false, "mean square");
  }
}

// The projection backward op for a dynamic row; dx and the phi gradient.
void CheckProjectionBackward(const PlanExample& e, const std::string& want,
                             int row) {
  const LayerSpec spec = e.Spec();
  const int64_t M = kTokens, K = spec.K(), N = spec.NumLogits();
  const size_t es = DTypeSize(e.dtype);
  Harness h;
  Placed x = PlaceAct(h, e.dtype, M * K, e.x_alignment);
  const float scale = 1.0f / std::sqrt(static_cast<float>(K));
  Pair phi = h.Floats(N * K, FreshSeed(), -scale, scale);
  Pair dh = h.Floats(M * N, FreshSeed());
  Pair dms = h.Floats(M, FreshSeed());
  Pair dx = h.Output(M * K * es);
  const std::vector<float> zeros(N * K, 0.0f);
  Pair gphi = h.Input(zeros.data(), N * K * 4);
  ProjectionBackwardParams p[2];
  for (int b = 0; b < 2; ++b) {
    p[b].spec = &spec;
    p[b].tokens = M;
    p[b].act_dtype = e.dtype;
    p[b].x = x.ptr(b);
    p[b].weights.phi = phi.f(b);
    p[b].dh = dh.f(b);
    p[b].dmean_square = dms.f(b);
    p[b].dx = dx.ptr(b);
    p[b].grads.phi = gphi.f(b);
  }
  cuda::ProjectionBackwardAlignment alignment;
  alignment.x = AddressAlignment(p[1].x);
  alignment.dx = AddressAlignment(p[1].dx);
  alignment.dh = AddressAlignment(p[1].dh);
  alignment.dms = AddressAlignment(p[1].dmean_square);
  alignment.phi = AddressAlignment(p[1].weights.phi);
  EXPECT_EQ(alignment.x, e.x_alignment);
  const cuda::ProjectionBackwardPlan plan =
      cuda::PlanProjectionBackward(spec, e.dtype, M, alignment, e.terms);
  EXPECT_EQ(plan.row, row);
  EXPECT_EQ(cuda::ToString(plan.variant), want);
  EXPECT_EQ(h.cuda().KernelVariant(p[1]), want);
  for (int b = 0; b < 2; ++b) {
    Workspace ws = h.Scratch(b, OpKind::kProjectionBackward, spec, M, e.dtype);
    const absl::Status status = h.backend(b).ProjectionBackward(p[b], ws);
    ASSERT_TRUE(status.ok()) << status;
  }
  ASSERT_TRUE(h.cuda().Synchronize().ok());
  const bool ieee = spec.matmul_precision == MatmulPrecision::kIeee;
  const double dx_tol = e.dtype != DType::kF32 ? 1e-2 : ieee ? 1e-4 : 2e-3;
  ExpectClose(h, dx, e.dtype, M * K, dx_tol, false, "dx");
  ExpectClose(h, gphi, DType::kF32, N * K, ieee ? kMixTol : 2e-3, false,
              "dphi");
}

// The fused pre backward with the aggregate term: the rows built for it
// (wgmma_n4_terms) and the fma row, whose launches at testable sizes are
// static layers' (dx the aggregate term alone).
void CheckPreBackward(const PlanExample& e, const std::string& want, int row) {
  const LayerSpec spec = e.Spec();
  ASSERT_TRUE(e.terms.aggregate && !e.terms.residual);
  const auto dtype = [&e] { return e.dtype; };  // what MHC_RUN_BOTH sizes for
  const int64_t M = kTokens, K = spec.K(), C = spec.hidden, n = spec.n;
  const int64_t N = spec.NumLogits();
  const size_t es = DTypeSize(e.dtype);
  Harness h;
  Placed x = PlaceAct(h, e.dtype, M * K, e.x_alignment);
  Pair beta = h.Floats(N, FreshSeed());
  const float scale = 1.0f / std::sqrt(static_cast<float>(K));
  Pair phi = h.Floats(N * K, FreshSeed(), -scale, scale);
  Pair alpha = h.Floats(3, FreshSeed(), 0.5f, 1.5f);
  Pair dy = h.Act(e.dtype, M * C, FreshSeed());
  Pair dhq = h.Floats(M * n, FreshSeed());
  Pair dhr = h.Floats(M * n * n, FreshSeed());
  Pair dx = h.Output(M * K * es);
  const std::vector<float> zeros(N, 0.0f);
  Pair gbeta = h.Input(zeros.data(), N * 4);
  PreBackwardParams q[2];
  for (int b = 0; b < 2; ++b) {
    q[b].spec = &spec;
    q[b].tokens = M;
    q[b].act_dtype = e.dtype;
    q[b].x = x.ptr(b);
    q[b].weights.beta = beta.f(b);
    if (spec.dynamic) {
      q[b].weights.phi = phi.f(b);
      q[b].weights.alpha = alpha.f(b);
    }
    q[b].dy = dy.ptr(b);
    q[b].dh_post = dhq.f(b);
    q[b].dh_res = dhr.f(b);
    q[b].dx = dx.ptr(b);
    q[b].grads.beta = gbeta.f(b);
  }
  cuda::ProjectionBackwardAlignment alignment;
  alignment.x = AddressAlignment(q[1].x);
  alignment.dx = AddressAlignment(q[1].dx);
  alignment.dy = AddressAlignment(q[1].dy);
  const cuda::ProjectionBackwardPlan plan =
      cuda::PlanProjectionBackward(spec, e.dtype, M, alignment, e.terms);
  EXPECT_EQ(plan.row, row);
  EXPECT_EQ(cuda::ToString(plan.variant), want);
  MHC_RUN_BOTH(PreBackward, q, OpKind::kPreBackward, spec, M);
  ExpectClose(h, dx, e.dtype, M * K, BackwardTol(e.dtype), false, "pre dx");
}

TEST(CudaDispatchTest, EveryBackwardRowRunsItsVariant) {
  MHC_SKIP_WITHOUT_GPU();
  const auto& rows = cuda::ProjectionBackwardRows();
  for (size_t i = 0; i < rows.size(); ++i) {
    const PlanExample& e = rows[i].example;
    const std::string want(cuda::ToString(rows[i].variant));
    SCOPED_TRACE(RowName(i, e, want));
    if (e.terms.aggregate || e.terms.residual) {
      CheckPreBackward(e, want, static_cast<int>(i));
    } else {
      CheckProjectionBackward(e, want, static_cast<int>(i));
    }
  }
}

}  // namespace
}  // namespace mhc::testing
