// Kernel time as the device saw it: a pair of events on the backend's stream
// around each measured launch, without draining the stream before the first
// one (the host clock would count launch latency and queueing instead) and
// without waiting for the second (Poll reads only finished pairs), so that
// timing every launch never holds the host.
#include <algorithm>
#include <cstddef>
#include <memory>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common.cuh"
#include "cuda_backend.h"

namespace mhc::cuda {
namespace {

class EventTimer final : public DeviceTimer {
 public:
  EventTimer(int device, cudaStream_t stream)
      : device_(device), stream_(stream) {}
  ~EventTimer() override {
    if (cudaSetDevice(device_) != cudaSuccess) return;
    while (pending_count_ > 0) free_.push_back(PopPending());
    if (open_.has_value()) free_.push_back(*open_);
    for (const Pair& pair : free_) {
      cudaEventDestroy(pair.start);
      cudaEventDestroy(pair.stop);
    }
  }

  void Start() override {
    // A failure resurfaces from Stop, which reports it.
    open_.reset();
    start_error_ = cudaSetDevice(device_);
    if (start_error_ != cudaSuccess) return;
    if (free_.empty()) {
      Pair pair;
      start_error_ = cudaEventCreate(&pair.start);
      if (start_error_ != cudaSuccess) return;
      start_error_ = cudaEventCreate(&pair.stop);
      if (start_error_ != cudaSuccess) {
        cudaEventDestroy(pair.start);
        return;
      }
      free_.push_back(pair);
    }
    open_ = free_.back();
    free_.pop_back();
    start_error_ = cudaEventRecord(open_->start, stream_);
  }

  absl::Status Stop() override {
    if (!open_.has_value() || start_error_ != cudaSuccess) {
      if (open_.has_value()) free_.push_back(*open_);
      open_.reset();
      MHC_CUDA_RETURN_IF_ERROR(start_error_, "timer start", Device());
      return absl::FailedPreconditionError("timer: Stop without Start");
    }
    const Pair pair = *open_;
    open_.reset();
    const cudaError_t error = cudaEventRecord(pair.stop, stream_);
    if (error != cudaSuccess) free_.push_back(pair);
    MHC_CUDA_RETURN_IF_ERROR(error, "timer stop", Device());
    PushPending(pair);
    return absl::OkStatus();
  }

  absl::StatusOr<std::optional<double>> Poll() override {
    if (pending_count_ == 0) return std::optional<double>();
    MHC_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "timer", Device());
    const Pair pair = pending_[pending_head_];
    const cudaError_t done = cudaEventQuery(pair.stop);
    if (done == cudaErrorNotReady) return std::optional<double>();
    PopPending();
    free_.push_back(pair);
    MHC_CUDA_RETURN_IF_ERROR(done, "timer", Device());
    float ms = 0;
    MHC_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, pair.start, pair.stop),
                             "timer", Device());
    return std::optional<double>(ms * 1e-3);
  }

 private:
  // Named in error messages only: Stop and Poll run on every timed call.
  std::string Device() const { return absl::StrCat("device ", device_); }
  struct Pair {
    cudaEvent_t start = nullptr;
    cudaEvent_t stop = nullptr;
  };

  void PushPending(const Pair& pair) {
    if (pending_count_ == pending_.size()) {
      std::vector<Pair> grown(std::max<size_t>(8, 2 * pending_.size()));
      for (size_t i = 0; i < pending_count_; ++i) {
        grown[i] = pending_[(pending_head_ + i) % pending_.size()];
      }
      pending_.swap(grown);
      pending_head_ = 0;
    }
    pending_[(pending_head_ + pending_count_) % pending_.size()] = pair;
    ++pending_count_;
  }
  Pair PopPending() {
    const Pair pair = pending_[pending_head_];
    pending_head_ = (pending_head_ + 1) % pending_.size();
    --pending_count_;
    return pair;
  }

  const int device_;
  const cudaStream_t stream_;
  // Pairs are reused once read, so the pool grows only to the launches the
  // device runs behind the host.
  std::vector<Pair> free_;
  // Stopped pairs in stop order, a ring of pending_.size() slots that grows
  // only when the device runs further behind than before (a deque would
  // allocate a block every few dozen timed calls).
  std::vector<Pair> pending_;
  size_t pending_head_ = 0;
  size_t pending_count_ = 0;
  std::optional<Pair> open_;
  cudaError_t start_error_ = cudaSuccess;
};

}  // namespace

std::unique_ptr<DeviceTimer> CudaBackend::MakeDeviceTimer() {
  return std::make_unique<EventTimer>(device_, stream_);
}

}  // namespace mhc::cuda
