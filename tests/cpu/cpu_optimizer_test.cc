// The fast CPU optimizer step against the fp64 reference over several steps
// (every algorithm variant, with and without clipping, many blocks of every
// preset's shapes), its determinism, and the Backend entry point's checks.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/optimizer_harness.h"
#include "gtest/gtest.h"
#include "mhc/backend.h"

namespace mhc::testing {
namespace {

using Variant = std::pair<std::string, OptimizerHyperparameters>;

class CpuOptimizerTest : public ::testing::TestWithParam<Variant> {};

OptimizerCase MakeCase(const OptimizerHyperparameters& hyper, float clip) {
  OptimizerCase c;
  c.hyper = hyper;
  c.hyper.max_grad_norm = clip;
  c.sizes = PresetBlockSizes();
  c.steps = 4;
  c.compute_norm = true;
  c.seed = FreshSeed();
  return c;
}

TEST_P(CpuOptimizerTest, MatchesReferenceWithoutClipping) {
  const OptimizerCase c = MakeCase(GetParam().second, 0.0f);
  auto cpu = MakeCpuBackend(3);
  auto ref = MakeReferenceBackend();
  const OptimizerRun want = RunOptimizer(*ref, c);
  ExpectMatchesReference(RunOptimizer(*cpu, c), want, c);
  // The step moved the parameters.
  const OptimizerRun start = [&] {
    OptimizerCase none = c;
    none.steps = 0;
    return RunOptimizer(*ref, none);
  }();
  EXPECT_NE(want.values, start.values);
}

TEST_P(CpuOptimizerTest, MatchesReferenceWithClipping) {
  // Far below the gradients' norm, so every step clips.
  OptimizerCase c = MakeCase(GetParam().second, 0.5f);
  c.zero_grads = true;
  auto cpu = MakeCpuBackend(3);
  auto ref = MakeReferenceBackend();
  const OptimizerRun want = RunOptimizer(*ref, c);
  for (double norm : want.norms) EXPECT_GT(norm, 0.5);
  const OptimizerRun got = RunOptimizer(*cpu, c);
  ExpectMatchesReference(got, want, c);
  for (const auto& grads : got.grads) {
    EXPECT_EQ(grads, std::vector<float>(grads.size(), 0.0f));
  }
  // Clipping changed the outcome.
  OptimizerCase unclipped = c;
  unclipped.hyper.max_grad_norm = 0.0f;
  EXPECT_NE(RunOptimizer(*ref, unclipped).values, want.values);
}

TEST_P(CpuOptimizerTest, BitwiseDeterministicAcrossRunsAndThreads) {
  const OptimizerCase c = MakeCase(GetParam().second, 0.5f);
  auto one = MakeCpuBackend(1);
  auto three = MakeCpuBackend(3);
  const OptimizerRun first = RunOptimizer(*three, c);
  EXPECT_TRUE(BitwiseEqual(first, RunOptimizer(*three, c)));
  EXPECT_TRUE(BitwiseEqual(first, RunOptimizer(*one, c)));
}

INSTANTIATE_TEST_SUITE_P(Algorithms, CpuOptimizerTest,
                         ::testing::ValuesIn(OptimizerVariants()),
                         [](const ::testing::TestParamInfo<Variant>& info) {
                           return info.param.first;
                         });

// The gradient norm is the norm of the gradients the step saw, and it does
// not depend on how the blocks split the elements.
TEST(CpuOptimizerNormTest, NormOfKnownGradients) {
  auto cpu = MakeCpuBackend(2);
  std::vector<float> values(kNormChunk * 2 + 3, 0.0f);
  std::vector<float> grads(values.size(), 0.5f);
  std::vector<float> slots(values.size(), 0.0f);
  OptimizerTensor t{values.data(), grads.data(), slots.data(),
                    static_cast<int64_t>(values.size()), 1};
  OptimizerStepParams p;
  p.hyper.learning_rate = 1.0f;
  p.hyper.max_grad_norm = 1.0f;
  p.tensors = &t;
  p.num_tensors = 1;
  double norm = 0.0;
  p.grad_norm = &norm;
  std::vector<double> ws(cpu->OptimizerWorkspaceBytes(p) / sizeof(double));
  ASSERT_TRUE(cpu->OptimizerStep(p, {ws.data(), ws.size() * 8}).ok());
  const double want = 0.5 * std::sqrt(static_cast<double>(values.size()));
  EXPECT_DOUBLE_EQ(norm, want);
  // Clipped to norm 1: each element moved by lr * 0.5 / (norm + 1e-6).
  EXPECT_FLOAT_EQ(values[0], static_cast<float>(-0.5 / (want + 1e-6)));
}

class OptimizerValidationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    t_ = {values_.data(), grads_.data(), slots_.data(), 4, 1};
    p_.hyper.learning_rate = 0.1f;
    p_.tensors = &t_;
    p_.num_tensors = 1;
  }
  absl::Status Run() { return cpu_->OptimizerStep(p_, {}); }

  std::unique_ptr<Backend> cpu_ = MakeCpuBackend(1);
  std::vector<float> values_ = std::vector<float>(4, 1.0f);
  std::vector<float> grads_ = std::vector<float>(4, 1.0f);
  std::vector<float> slots_ = std::vector<float>(8, 0.0f);
  OptimizerTensor t_;
  OptimizerStepParams p_;
};

TEST_F(OptimizerValidationTest, RejectsBadHyperparameters) {
  ASSERT_TRUE(Run().ok());
  auto expect = [&](const char* field) {
    absl::Status status = Run();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(status.message().find(field), std::string::npos) << status;
  };
  p_.hyper.learning_rate = -1.0f;
  expect("learning_rate");
  p_.hyper.learning_rate = NAN;
  expect("learning_rate");
  p_.hyper.learning_rate = 0.1f;
  p_.hyper.momentum = 1.5f;
  expect("momentum");
  p_.hyper.momentum = 0.0f;
  p_.hyper.nesterov = true;
  expect("nesterov");
  p_.hyper.nesterov = false;
  p_.hyper.algorithm = OptimizerAlgorithm::kAdamW;
  p_.hyper.beta2 = 1.0f;
  expect("beta2");
  p_.hyper.beta2 = 0.999f;
  p_.hyper.epsilon = 0.0f;
  expect("epsilon");
  p_.hyper.epsilon = 1e-8f;
  p_.hyper.weight_decay = INFINITY;
  expect("weight_decay");
}

TEST_F(OptimizerValidationTest, RejectsBadBlocksAndWorkspace) {
  t_.step = 0;
  EXPECT_EQ(Run().code(), absl::StatusCode::kInvalidArgument);
  t_.step = 1;
  t_.slots = nullptr;
  EXPECT_EQ(Run().code(), absl::StatusCode::kInvalidArgument);
  t_.slots = slots_.data();
  // Clipping needs the norm's destination and the workspace for it.
  p_.hyper.max_grad_norm = 1.0f;
  EXPECT_EQ(Run().code(), absl::StatusCode::kInvalidArgument);
  double norm = 0.0;
  p_.grad_norm = &norm;
  EXPECT_EQ(Run().code(), absl::StatusCode::kInvalidArgument);
  // Nothing was written by the refused steps.
  EXPECT_EQ(values_, std::vector<float>(4, 1.0f));
}

}  // namespace
}  // namespace mhc::testing
