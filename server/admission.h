// Daemon-wide admission control: beyond --max_inflight a request is refused
// at once with RESOURCE_EXHAUSTED instead of waiting in a queue that grows
// without bound; while draining, with UNAVAILABLE.
#ifndef MHC_SERVER_ADMISSION_H_
#define MHC_SERVER_ADMISSION_H_

#include <atomic>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace mhc::server {

class Admission {
 public:
  // Held by an admitted request; releases its slot when destroyed.
  class Ticket {
   public:
    explicit Ticket(Admission* owner) : owner_(owner) {}
    Ticket(Ticket&& other) noexcept : owner_(other.owner_) {
      other.owner_ = nullptr;
    }
    Ticket& operator=(Ticket&& other) noexcept {
      if (this != &other) {
        Release();
        owner_ = other.owner_;
        other.owner_ = nullptr;
      }
      return *this;
    }
    ~Ticket() { Release(); }

   private:
    void Release() {
      if (owner_ != nullptr) owner_->inflight_.fetch_sub(1);
      owner_ = nullptr;
    }
    Admission* owner_;
  };

  explicit Admission(int max_inflight) : max_inflight_(max_inflight) {}

  absl::StatusOr<Ticket> TryEnter();
  void BeginDrain() { draining_.store(true); }
  bool draining() const { return draining_.load(); }
  int inflight() const { return inflight_.load(); }
  // Waits until no admitted request is left or `deadline` passes; true
  // when none is left.
  bool AwaitIdle(absl::Time deadline) const;
  // Waits until no request has been refused for draining for `quiet`, or
  // until `deadline`.
  void AwaitQuiet(absl::Duration quiet, absl::Time deadline) const;

 private:
  const int max_inflight_;
  std::atomic<int> inflight_{0};
  std::atomic<bool> draining_{false};
  // absl::ToUnixNanos of the last refusal for draining.
  mutable std::atomic<int64_t> last_refusal_ns_{0};
};

}  // namespace mhc::server

#endif  // MHC_SERVER_ADMISSION_H_
