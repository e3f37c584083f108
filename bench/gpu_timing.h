// Device timing shared by the GPU benchmarks: events on the backend's own
// stream (Backend::MakeDeviceTimer), an L2 flush through a buffer larger
// than L2 before every repetition so each one starts from DRAM, and the
// median. The flush writes the buffer (default) or reads it: a write leaves
// the L2 full of dirty lines, and an op that misses then pays for writing
// back as many bytes as it brings in, inside the timed region; a read
// leaves clean lines, which cost nothing to evict.
#ifndef MHC_BENCH_GPU_TIMING_H_
#define MHC_BENCH_GPU_TIMING_H_

#include <algorithm>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "mhc/backend.h"
#include "mhc/cuda.h"
#include "mhc/cuda_tools.h"

namespace mhc::bench {

inline double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t mid = v.size() / 2;
  return v.size() % 2 == 1 ? v[mid] : 0.5 * (v[mid - 1] + v[mid]);
}

enum class Flush { kWrite, kRead };

class FlushedTimer {
 public:
  // 256 MiB is several times the L2 of any Hopper part (50-60 MB).
  static constexpr size_t kFlushBytes = size_t{256} << 20;

  // kRead needs a CUDA backend (MakeCudaBackend).
  // head_start_us > 0 (needs a CUDA backend): a spin of that many
  // microseconds after the flush, before the start event (EnqueueCudaSpin),
  // so that a run whose host side enqueues slower than its kernels execute
  // is still timed by its kernels.
  static absl::StatusOr<std::unique_ptr<FlushedTimer>> Create(
      Backend& be, Flush mode = Flush::kWrite, double head_start_us = 0.0) {
    std::unique_ptr<DeviceTimer> timer = be.MakeDeviceTimer();
    if (timer == nullptr) {
      return absl::FailedPreconditionError("backend has no device timer");
    }
    absl::StatusOr<void*> flush = be.Allocate(kFlushBytes);
    if (!flush.ok()) return flush.status();
    // Defined contents for the read flush.
    absl::Status st = be.Memset(*flush, 0x5a, kFlushBytes);
    if (st.ok()) st = be.Synchronize();
    if (!st.ok()) {
      be.Free(*flush);
      return st;
    }
    return std::unique_ptr<FlushedTimer>(
        new FlushedTimer(be, std::move(timer), *flush, mode, head_start_us));
  }
  ~FlushedTimer() { be_.Free(flush_); }
  FlushedTimer(const FlushedTimer&) = delete;
  FlushedTimer& operator=(const FlushedTimer&) = delete;

  // Median microseconds of `reps` timed runs of `body` after `warmup`
  // untimed ones. The flush is queued on the same stream before the start
  // event, so it is ordered before the body but not timed (only what it
  // leaves in the L2 is).
  absl::StatusOr<double> MedianUs(int warmup, int reps,
                                  const std::function<absl::Status()>& body) {
    std::vector<double> us;
    for (int r = 0; r < warmup + reps; ++r) {
      absl::Status st = mode_ == Flush::kWrite
                            ? be_.Memset(flush_, r & 0xff, kFlushBytes)
                            : EnqueueCudaReadFlush(be_, flush_, kFlushBytes);
      if (st.ok() && head_start_us_ > 0.0) {
        st = EnqueueCudaSpin(be_, head_start_us_);
      }
      if (!st.ok()) return st;
      timer_->Start();
      st = body();
      absl::Status stopped = timer_->Stop();
      if (!st.ok()) return st;
      if (!stopped.ok()) return stopped;
      // Each repetition is read before the next flush is queued.
      if (st = be_.Synchronize(); !st.ok()) return st;
      absl::StatusOr<std::optional<double>> seconds = timer_->Poll();
      if (!seconds.ok()) return seconds.status();
      if (!seconds->has_value()) {
        return absl::InternalError("timer: no measurement after synchronize");
      }
      if (r >= warmup) us.push_back(**seconds * 1e6);
    }
    return Median(std::move(us));
  }

 private:
  FlushedTimer(Backend& be, std::unique_ptr<DeviceTimer> timer, void* flush,
               Flush mode, double head_start_us)
      : be_(be),
        timer_(std::move(timer)),
        flush_(flush),
        mode_(mode),
        head_start_us_(head_start_us) {}

  Backend& be_;
  std::unique_ptr<DeviceTimer> timer_;
  void* flush_;
  const Flush mode_;
  const double head_start_us_;
};

}  // namespace mhc::bench

#endif  // MHC_BENCH_GPU_TIMING_H_
