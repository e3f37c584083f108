// The device measurements beside the backend (mhc/cuda_tools.h): the copy
// bandwidth, L2 reuse and load stream probes answer on a GPU and refuse
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

TEST(CudaToolsTest, LoadStreamProbeReadsEveryBoxOnce) {
  MHC_SKIP_WITHOUT_GPU();
  std::vector<LoadStreamProbe> probes;
  LoadStreamProbe p;
  p.tokens = 64 * 37;  // tiles that do not divide among the CTAs
  p.channels = 64 * 11;
  probes.push_back(p);
  p.group_ctas = 3;  // uneven channel shares
  p.producers = 3;
  p.ring = 5;
  p.stream_major = false;
  probes.push_back(p);
  p.group_ctas = 2;
  p.producers = 2;
  p.box_channels = 128;
  p.channels = 128 * 5;
  p.ctas_per_sm = 2;
  probes.push_back(p);
  p.box_channels = 256;
  p.tokens = 16 * 3;  // fewer tiles than groups
  p.channels = 256 * 3;
  p.streams = 1;
  probes.push_back(p);
  absl::StatusOr<std::vector<LoadStreamResult>> results =
      ProbeCudaLoadStream(0, probes, 2);
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), probes.size());
  for (size_t i = 0; i < probes.size(); ++i) {
    const LoadStreamResult& r = (*results)[i];
    EXPECT_TRUE(r.every_box_once) << "probe " << i;
    EXPECT_GE(r.ctas_per_sm, 1) << "probe " << i;
    EXPECT_EQ(r.ctas % probes[i].group_ctas, 0) << "probe " << i;
    EXPECT_TRUE(std::isfinite(r.median_us) && r.median_us > 0) << "probe " << i;
  }
}

TEST(CudaToolsTest, LoadStreamProbeRefusesWhatItCannotRun) {
  MHC_SKIP_WITHOUT_GPU();
  auto refused = [](LoadStreamProbe p) {
    absl::StatusOr<std::vector<LoadStreamResult>> r =
        ProbeCudaLoadStream(0, {p}, 1);
    return !r.ok() && absl::IsInvalidArgument(r.status());
  };
  LoadStreamProbe p;
  p.box_channels = 96;
  EXPECT_TRUE(refused(p));
  p = LoadStreamProbe{};
  p.tokens = 100;  // not whole boxes
  EXPECT_TRUE(refused(p));
  p = LoadStreamProbe{};
  p.group_ctas = p.channels / 64 + 1;  // more CTAs than channel blocks
  EXPECT_TRUE(refused(p));
  p = LoadStreamProbe{};
  p.producers = 5;
  EXPECT_TRUE(refused(p));
  p = LoadStreamProbe{};
  p.ring = 0;
  EXPECT_TRUE(refused(p));
  EXPECT_FALSE(ProbeCudaLoadStream(0, {LoadStreamProbe{}}, 0).ok());
  // Rings larger than an SM's shared memory: reported, not run.
  p = LoadStreamProbe{};
  p.tokens = 64;
  p.producers = 4;
  p.ring = 32;
  absl::StatusOr<std::vector<LoadStreamResult>> r =
      ProbeCudaLoadStream(0, {p}, 1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].ctas_per_sm, 0);
}

}  // namespace
}  // namespace mhc::testing
