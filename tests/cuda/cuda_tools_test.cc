// The device measurements beside the backend (mhc/cuda_tools.h): the copy
// bandwidth probe and the L2 reuse probe answer on a GPU and refuse
// configurations they cannot run.
#include "mhc/cuda_tools.h"

#include <cmath>
#include <vector>

#include "cuda_harness.h"
#include "gtest/gtest.h"

namespace mhc::testing {
namespace {

constexpr size_t kProbeBytes = size_t{64} << 20;

TEST(CudaToolsTest, CopyBandwidthIsPositive) {
  MHC_SKIP_WITHOUT_GPU();
  absl::StatusOr<double> bw = MeasureCudaCopyBandwidth(0);
  ASSERT_TRUE(bw.ok()) << bw.status();
  EXPECT_GT(*bw, 1e9);  // any GPU copies more than 1 GB/s
}

TEST(CudaToolsTest, L2ReuseProbeTimesEveryConfiguration) {
  MHC_SKIP_WITHOUT_GPU();
  std::vector<L2ReuseProbe> probes(4);
  probes[0].reread = false;
  probes[1].lag_bytes = 0;
  probes[2].lag_bytes = 8 << 20;
  probes[2].writes = true;
  probes[3].lag_bytes = 16 << 20;
  probes[3].hints = true;
  probes[3].writes = true;
  probes[3].unit_bytes = 256 << 10;
  absl::StatusOr<std::vector<double>> us =
      ProbeCudaL2Reuse(0, kProbeBytes, probes, 2);
  ASSERT_TRUE(us.ok()) << us.status();
  ASSERT_EQ(us->size(), probes.size());
  for (double t : *us) {
    EXPECT_TRUE(std::isfinite(t));
    EXPECT_GT(t, 0.0);
  }
}

TEST(CudaToolsTest, L2ReuseProbeRefusesWhatItCannotRun) {
  MHC_SKIP_WITHOUT_GPU();
  auto refused = [](L2ReuseProbe p) {
    absl::StatusOr<std::vector<double>> us =
        ProbeCudaL2Reuse(0, kProbeBytes, {p}, 1);
    return !us.ok() && absl::IsInvalidArgument(us.status());
  };
  L2ReuseProbe p;
  p.unit_bytes = 24 << 10;  // not a multiple of 16 KiB
  EXPECT_TRUE(refused(p));
  p = L2ReuseProbe{};
  p.lag_bytes = 48 << 10;  // not whole units
  EXPECT_TRUE(refused(p));
  p = L2ReuseProbe{};
  p.lag_bytes = kProbeBytes;  // the whole tensor back
  EXPECT_TRUE(refused(p));
  p = L2ReuseProbe{};
  p.ctas_per_sm = 0;
  EXPECT_TRUE(refused(p));
  EXPECT_FALSE(ProbeCudaL2Reuse(0, kProbeBytes, {L2ReuseProbe{}}, 0).ok());
}

}  // namespace
}  // namespace mhc::testing
