// The reference optimizer step against values worked out by hand from the
// update rules (mhc/ops/optimizer.h), so the oracle itself is checked.
#include <cmath>
#include <vector>

#include "cpu/reference/reference_math.h"
#include "gtest/gtest.h"
#include "mhc/backend.h"

namespace mhc::reference {
namespace {

TEST(ReferenceOptimizerTest, SgdNesterovTwoSteps) {
  OptimizerHyperparameters h;
  h.learning_rate = 0.125f;
  h.momentum = 0.5f;
  h.nesterov = true;
  double value = 1.0;
  double buffer = 0.0;
  const double grad = 0.5;
  // b = 0.5; g = 0.5 + 0.5 * 0.5 = 0.75; p = 1 - 0.125 * 0.75.
  OptimizerUpdate(h, 1, 1.0, 1, &grad, &value, &buffer);
  EXPECT_DOUBLE_EQ(buffer, 0.5);
  EXPECT_DOUBLE_EQ(value, 0.90625);
  // b = 0.25 + 0.5 = 0.75; g = 0.5 + 0.375 = 0.875; p -= 0.125 * 0.875.
  OptimizerUpdate(h, 2, 1.0, 1, &grad, &value, &buffer);
  EXPECT_DOUBLE_EQ(buffer, 0.75);
  EXPECT_DOUBLE_EQ(value, 0.796875);
}

TEST(ReferenceOptimizerTest, SgdWeightDecayAndClipScale) {
  OptimizerHyperparameters h;
  h.learning_rate = 0.5f;
  h.weight_decay = 0.25f;
  double value = 2.0;
  double buffer = 0.0;
  const double grad = 4.0;
  // g = 4 * 0.25 + 0.25 * 2 = 1.5; p = 2 - 0.75.
  OptimizerUpdate(h, 1, 0.25, 1, &grad, &value, &buffer);
  EXPECT_DOUBLE_EQ(value, 1.25);
  EXPECT_DOUBLE_EQ(buffer, 0.0);  // no momentum: the buffer stays
  EXPECT_DOUBLE_EQ(ClipScale(3.0, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(ClipScale(0.5, 1.0), 1.0);
  EXPECT_NEAR(ClipScale(4.0, 1.0), 0.25, 1e-7);
}

TEST(ReferenceOptimizerTest, AdamWFirstStepIsBiasCorrected) {
  OptimizerHyperparameters h;
  h.algorithm = OptimizerAlgorithm::kAdamW;
  h.learning_rate = 0.1f;
  h.weight_decay = 0.5f;
  h.beta1 = 0.5f;
  h.beta2 = 0.75f;
  h.epsilon = 0.25f;
  double value = 1.0;
  double slots[2] = {0.0, 0.0};
  const double grad = 2.0;
  OptimizerUpdate(h, 1, 1.0, 1, &grad, &value, slots);
  // m = 1, v = 1; m_hat = 2, sqrt(v_hat) = 2; decay 1 - 0.05 first.
  EXPECT_DOUBLE_EQ(slots[0], 1.0);
  EXPECT_DOUBLE_EQ(slots[1], 1.0);
  const double lr = 0.1f;  // as the fp32 hyperparameter widens
  const double want = (1.0 - lr * 0.5) - lr * 2.0 / (2.0 + 0.25);
  EXPECT_NEAR(value, want, 1e-15);
}

TEST(ReferenceOptimizerTest, BackendSumsTheNormOverEveryBlock) {
  auto ref = MakeReferenceBackend();
  std::vector<float> v1(3, 0.0f), g1 = {3.0f, 0.0f, 0.0f}, s1(3, 0.0f);
  std::vector<float> v2(1, 0.0f), g2 = {4.0f}, s2(1, 0.0f);
  OptimizerTensor tensors[2] = {{v1.data(), g1.data(), s1.data(), 3, 1},
                                {v2.data(), g2.data(), s2.data(), 1, 1}};
  OptimizerStepParams p;
  p.hyper.learning_rate = 1.0f;
  p.hyper.max_grad_norm = 1.0f;
  p.tensors = tensors;
  p.num_tensors = 2;
  p.zero_grads = true;
  double norm = 0.0;
  p.grad_norm = &norm;
  std::vector<double> ws(ref->OptimizerWorkspaceBytes(p) / sizeof(double));
  ASSERT_TRUE(ref->OptimizerStep(p, {ws.data(), ws.size() * 8}).ok());
  EXPECT_DOUBLE_EQ(norm, 5.0);
  // Clipped to norm 1: the update is the gradient over 5.
  EXPECT_NEAR(v1[0], -0.6, 1e-6);
  EXPECT_NEAR(v2[0], -0.8, 1e-6);
  EXPECT_EQ(g1, std::vector<float>(3, 0.0f));
  EXPECT_EQ(g2, std::vector<float>(1, 0.0f));
}

}  // namespace
}  // namespace mhc::reference
