#include "server/executor.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <optional>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "mhc/status.h"
#include "server/log.h"

namespace mhc::server {

namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Host backends finish each op before returning: the clock around it is
// the device time, known at Stop.
class HostTimer : public DeviceTimer {
 public:
  void Start() override { start_ = Clock::now(); }
  absl::Status Stop() override {
    done_.push_back(SecondsSince(start_));
    return absl::OkStatus();
  }
  absl::StatusOr<std::optional<double>> Poll() override {
    if (done_.empty()) return std::optional<double>();
    const double seconds = done_.front();
    done_.pop_front();
    return std::optional<double>(seconds);
  }

 private:
  Clock::time_point start_;
  std::deque<double> done_;
};

}  // namespace

double MeasureHostCopyBandwidth() {
  // 64 MiB: well beyond the last-level cache of current server CPUs.
  constexpr size_t kBytes = size_t{64} << 20;
  constexpr int kRuns = 4;
  char* src = static_cast<char*>(std::aligned_alloc(64, kBytes));
  char* dst = static_cast<char*>(std::aligned_alloc(64, kBytes));
  double best = 0;
  if (src != nullptr && dst != nullptr) {
    std::memset(src, 1, kBytes);
    std::memset(dst, 0, kBytes);  // fault the pages in before timing
    for (int run = 0; run < kRuns; ++run) {
      const Clock::time_point start = Clock::now();
      std::memcpy(dst, src, kBytes);
      const double seconds = SecondsSince(start);
      if (seconds > 0) best = std::max(best, 2.0 * kBytes / seconds);
      src[run] = dst[kBytes - 1 - run];  // keep the copies observable
    }
  }
  std::free(src);
  std::free(dst);
  return best;
}

Executor::Executor(std::unique_ptr<Backend> backend, std::string device)
    : device_(std::move(device)),
      backend_name_(backend->Name()),
      description_(backend->DeviceDescription()),
      host_accessible_(backend->HostAccessible()),
      backend_(std::move(backend)) {
  absl::string_view device_name = device_;
  // Backends whose ops return before the device is done (CUDA) bring their
  // own timer; for the rest the host clock around the call is exact.
  if (absl::ConsumePrefix(&device_name, "cuda:") &&
      !absl::SimpleAtoi(device_name, &cuda_ordinal_)) {
    cuda_ordinal_ = -1;
  }
  timer_ = backend_->MakeDeviceTimer();
  if (timer_ == nullptr) timer_ = std::make_unique<HostTimer>();
}

void Executor::SetMetrics(Metrics* metrics) {
  absl::MutexLock lock(&mu_);
  metrics_ = metrics;
  if (metrics_ == nullptr) return;
  // Present from the start so that dashboards show 0, not "no data".
  metrics_->AddQueueDepth(device_, 0);
  metrics_->RecordHostSync(device_, "request", 0);
  metrics_->SetWorkspaceBytes(device_, static_cast<double>(workspace_bytes_));
  metrics_->SetStagingBytes(device_, static_cast<double>(staging_bytes_));
}

void Executor::SetCopyBandwidth(double bytes_per_second) {
  copy_bandwidth_ = bytes_per_second;
  if (metrics_ != nullptr) {
    metrics_->SetCopyBandwidth(device_, bytes_per_second);
  }
}

absl::Status Executor::Launch(KernelSample sample,
                              absl::FunctionRef<absl::Status()> fn) {
  if (metrics_ == nullptr) return fn();
  timer_->Start();
  absl::Status status = fn();
  absl::Status stopped = timer_->Stop();
  if (!status.ok()) return status;
  if (!stopped.ok()) return stopped;
  // Read when the request ends (Finish), without waiting for the device.
  timed_.push_back(sample);
  return absl::OkStatus();
}

absl::Status Executor::CollectTimings() {
  while (!timed_.empty()) {
    MHC_ASSIGN_OR_RETURN(std::optional<double> seconds, timer_->Poll());
    if (!seconds.has_value()) break;
    KernelSample sample = timed_.front();
    timed_.pop_front();
    sample.seconds = *seconds;
    metrics_->RecordKernel(device_, sample, copy_bandwidth_);
  }
  return absl::OkStatus();
}

void Executor::PollTimings() {
  if (metrics_ == nullptr || !mu_.TryLock()) return;
  // A failure here reaches the next request through CheckDevice.
  CollectTimings().IgnoreError();
  mu_.Unlock();
}

absl::Status Executor::CheckDevice() {
  if (!failed_.ok()) return failed_;
  absl::Status status = backend_->CheckDevice();
  if (status.ok()) return status;
  failed_ = absl::InternalError(
      absl::StrCat(device_,
                   " failed and serves no more requests (restart "
                   "mhcd): ",
                   status.message()));
  Log(LogLevel::kError, failed_.message());
  if (on_failure_) on_failure_(failed_);
  return failed_;
}

absl::Status Executor::Synchronize(Backend& backend, absl::string_view reason) {
  if (metrics_ != nullptr) metrics_->RecordHostSync(device_, reason);
  return backend.Synchronize();
}

Executor::~Executor() {
  absl::MutexLock lock(&mu_);
  if (workspace_ != nullptr) backend_->Free(workspace_);
  if (staging_ != nullptr) backend_->Free(staging_);
}

absl::Status Executor::EnsureBuffer(const char* what, size_t bytes,
                                    void** buffer, size_t* capacity) {
  if (bytes <= *capacity) return absl::OkStatus();
  // Grow geometrically (and to whole MiB) so that a slowly rising token
  // count reallocates a handful of times, not on every request. The old
  // buffer goes first so that both never need to fit at once; Free waits
  // for the work still using it.
  constexpr size_t kMiB = size_t{1} << 20;
  size_t grown = std::max(bytes, *capacity + *capacity / 2);
  grown = (grown + kMiB - 1) / kMiB * kMiB;
  if (*buffer != nullptr) backend_->Free(*buffer);
  *buffer = nullptr;
  *capacity = 0;
  absl::StatusOr<void*> allocated = backend_->Allocate(grown);
  if (!allocated.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", what, " of ", grown, " bytes on ",
                     device_, ": ", allocated.status().message()));
  }
  *buffer = *allocated;
  *capacity = grown;
  return absl::OkStatus();
}

absl::StatusOr<void*> StagingArena::Take(uint64_t bytes) {
  if (bytes == 0) return nullptr;
  const uint64_t footprint = Footprint(bytes);
  if (footprint > capacity_ - used_) {
    return absl::InternalError(absl::StrCat(
        "staging: a piece of ", bytes, " bytes does not fit (", used_, " of ",
        capacity_, " bytes used); the request was sized wrong"));
  }
  void* piece = base_ + used_;
  used_ += footprint;
  return piece;
}

absl::Status Executor::Run(
    absl::FunctionRef<size_t(const Backend&)> workspace_fn,
    uint64_t staging_bytes,
    absl::FunctionRef<absl::Status(Backend&, Workspace, StagingArena&)> fn) {
  const Clock::time_point arrived = Clock::now();
  if (metrics_ != nullptr) metrics_->AddQueueDepth(device_, 1);
  absl::MutexLock lock(&mu_);
  if (metrics_ != nullptr) {
    metrics_->AddQueueDepth(device_, -1);
    metrics_->RecordQueueWait(device_, SecondsSince(arrived));
  }
  MHC_RETURN_IF_ERROR(CheckAccepting());
  // Work of an earlier request that failed after it was answered is
  // reported here, to the next request of the device.
  MHC_RETURN_IF_ERROR(CheckDevice());
  const size_t workspace_bytes = workspace_fn(*backend_);
  const size_t had_workspace = workspace_bytes_, had_staging = staging_bytes_;
  absl::Status grown = EnsureBuffer("a workspace", workspace_bytes, &workspace_,
                                    &workspace_bytes_);
  if (grown.ok()) {
    grown = EnsureBuffer("staging memory", staging_bytes, &staging_,
                         &staging_bytes_);
  }
  if (metrics_ != nullptr && workspace_bytes_ != had_workspace) {
    metrics_->SetWorkspaceBytes(device_, static_cast<double>(workspace_bytes_));
  }
  if (metrics_ != nullptr && staging_bytes_ != had_staging) {
    metrics_->SetStagingBytes(device_, static_cast<double>(staging_bytes_));
  }
  MHC_RETURN_IF_ERROR(grown);
  Workspace workspace{workspace_bytes > 0 ? workspace_ : nullptr,
                      workspace_bytes > 0 ? workspace_bytes_ : 0};
  // Only the bytes asked for, so that a request sized wrong fails here
  // instead of taking what a larger, earlier request left.
  StagingArena staging(staging_, staging_bytes);
  absl::Status status = fn(*backend_, workspace, staging);
  return Finish(std::move(status));
}

absl::Status Executor::WithDevice(
    absl::FunctionRef<absl::Status(Backend&)> fn) {
  absl::MutexLock lock(&mu_);
  MHC_RETURN_IF_ERROR(CheckAccepting());
  MHC_RETURN_IF_ERROR(CheckDevice());
  return Finish(fn(*backend_));
}

absl::Status Executor::CheckAccepting() const {
  if (!refusing_.load()) return absl::OkStatus();
  return absl::UnavailableError(
      "mhcd is draining and --drain_timeout has passed; the request did not "
      "run, retry on another instance");
}

absl::Status Executor::Finish(absl::Status status) {
  // A failure of the device itself outranks the request's own message; a
  // request that failed for its own reasons leaves a healthy device.
  if (!status.ok() && status.code() == absl::StatusCode::kInternal) {
    MHC_RETURN_IF_ERROR(CheckDevice());
  }
  if (metrics_ != nullptr) {
    absl::Status collected = CollectTimings();
    if (status.ok()) status = collected;
  }
  return status;
}

}  // namespace mhc::server
