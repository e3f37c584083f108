#include "server/executor.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "mhc/status.h"

namespace mhc::server {

Executor::Executor(std::unique_ptr<Backend> backend, std::string device)
    : device_(std::move(device)),
      backend_name_(backend->Name()),
      description_(backend->DeviceDescription()),
      host_accessible_(backend->HostAccessible()),
      backend_(std::move(backend)) {}

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
  return absl::OkStatus();
}

absl::Status Executor::Run(
    absl::FunctionRef<size_t(const Backend&)> workspace_fn,
    absl::FunctionRef<absl::Status(Backend&, Workspace)> fn) {
  absl::MutexLock lock(&mu_);
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
