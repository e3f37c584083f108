// The determinism audit on fake launches whose (non-)determinism is known,
// so that both verdicts are exercised; the real kernels' verdict is in
// observability_test.
#include "server/determinism_audit.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "mhc/backend.h"
#include "mhc/status.h"

namespace mhc::server {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

TEST(CompareBitsTest, CountsUlpsAcrossZeroAndDtypes) {
  const float a[3] = {1.0f, 0.0f, -2.0f};
  float b[3] = {1.0f, -0.0f, -2.0f};
  UlpDiff same = CompareBits(DType::kF32, a, a, 3);
  EXPECT_EQ(same.first_differing, -1);
  EXPECT_EQ(same.max_ulp, 0u);
  // +0 and -0 differ in bits but are the same value.
  UlpDiff zeros = CompareBits(DType::kF32, a, b, 3);
  EXPECT_EQ(zeros.first_differing, 1);
  EXPECT_EQ(zeros.max_ulp, 0u);
  uint32_t next = Bits(-2.0f) + 3;  // three floats further from zero
  std::memcpy(&b[2], &next, sizeof(next));
  UlpDiff three = CompareBits(DType::kF32, a, b, 3);
  EXPECT_EQ(three.first_differing, 1);
  EXPECT_EQ(three.max_ulp, 3u);
  // bf16: the smallest positive and negative subnormals are 2 ulp apart.
  const uint16_t x[2] = {0x3f80, 0x0001};
  const uint16_t y[2] = {0x3f80, 0x8001};
  UlpDiff half = CompareBits(DType::kBF16, x, y, 2);
  EXPECT_EQ(half.first_differing, 1);
  EXPECT_EQ(half.max_ulp, 2u);
}

// Expand-shaped fakes: e [M, C] in, x [M, n*C] out, f32.
struct Fake {
  static inline int calls = 0;
  // Deterministic and batch invariant: x[m][k] = e[m][k % C].
  static absl::Status Good(Backend&, const BoundOp& op, Workspace) {
    ++calls;
    if (op.grads.beta != nullptr) *op.grads.beta += 1;
    const float* e = static_cast<const float*>(op.in[0]);
    float* x = static_cast<float*>(op.out[0]);
    const int64_t c = op.spec->hidden, k = op.spec->K();
    for (int64_t m = 0; m < op.tokens; ++m) {
      for (int64_t i = 0; i < k; ++i) x[m * k + i] = e[m * c + i % c];
    }
    return absl::OkStatus();
  }
  // Different bits on every call.
  static absl::Status Noisy(Backend& b, const BoundOp& op, Workspace ws) {
    MHC_RETURN_IF_ERROR(Good(b, op, ws));
    static_cast<float*>(op.out[0])[0] += static_cast<float>(calls);
    return absl::OkStatus();
  }
  // Deterministic, but the result depends on the token count.
  static absl::Status BatchVariant(Backend& b, const BoundOp& op,
                                   Workspace ws) {
    MHC_RETURN_IF_ERROR(Good(b, op, ws));
    float* x = static_cast<float*>(op.out[0]);
    for (int64_t i = 0; i < op.tokens * op.spec->K(); ++i) {
      x[i] += static_cast<float>(op.tokens);
    }
    return absl::OkStatus();
  }
};

class AuditTest : public ::testing::Test {
 protected:
  static constexpr int64_t kTokens = 5;

  void SetUp() override {
    spec_.n = 2;
    spec_.hidden = 3;
    e_.resize(kTokens * spec_.hidden);
    for (size_t i = 0; i < e_.size(); ++i) e_[i] = 0.25f * i - 1.0f;
    x_.resize(kTokens * spec_.K());
    bound_.spec = &spec_;
    bound_.tokens = kTokens;
    bound_.act_dtype = DType::kF32;
    bound_.in = {e_.data()};
    bound_.out = {x_.data()};
    bound_.grads.beta = &grad_;
  }

  // Runs `fn` as the request would, then audits it.
  v1::GetDeterminismReportResponse RunAndAudit(LaunchFn fn, double replay,
                                               double batch) {
    DeterminismAudit audit(replay, batch, /*metrics=*/nullptr);
    // As the executor sizes it: for the launch's token count.
    std::vector<char> scratch(backend_->WorkspaceBytes(
        OpKind::kExpandForward, spec_, kTokens, DType::kF32));
    const Workspace ws{scratch.data(), scratch.size()};
    EXPECT_TRUE(fn(*backend_, bound_, ws).ok());
    const float grad_after_launch = grad_;
    AuditedLaunch launch;
    launch.kind = OpKind::kExpandForward;
    launch.launch = fn;
    launch.bound = &bound_;
    launch.input_bytes = {e_.size() * sizeof(float)};
    launch.outputs = {{"x", DType::kF32, x_.size() * sizeof(float)}};
    launch.layer = "layer 'fake'";
    audit.MaybeAudit(*backend_, ws, launch);
    EXPECT_EQ(grad_, grad_after_launch) << "a re-run touched gradients";
    v1::GetDeterminismReportResponse report;
    audit.FillReport(&report);
    return report;
  }

  std::unique_ptr<Backend> backend_ = MakeCpuBackend(1);
  LayerSpec spec_;
  std::vector<float> e_, x_;
  float grad_ = 0;
  BoundOp bound_;
};

TEST_F(AuditTest, DeterministicLaunchMatchesBothChecks) {
  auto report = RunAndAudit(Fake::Good, 1, 1);
  ASSERT_EQ(report.checks_size(), 2) << report.DebugString();
  for (const auto& check : report.checks()) {
    EXPECT_EQ(check.op(), "expand");
    EXPECT_EQ(check.direction(), "forward");
    EXPECT_EQ(check.matches(), 1u) << check.check();
    EXPECT_EQ(check.mismatches(), 0u) << check.check();
  }
  EXPECT_EQ(report.recent_mismatches_size(), 0);
  EXPECT_EQ(grad_, 1.0f);  // the launch itself, once
}

TEST_F(AuditTest, NondeterministicLaunchIsCaughtByReplay) {
  auto report = RunAndAudit(Fake::Noisy, 1, 0);
  ASSERT_EQ(report.checks_size(), 1) << report.DebugString();
  EXPECT_EQ(report.checks(0).check(), "replay");
  EXPECT_EQ(report.checks(0).mismatches(), 1u);
  EXPECT_GT(report.checks(0).max_ulp_difference(), 0u);
  ASSERT_EQ(report.recent_mismatches_size(), 1);
  const auto& mismatch = report.recent_mismatches(0);
  EXPECT_EQ(mismatch.output(), "x");
  EXPECT_EQ(mismatch.element(), 0);
  EXPECT_EQ(mismatch.tokens(), kTokens);
  EXPECT_EQ(mismatch.layer(), "layer 'fake'");
}

TEST_F(AuditTest, BatchVariantLaunchIsCaughtOnlyByBatchInvariance) {
  auto report = RunAndAudit(Fake::BatchVariant, 1, 1);
  ASSERT_EQ(report.checks_size(), 2) << report.DebugString();
  for (const auto& check : report.checks()) {
    if (check.check() == "replay") {
      EXPECT_EQ(check.matches(), 1u);
    } else {
      EXPECT_EQ(check.check(), "batch_invariance");
      EXPECT_EQ(check.mismatches(), 1u);
    }
  }
}

TEST_F(AuditTest, ZeroRatesAuditNothing) {
  auto report = RunAndAudit(Fake::Noisy, 0, 0);
  EXPECT_EQ(report.checks_size(), 0);
  EXPECT_FALSE(DeterminismAudit(0, 0, nullptr).active());
}

}  // namespace
}  // namespace mhc::server
