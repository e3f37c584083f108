#include "server/admission.h"

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace mhc::server {
namespace {

absl::Status DrainingError(std::atomic<int64_t>* last_refusal_ns) {
  last_refusal_ns->store(absl::ToUnixNanos(absl::Now()));
  return absl::UnavailableError(
      "mhcd is draining (shutting down); retry on another instance");
}

}  // namespace

bool Admission::AwaitIdle(absl::Time deadline) const {
  // Polled: a drain happens once, and a few milliseconds do not matter.
  while (inflight_.load() > 0) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

void Admission::AwaitQuiet(absl::Duration quiet, absl::Time deadline) const {
  while (absl::Now() < deadline &&
         absl::Now() - absl::FromUnixNanos(last_refusal_ns_.load()) < quiet) {
    absl::SleepFor(absl::Milliseconds(5));
  }
}

absl::StatusOr<Admission::Ticket> Admission::TryEnter() {
  if (draining_.load()) {
    return DrainingError(&last_refusal_ns_);
  }
  int previous = inflight_.fetch_add(1);
  if (previous >= max_inflight_) {
    inflight_.fetch_sub(1);
    return absl::ResourceExhaustedError(absl::StrCat(
        "too many requests in flight (limit --max_inflight=", max_inflight_,
        "); retry later"));
  }
  // Checked again after counting: a drain that began in between either
  // sees this request in AwaitIdle or this request sees the drain.
  if (draining_.load()) {
    inflight_.fetch_sub(1);
    return DrainingError(&last_refusal_ns_);
  }
  return Ticket(this);
}

}  // namespace mhc::server
