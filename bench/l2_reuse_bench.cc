// mhc_l2_reuse_bench: how far behind a stream of HBM reads a second read of
// the same bytes still hits L2 (mhc/cuda_tools.h, ProbeCudaL2Reuse). For
// each unit size it times the first read alone, then the first read with a
// re-read `lag` MiB behind it, with and without writes of a quarter of the
// re-read bytes and with and without L2 eviction hints. The re-read's cost
// is its time over the first read alone; where the lag exceeds what L2
// holds, the re-read goes to HBM and the run takes about twice as long.
//
//   mhc_l2_reuse_bench --gib=2 --units_kib=32,256 --lags_mib=0,16,32,64,128
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "mhc/cuda_tools.h"

ABSL_FLAG(int32_t, device, 0, "CUDA device");
ABSL_FLAG(double, gib, 2.0, "size of the streamed tensor in GiB");
ABSL_FLAG(std::string, units_kib, "32,256",
          "unit sizes in KiB (multiples of 16): the bytes a CTA reads "
          "before it re-reads");
ABSL_FLAG(std::string, lags_mib, "0,8,16,24,32,40,48,64,128",
          "re-read distances in MiB behind the unit just read");
ABSL_FLAG(int32_t, ctas_per_sm, 4, "resident CTAs per SM");
ABSL_FLAG(int32_t, reps, 5, "timed repetitions per probe (median)");

namespace {

bool ParseList(const std::string& text, std::vector<int64_t>* out) {
  for (absl::string_view piece : absl::StrSplit(text, ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(piece, &v) || v < 0) return false;
    out->push_back(v);
  }
  return !out->empty();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Times a second read of streamed bytes at several distances behind "
      "the first (L2 reuse), on one CUDA device.");
  absl::ParseCommandLine(argc, argv);
  std::vector<int64_t> units_kib, lags_mib;
  if (!ParseList(absl::GetFlag(FLAGS_units_kib), &units_kib) ||
      !ParseList(absl::GetFlag(FLAGS_lags_mib), &lags_mib)) {
    std::fprintf(stderr, "--units_kib and --lags_mib take lists of sizes\n");
    return 2;
  }
  const size_t x_bytes =
      static_cast<size_t>(absl::GetFlag(FLAGS_gib) * (1 << 30));
  const int ctas = absl::GetFlag(FLAGS_ctas_per_sm);

  struct Row {
    int64_t unit_kib, lag_mib;
    bool reread, writes, hints;
  };
  std::vector<Row> rows;
  std::vector<mhc::L2ReuseProbe> probes;
  for (int64_t unit : units_kib) {
    rows.push_back({unit, 0, false, false, false});
    for (int64_t lag : lags_mib) {
      for (bool writes : {false, true}) {
        for (bool hints : {false, true}) {
          rows.push_back({unit, lag, true, writes, hints});
        }
      }
    }
  }
  for (const Row& r : rows) {
    mhc::L2ReuseProbe p;
    p.unit_bytes = r.unit_kib << 10;
    // The lag in whole units, rounded down.
    p.lag_bytes = ((r.lag_mib << 20) / p.unit_bytes) * p.unit_bytes;
    p.reread = r.reread;
    p.writes = r.writes;
    p.hints = r.hints;
    p.ctas_per_sm = ctas;
    probes.push_back(p);
  }
  absl::StatusOr<std::vector<double>> us = mhc::ProbeCudaL2Reuse(
      absl::GetFlag(FLAGS_device), x_bytes, probes, absl::GetFlag(FLAGS_reps));
  if (!us.ok()) {
    std::fprintf(stderr, "%s\n", us.status().ToString().c_str());
    return 1;
  }
  std::printf("tensor %.2f GiB, %d CTAs per SM, median of %d\n",
              absl::GetFlag(FLAGS_gib), ctas, absl::GetFlag(FLAGS_reps));
  std::printf("%9s %8s %7s %6s %10s %12s %12s\n", "unit KiB", "lag MiB",
              "writes", "hints", "us", "first GB/s", "re-read cost");
  double first_only = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const double t = (*us)[i];
    const double gbs = static_cast<double>(x_bytes) / (t * 1e3);
    if (!r.reread) {
      first_only = t;
      std::printf("%9lld %8s %7s %6s %10.1f %12.0f %12s\n",
                  static_cast<long long>(r.unit_kib), "-", "-", "-", t, gbs,
                  "-");
      continue;
    }
    // The re-read's time as a share of the first read's: about 0 where it
    // hits L2 and overlaps, about 1 (1.25 with writes) where it goes to HBM.
    std::printf("%9lld %8lld %7s %6s %10.1f %12.0f %12.2f\n",
                static_cast<long long>(r.unit_kib),
                static_cast<long long>(r.lag_mib), r.writes ? "yes" : "no",
                r.hints ? "yes" : "no", t, gbs, t / first_only - 1.0);
  }
  return 0;
}
