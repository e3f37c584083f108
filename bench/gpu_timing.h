// Device timing shared by the GPU benchmarks: events on the backend's own
// stream (Backend::MakeDeviceTimer), a write of a buffer larger than L2 before
// every repetition so each one starts from DRAM, and the median.
#ifndef MHC_BENCH_GPU_TIMING_H_
#define MHC_BENCH_GPU_TIMING_H_

#include <algorithm>
#include <cstddef>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "mhc/backend.h"

namespace mhc::bench {

inline double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t mid = v.size() / 2;
  return v.size() % 2 == 1 ? v[mid] : 0.5 * (v[mid - 1] + v[mid]);
}

class FlushedTimer {
 public:
  // 256 MiB is several times the L2 of any Hopper part (50-60 MB).
  static constexpr size_t kFlushBytes = size_t{256} << 20;

  static absl::StatusOr<std::unique_ptr<FlushedTimer>> Create(Backend& be) {
    std::unique_ptr<DeviceTimer> timer = be.MakeDeviceTimer();
    if (timer == nullptr) {
      return absl::FailedPreconditionError("backend has no device timer");
    }
    absl::StatusOr<void*> flush = be.Allocate(kFlushBytes);
    if (!flush.ok()) return flush.status();
    return std::unique_ptr<FlushedTimer>(
        new FlushedTimer(be, std::move(timer), *flush));
  }
  ~FlushedTimer() { be_.Free(flush_); }
  FlushedTimer(const FlushedTimer&) = delete;
  FlushedTimer& operator=(const FlushedTimer&) = delete;

  // Median microseconds of `reps` timed runs of `body` after `warmup`
  // untimed ones. The flush is queued on the same stream before the start
  // event, so it is ordered before the body but not timed.
  absl::StatusOr<double> MedianUs(int warmup, int reps,
                                  const std::function<absl::Status()>& body) {
    std::vector<double> us;
    for (int r = 0; r < warmup + reps; ++r) {
      absl::Status st = be_.Memset(flush_, r & 0xff, kFlushBytes);
      if (!st.ok()) return st;
      timer_->Start();
      st = body();
      absl::StatusOr<double> seconds = timer_->StopSeconds();
      if (!st.ok()) return st;
      if (!seconds.ok()) return seconds.status();
      if (r >= warmup) us.push_back(*seconds * 1e6);
    }
    return Median(std::move(us));
  }

 private:
  FlushedTimer(Backend& be, std::unique_ptr<DeviceTimer> timer, void* flush)
      : be_(be), timer_(std::move(timer)), flush_(flush) {}

  Backend& be_;
  std::unique_ptr<DeviceTimer> timer_;
  void* flush_;
};

}  // namespace mhc::bench

#endif  // MHC_BENCH_GPU_TIMING_H_
