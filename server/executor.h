// Per-device execution.
//
// Executor owns one Backend. Every use of the device (ops, parameter reads
// and writes, allocation) goes through it under one mutex, which is what
// makes gradient accumulation happen in a fixed order and lets backends
// assume a single caller. It keeps two buffers that only grow, the kernel
// workspace and the staging memory of backends without host access, so
// steady-state requests allocate nothing on the device.
//
// It is also where kernels are measured: every launch, from a single-op RPC
// or an Execute batch, passes through Launch() exactly once, which times it
// on the device and records time, bytes and roofline fraction once the
// device has run it (read without waiting, at later launches and requests).
//
// A device whose earlier work failed (a sticky CUDA error: the context is
// lost) fails every later request with INTERNAL, and the executor reports
// it once through the failure callback, which marks the daemon NOT_SERVING.
#ifndef MHC_SERVER_EXECUTOR_H_
#define MHC_SERVER_EXECUTOR_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mhc/backend.h"
#include "server/metrics.h"

namespace mhc::server {

class DeterminismAudit;

// Bytes read plus written per second by memcpy of a buffer larger than the
// caches, best of a few runs: the roofline denominator of host backends.
// Single threaded, so a multithreaded kernel can exceed it.
double MeasureHostCopyBandwidth();

// Device memory of one request for the tensors it stages on a backend
// without host access (copies of host inputs, outputs on their way to the
// host, and the intermediate outputs of a batch): consecutive pieces of the
// executor's staging buffer, handed out in request order and never reused
// within the request. The request synchronizes with the device before it
// ends, so the next one may reuse the bytes without racing a copy.
class StagingArena {
 public:
  // Every piece starts on a multiple of this (as cudaMalloc's do), so that
  // kernels may use their widest vector loads.
  static constexpr uint64_t kAlignment = 256;
  // The bytes Take(bytes) uses up.
  static uint64_t Footprint(uint64_t bytes) {
    return (bytes + kAlignment - 1) / kAlignment * kAlignment;
  }

  StagingArena(void* base, uint64_t capacity)
      : base_(static_cast<char*>(base)), capacity_(capacity) {}

  // The next `bytes` bytes, null for 0. INTERNAL when the request asked the
  // executor for fewer bytes than it takes: a sizing bug, never the
  // client's.
  absl::StatusOr<void*> Take(uint64_t bytes);

 private:
  char* const base_;
  const uint64_t capacity_;
  uint64_t used_ = 0;
};

class Executor {
 public:
  // `device` names the device in the API ("cpu", "cuda:0").
  Executor(std::unique_ptr<Backend> backend, std::string device);
  ~Executor();

  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  const std::string& device() const { return device_; }
  // Immutable properties, safe to read without holding the device.
  std::string BackendName() const { return backend_name_; }
  std::string Description() const { return description_; }
  bool HostAccessible() const { return host_accessible_; }
  // N of a "cuda:N" device, -1 for host devices.
  int cuda_ordinal() const { return cuda_ordinal_; }

  // Runs `fn` with exclusive use of the backend, a workspace of at least
  // `workspace_bytes(backend)` (asked under the same exclusive use) and a
  // staging arena of `staging_bytes`: the sum of the Footprint of every
  // piece `fn` takes.
  absl::Status Run(
      absl::FunctionRef<size_t(const Backend&)> workspace_bytes,
      uint64_t staging_bytes,
      absl::FunctionRef<absl::Status(Backend&, Workspace, StagingArena&)> fn);

  // Exclusive use of the backend without a workspace (parameter access).
  absl::Status WithDevice(absl::FunctionRef<absl::Status(Backend&)> fn);

  // From now on, work that gets the device answers UNAVAILABLE without
  // running: a drain past its deadline ends the requests still queued
  // instead of letting the gRPC server cancel them mid-way.
  void RefuseQueuedWork() { refusing_.store(true); }

  // Records the kernel times the device has finished since the last
  // request, unless a request holds the device (it records them itself).
  void PollTimings();

  // Waits for every piece of work issued so far (only from inside Run's or
  // WithDevice's `fn`), and counts the wait under `reason` (see
  // mhcd_host_synchronizations_total).
  absl::Status Synchronize(Backend& backend, absl::string_view reason);

  // Called once, with the error, when the device fails for good.
  void SetFailureCallback(std::function<void(const absl::Status&)> callback) {
    absl::MutexLock lock(&mu_);
    on_failure_ = std::move(callback);
  }

  // Observability, set before the first request. `metrics` may be null (no
  // measurement at all); `audit` may be null (no determinism audit).
  void SetMetrics(Metrics* metrics);
  void SetAudit(DeterminismAudit* audit) { audit_ = audit; }
  // Roofline denominator in bytes per second; 0 leaves roofline unrecorded.
  void SetCopyBandwidth(double bytes_per_second);
  DeterminismAudit* audit() const { return audit_; }

  // Runs one kernel launch `fn` and records `sample` (its seconds filled in
  // here) when it succeeds. Only from inside Run's `fn`, which holds the
  // device.
  absl::Status Launch(KernelSample sample,
                      absl::FunctionRef<absl::Status()> fn);

 private:
  // What a request returns after `status`: the device's failure when it
  // failed for good, and the kernel times read so far.
  absl::Status Finish(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records the launches the device has finished since the last call.
  absl::Status CollectTimings() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED once the device's work failed; checks the device without
  // waiting for it.
  absl::Status CheckDevice() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // UNAVAILABLE after RefuseQueuedWork, checked once a request has the
  // device.
  absl::Status CheckAccepting() const;

  // Grows `buffer` (of `*capacity` bytes) to hold at least `bytes`.
  absl::Status EnsureBuffer(const char* what, size_t bytes, void** buffer,
                            size_t* capacity)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string device_;
  std::string backend_name_;
  std::string description_;
  bool host_accessible_;
  int cuda_ordinal_ = -1;
  absl::Mutex mu_;
  std::unique_ptr<Backend> backend_ ABSL_GUARDED_BY(mu_);
  void* workspace_ ABSL_GUARDED_BY(mu_) = nullptr;
  size_t workspace_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  void* staging_ ABSL_GUARDED_BY(mu_) = nullptr;
  size_t staging_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Used by Launch, which runs under mu_ without the analysis seeing it.
  std::unique_ptr<DeviceTimer> timer_;
  // Launches timed and not yet read, oldest first (the timer's order).
  std::deque<KernelSample> timed_;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  std::function<void(const absl::Status&)> on_failure_ ABSL_GUARDED_BY(mu_);
  Metrics* metrics_ = nullptr;
  DeterminismAudit* audit_ = nullptr;
  double copy_bandwidth_ = 0;
  std::atomic<bool> refusing_{false};
};

}  // namespace mhc::server

#endif  // MHC_SERVER_EXECUTOR_H_
