#include "mhc/client/call_ring.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "mhc/call_ring.h"
#include "mhc/client/shm_key.h"
#include "mhc/status.h"

namespace mhc::client {
namespace {

namespace ring = ::mhc::call_ring;

// The client polls this long for an answer before it sleeps: most compute
// calls are answered once their work is queued, sooner than a futex
// sleep and wake-up would take.
constexpr int64_t kSpinNs = 100'000;
// Between sleeps the client checks that the daemon still serves the ring.
constexpr int64_t kSleepNs = 10'000'000;
constexpr char kRegionName[] = "call_ring";

absl::Status Errno(absl::string_view what) {
  return absl::InternalError(
      absl::StrCat("call ring: ", what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<std::shared_ptr<CallRing>> CallRing::Open(
    Client& client, uint64_t area_bytes, const std::string& key_prefix) {
  if (client.session_id().empty()) {
    return absl::FailedPreconditionError(
        "call ring: open a session first (mhc/client/shm.h)");
  }
  if (area_bytes < ring::kMinAreaBytes || area_bytes > ring::kMaxAreaBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("call ring: area_bytes must be in [", ring::kMinAreaBytes,
                     ", ", ring::kMaxAreaBytes, "]"));
  }
  std::shared_ptr<CallRing> created(new CallRing());
  created->key_ = UniqueShmKey(key_prefix, "call_ring");
  created->session_id_ = client.session_id();
  created->bytes_ = ring::RegionBytes(area_bytes);
  created->area_bytes_ = area_bytes;
  const std::string path = absl::StrCat("/", created->key_);
  created->fd_ =
      shm_open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (created->fd_ < 0) return Errno("shm_open");
  created->owned_ = true;
  if (ftruncate(created->fd_, static_cast<off_t>(created->bytes_)) != 0) {
    return Errno("ftruncate");
  }
  created->base_ = mmap(nullptr, created->bytes_, PROT_READ | PROT_WRITE,
                        MAP_SHARED, created->fd_, 0);
  if (created->base_ == MAP_FAILED) {
    created->base_ = nullptr;
    return Errno("mmap");
  }
  auto* header = static_cast<ring::RingHeader*>(created->base_);
  header->magic = ring::kMagic;
  header->version = ring::kVersion;
  header->area_bytes = area_bytes;
  if (absl::Status registered = client.RegisterSystemSharedMemory(
          kRegionName, created->key_, 0, created->bytes_);
      !registered.ok()) {
    return registered;
  }
  if (absl::Status opened = client.OpenCallRing(kRegionName); !opened.ok()) {
    client.UnregisterSharedMemory(kRegionName).IgnoreError();
    return opened;
  }
  return created;
}

CallRing::~CallRing() {
  if (base_ != nullptr) munmap(base_, bytes_);
  if (fd_ >= 0) close(fd_);
  if (owned_) shm_unlink(absl::StrCat("/", key_).c_str());
}

bool CallRing::usable() const {
  absl::MutexLock lock(&mu_);
  return !broken_ && ring::Load(ring::State(base_)) == ring::kStateServing;
}

bool CallRing::DaemonAlive() const {
  if (flock(fd_, LOCK_EX | LOCK_NB) != 0) return true;  // the daemon's lock
  flock(fd_, LOCK_UN);
  return false;
}

uint32_t* CallRing::done_word() const { return ring::DoneSeq(base_); }

absl::StatusOr<uint32_t> CallRing::Submit(
    absl::string_view method, const google::protobuf::Message& request,
    const StreamOrder& order, uint32_t flags,
    absl::FunctionRef<absl::Status()> before_send) {
  if (broken_ || ring::Load(ring::State(base_)) != ring::kStateServing) {
    return absl::UnavailableError("call ring: closed");
  }
  ring::RingRequest header{};
  const size_t payload = request.ByteSizeLong();
  if (method.size() >= sizeof(header.method) ||
      payload > area_bytes_ - sizeof(header)) {
    return absl::ResourceExhaustedError(
        "call ring: the request does not fit the ring");
  }
  std::memcpy(header.method, method.data(), method.size());
  header.wait_event = order.wait_event;
  header.signal_event = order.signal_event;
  header.payload_bytes = static_cast<uint32_t>(payload);
  header.flags = flags;
  char* area = ring::RequestArea(base_);
  std::memcpy(area, &header, sizeof(header));
  if (!request.SerializeToArray(area + sizeof(header),
                                static_cast<int>(payload))) {
    return absl::InvalidArgumentError(
        "call ring: the request did not serialize");
  }
  MHC_RETURN_IF_ERROR(before_send());
  const uint32_t seq = seq_ + 1;
  ring::Store(ring::RequestSeq(base_), seq);
  ring::FutexWake(ring::RequestSeq(base_));
  calls_.fetch_add(1, std::memory_order_relaxed);
  return seq;
}

absl::Status CallRing::ReadAnswer(google::protobuf::Message* response,
                                  bool* sent) {
  ring::RingResponse reply;
  const char* out = ring::ResponseArea(base_, area_bytes_);
  std::memcpy(&reply, out, sizeof(reply));
  const uint64_t room = area_bytes_ - sizeof(reply);
  if (reply.message_bytes > room || reply.payload_bytes > room) {
    broken_ = true;
    return absl::InternalError("call ring: malformed answer");
  }
  if (reply.code != 0) {
    absl::Status status(
        static_cast<absl::StatusCode>(reply.code),
        absl::string_view(out + sizeof(reply), reply.message_bytes));
    // Closed before it ran: the caller may send it again over gRPC.
    if (status.code() == absl::StatusCode::kUnavailable &&
        ring::Load(ring::State(base_)) == ring::kStateClosed) {
      *sent = false;
    }
    return status;
  }
  if (response != nullptr &&
      !response->ParseFromArray(out + sizeof(reply),
                                static_cast<int>(reply.payload_bytes))) {
    return absl::InternalError("call ring: the answer did not parse");
  }
  return absl::OkStatus();
}

absl::Status CallRing::CollectDeferred(absl::Time deadline) {
  if (!pending_) return absl::OkStatus();
  const uint32_t seq = seq_ + 1;
  const absl::Time start = absl::Now();
  bool sent = true;
  const absl::Status answered = Receive(seq, deadline, nullptr, &sent);
  deferred_wait_ns_.fetch_add(absl::ToInt64Nanoseconds(absl::Now() - start),
                              std::memory_order_relaxed);
  pending_ = false;
  if (answered.ok()) return answered;
  if (broken_ && answered.code() == absl::StatusCode::kUnavailable) {
    // The daemon is gone and writes nothing more: release any stream
    // still waiting for the call.
    ring::Store(ring::DoneSeq(base_), seq);
  }
  return absl::Status(
      answered.code(),
      absl::StrCat(
          "an earlier deferred call (", pending_method_,
          ") failed; its outputs are not valid: ", answered.message()));
}

absl::Status CallRing::Receive(uint32_t seq, absl::Time deadline,
                               google::protobuf::Message* response,
                               bool* sent) {
  absl::Status answered = AwaitAnswer(seq, deadline);
  if (!answered.ok()) {
    broken_ = true;  // the daemon may still answer, into a reused area
    return answered;
  }
  seq_ = seq;
  return ReadAnswer(response, sent);
}

absl::Status CallRing::Flush(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  return CollectDeferred(absl::Now() + timeout);
}

absl::Status CallRing::Post(absl::string_view method,
                            const google::protobuf::Message& request,
                            const StreamOrder& order,
                            absl::FunctionRef<absl::Status()> before_send,
                            absl::Duration timeout, uint32_t* seq, bool* sent) {
  *sent = false;
  if (order.signal_event >= 0) {
    return absl::InvalidArgumentError(
        "call ring: a deferred call is ordered by the done word, not by a "
        "signal event");
  }
  absl::MutexLock lock(&mu_);
  MHC_RETURN_IF_ERROR(CollectDeferred(absl::Now() + timeout));
  MHC_ASSIGN_OR_RETURN(*seq, Submit(method, request, order,
                                    ring::kRequestDeferred, before_send));
  *sent = true;
  pending_ = true;
  pending_method_.assign(method.data(), method.size());
  return absl::OkStatus();
}

absl::Status CallRing::Call(absl::string_view method,
                            const google::protobuf::Message& request,
                            google::protobuf::Message& response,
                            const StreamOrder& order, absl::Duration timeout,
                            bool* sent) {
  *sent = false;
  absl::MutexLock lock(&mu_);
  const absl::Time deadline = absl::Now() + timeout;
  MHC_RETURN_IF_ERROR(CollectDeferred(deadline));
  MHC_ASSIGN_OR_RETURN(
      const uint32_t seq,
      Submit(method, request, order, 0, [] { return absl::OkStatus(); }));
  *sent = true;
  return Receive(seq, deadline, &response, sent);
}

absl::Status CallRing::AwaitAnswer(uint32_t seq, absl::Time deadline) {
  uint32_t* answered = ring::ResponseSeq(base_);
  const uint32_t before = seq - 1;
  if (ring::SpinWhile(answered, before, kSpinNs) != before) return {};
  while (ring::Load(answered) == before) {
    if (ring::Load(ring::State(base_)) == ring::kStateClosed ||
        !DaemonAlive()) {
      // The daemon answers before it marks the ring closed.
      if (ring::Load(answered) != before) break;
      return absl::UnavailableError(
          "call ring: the daemon stopped serving the ring during the call; "
          "it may or may not have run");
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          "call ring: no answer before the deadline; the call may still run");
    }
    ring::FutexWait(answered, before, kSleepNs);
  }
  return absl::OkStatus();
}

}  // namespace mhc::client
