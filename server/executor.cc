#include "server/executor.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "mhc/status.h"

namespace mhc::server {

namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

class HostTimer : public DeviceTimer {
 public:
  void Start() override { start_ = Clock::now(); }
  absl::StatusOr<double> StopSeconds() override { return SecondsSince(start_); }

 private:
  Clock::time_point start_;
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
  // Backends whose ops return before the device is done (CUDA) bring their
  // own timer; for the rest the host clock around the call is exact.
  timer_ = backend_->MakeDeviceTimer();
  if (timer_ == nullptr) timer_ = std::make_unique<HostTimer>();
}

void Executor::SetMetrics(Metrics* metrics) {
  absl::MutexLock lock(&mu_);
  metrics_ = metrics;
  if (metrics_ == nullptr) return;
  // Present from the start so that dashboards show 0, not "no data".
  metrics_->AddQueueDepth(device_, 0);
  metrics_->SetWorkspaceBytes(device_, static_cast<double>(workspace_bytes_));
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
  absl::StatusOr<double> seconds = timer_->StopSeconds();
  if (!status.ok()) return status;
  if (!seconds.ok()) return seconds.status();
  sample.seconds = *seconds;
  metrics_->RecordKernel(device_, sample, copy_bandwidth_);
  return absl::OkStatus();
}

Executor::~Executor() {
  absl::MutexLock lock(&mu_);
  if (workspace_ != nullptr) backend_->Free(workspace_);
}

absl::Status Executor::EnsureWorkspace(size_t bytes) {
  if (bytes <= workspace_bytes_) return absl::OkStatus();
  // Grow geometrically (and to whole MiB) so that a slowly rising token
  // count reallocates a handful of times, not on every request.
  constexpr size_t kMiB = size_t{1} << 20;
  size_t grown = std::max(bytes, workspace_bytes_ + workspace_bytes_ / 2);
  grown = (grown + kMiB - 1) / kMiB * kMiB;
  if (workspace_ != nullptr) backend_->Free(workspace_);
  workspace_ = nullptr;
  workspace_bytes_ = 0;
  absl::StatusOr<void*> allocated = backend_->Allocate(grown);
  if (!allocated.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate a workspace of ", grown, " bytes on ",
                     device_, ": ", allocated.status().message()));
  }
  workspace_ = *allocated;
  workspace_bytes_ = grown;
  if (metrics_ != nullptr) {
    metrics_->SetWorkspaceBytes(device_, static_cast<double>(grown));
  }
  return absl::OkStatus();
}

absl::Status Executor::Run(
    absl::FunctionRef<size_t(const Backend&)> workspace_fn,
    absl::FunctionRef<absl::Status(Backend&, Workspace)> fn) {
  const Clock::time_point arrived = Clock::now();
  if (metrics_ != nullptr) metrics_->AddQueueDepth(device_, 1);
  absl::MutexLock lock(&mu_);
  if (metrics_ != nullptr) {
    metrics_->AddQueueDepth(device_, -1);
    metrics_->RecordQueueWait(device_, SecondsSince(arrived));
  }
  const size_t workspace_bytes = workspace_fn(*backend_);
  MHC_RETURN_IF_ERROR(EnsureWorkspace(workspace_bytes));
  Workspace workspace{workspace_bytes > 0 ? workspace_ : nullptr,
                      workspace_bytes > 0 ? workspace_bytes_ : 0};
  return fn(*backend_, workspace);
}

absl::Status Executor::WithDevice(
    absl::FunctionRef<absl::Status(Backend&)> fn) {
  absl::MutexLock lock(&mu_);
  return fn(*backend_);
}

absl::StatusOr<Admission::Ticket> Admission::TryEnter() {
  if (draining_.load()) {
    return absl::UnavailableError(
        "mhcd is draining (shutting down); retry on another instance");
  }
  int previous = inflight_.fetch_add(1);
  if (previous >= max_inflight_) {
    inflight_.fetch_sub(1);
    return absl::ResourceExhaustedError(absl::StrCat(
        "too many requests in flight (limit --max_inflight=", max_inflight_,
        "); retry later"));
  }
  return Ticket(this);
}

}  // namespace mhc::server
