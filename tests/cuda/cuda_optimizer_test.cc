// The CUDA optimizer step against the fp64 reference over several steps
// (every algorithm variant, with and without clipping, many blocks of every
// preset's shapes) and its run-to-run determinism. Skips without a GPU.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/optimizer_harness.h"
#include "gtest/gtest.h"
#include "mhc/backend.h"
#include "mhc/cuda.h"

namespace mhc::testing {
namespace {

#define MHC_SKIP_WITHOUT_GPU()                                  \
  do {                                                          \
    if (::mhc::CudaDeviceCount() == 0) {                        \
      GTEST_SKIP() << "no CUDA device: CUDA tests are skipped"; \
    }                                                           \
  } while (0)

using Variant = std::pair<std::string, OptimizerHyperparameters>;

class CudaOptimizerTest : public ::testing::TestWithParam<Variant> {
 protected:
  std::unique_ptr<Backend> Cuda() {
    absl::StatusOr<std::unique_ptr<Backend>> cuda = MakeCudaBackend(0);
    EXPECT_TRUE(cuda.ok()) << cuda.status();
    return cuda.ok() ? std::move(cuda).value() : nullptr;
  }
  OptimizerCase Case(float clip, bool zero_grads) const {
    OptimizerCase c;
    c.hyper = GetParam().second;
    c.hyper.max_grad_norm = clip;
    c.sizes = PresetBlockSizes();
    c.steps = 4;
    c.compute_norm = true;
    c.zero_grads = zero_grads;
    c.seed = FreshSeed();
    return c;
  }
};

TEST_P(CudaOptimizerTest, MatchesReferenceWithoutClipping) {
  MHC_SKIP_WITHOUT_GPU();
  auto cuda = Cuda();
  ASSERT_NE(cuda, nullptr);
  auto ref = MakeReferenceBackend();
  const OptimizerCase c = Case(0.0f, /*zero_grads=*/false);
  ExpectMatchesReference(RunOptimizer(*cuda, c), RunOptimizer(*ref, c), c);
}

TEST_P(CudaOptimizerTest, MatchesReferenceWithClipping) {
  MHC_SKIP_WITHOUT_GPU();
  auto cuda = Cuda();
  ASSERT_NE(cuda, nullptr);
  auto ref = MakeReferenceBackend();
  const OptimizerCase c = Case(0.5f, /*zero_grads=*/true);
  const OptimizerRun want = RunOptimizer(*ref, c);
  for (double norm : want.norms) EXPECT_GT(norm, 0.5);
  ExpectMatchesReference(RunOptimizer(*cuda, c), want, c);
}

TEST_P(CudaOptimizerTest, BitwiseDeterministic) {
  MHC_SKIP_WITHOUT_GPU();
  auto cuda = Cuda();
  ASSERT_NE(cuda, nullptr);
  const OptimizerCase c = Case(0.5f, /*zero_grads=*/false);
  const OptimizerRun first = RunOptimizer(*cuda, c);
  EXPECT_TRUE(BitwiseEqual(first, RunOptimizer(*cuda, c)));
}

INSTANTIATE_TEST_SUITE_P(Algorithms, CudaOptimizerTest,
                         ::testing::ValuesIn(OptimizerVariants()),
                         [](const ::testing::TestParamInfo<Variant>& info) {
                           return info.param.first;
                         });

}  // namespace
}  // namespace mhc::testing
