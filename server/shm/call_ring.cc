#include "server/shm/call_ring.h"

#include <sys/file.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "mhc/call_ring.h"

namespace mhc::server {
namespace {

namespace ring = ::mhc::call_ring;

// How long the thread sleeps between checks that it should stop.
constexpr int64_t kIdleWaitNs = 200'000'000;
// How long the thread waits for a queued done-word write to land before it
// stores a later number from the host anyway: only a device that stopped
// running work (the daemon is then not serving) takes that long.
constexpr absl::Duration kQueuedWriteWait = absl::Seconds(30);

}  // namespace

class CallRing::Completion final : public DeviceCompletion {
 public:
  Completion(CallRing& ring, uint32_t seq) : ring_(ring), seq_(seq) {}

  void* Word(int device) override {
    if (ring_.done_word_device_ == nullptr) return nullptr;
    // Writes queued on two devices' streams may land in either order: the
    // earlier one must be in before a later request queues its own.
    if (ring_.queued_device_ >= 0 && ring_.queued_device_ != device) {
      if (!ring_.AwaitQueuedWrites(kQueuedWriteWait)) return nullptr;
    }
    return ring_.done_word_device_;
  }
  uint32_t value() const override { return seq_; }
  void Queued(int device) override {
    ring_.queued_seq_ = seq_;
    ring_.queued_device_ = device;
    queued_ = true;
  }
  bool queued() const { return queued_; }

 private:
  CallRing& ring_;
  const uint32_t seq_;
  bool queued_ = false;
};

absl::StatusOr<std::unique_ptr<CallRing>> CallRing::Start(
    std::shared_ptr<Region> region, Handler handler, absl::Duration spin) {
  absl::StatusOr<uint64_t> area_bytes = CheckRing(*region);
  if (!area_bytes.ok()) {
    region->Release();
    return area_bytes.status();
  }
  std::unique_ptr<CallRing> served(
      new CallRing(std::move(region), std::move(handler), *area_bytes, spin));
  served->thread_ = std::thread([ring = served.get()] { ring->Serve(); });
  return served;
}

absl::StatusOr<uint64_t> CallRing::CheckRing(const Region& region) {
  if (region.kind() != v1::SHARED_MEMORY_KIND_SYSTEM) {
    return absl::InvalidArgumentError(
        "region: a call ring must be a system shared-memory region");
  }
  if (reinterpret_cast<uintptr_t>(region.data()) % 64 != 0) {
    return absl::InvalidArgumentError(
        "region: a call ring must start 64-byte aligned in its object");
  }
  if (region.byte_size() < ring::RegionBytes(ring::kMinAreaBytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("region: a call ring needs at least ",
                     ring::RegionBytes(ring::kMinAreaBytes),
                     " bytes, the region has ", region.byte_size()));
  }
  // Read once: the client may change the header at any time.
  ring::RingHeader header;
  std::memcpy(&header, region.data(), sizeof(header));
  if (header.magic != ring::kMagic || header.version != ring::kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("region: no call ring of version ", ring::kVersion,
                     " (magic and version of mhc/call_ring.h expected)"));
  }
  if (header.area_bytes < ring::kMinAreaBytes ||
      header.area_bytes > ring::kMaxAreaBytes ||
      ring::RegionBytes(header.area_bytes) > region.byte_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("region: area_bytes ", header.area_bytes, " must be in [",
                     ring::kMinAreaBytes, ", ", ring::kMaxAreaBytes,
                     "] with both areas inside the region (",
                     region.byte_size(), " bytes)"));
  }
  // Held while the ring is served: a client waiting on the ring sees the
  // daemon gone when it can take the lock exclusively.
  if (flock(region.descriptor(), LOCK_SH | LOCK_NB) != 0) {
    return absl::FailedPreconditionError(
        "region: its object is locked; is it another ring's?");
  }
  return header.area_bytes;
}

CallRing::CallRing(std::shared_ptr<Region> region, Handler handler,
                   uint64_t area_bytes, absl::Duration spin)
    : region_(std::move(region)),
      base_(region_->data()),
      handler_(std::move(handler)),
      area_bytes_(area_bytes),
      spin_ns_(absl::ToInt64Nanoseconds(spin)) {
  answered_ = ring::Load(ring::ResponseSeq(base_));
  if (region_->pinned()) {
    absl::StatusOr<void*> word = region_->DeviceAddress(ring::DoneSeq(base_));
    if (word.ok()) done_word_device_ = *word;
  }
  ring::Store(ring::State(base_), ring::kStateServing);
}

CallRing::~CallRing() { Stop(); }

void CallRing::Stop() {
  if (stopping_.exchange(true)) {
    if (thread_.joinable()) thread_.join();
    return;
  }
  ring::FutexWake(ring::RequestSeq(base_));
  if (thread_.joinable()) thread_.join();
  const uint32_t submitted = ring::Load(ring::RequestSeq(base_));
  if (submitted != answered_) {
    Answer(submitted,
           absl::UnavailableError(
               "the call ring closed before the request ran; it did not run"),
           "");
  }
  // A client stream may wait for any request so far: release it, and let
  // no device write into the memory once the ring lets go of it.
  CompleteOnHost(submitted);
  ring::Store(ring::State(base_), ring::kStateClosed);
  ring::FutexWake(ring::ResponseSeq(base_));
  flock(region_->descriptor(), LOCK_UN);
  region_->Release();
}

void CallRing::Serve() {
  uint32_t* request_seq = ring::RequestSeq(base_);
  while (!stopping_.load(std::memory_order_acquire)) {
    const uint32_t seq = ring::SpinWhile(request_seq, answered_, spin_ns_);
    if (seq == answered_) {
      ring::FutexWait(request_seq, answered_, kIdleWaitNs);
      continue;
    }
    if (stopping_.load(std::memory_order_acquire)) return;  // Stop answers
    if (region_->Broken()) {
      // The client truncated its own ring (a read faulted): nothing can be
      // answered there.
      answered_ = seq;
      continue;
    }
    ring::RingRequest header;
    const char* area = ring::RequestArea(base_);
    std::memcpy(&header, area, sizeof(header));
    const size_t method_length = strnlen(header.method, sizeof(header.method));
    if (method_length == sizeof(header.method) ||
        header.payload_bytes > area_bytes_ - sizeof(header)) {
      Answer(seq,
             absl::InvalidArgumentError(
                 "call ring: the request header is malformed (method name "
                 "not terminated, or payload past the request area)"),
             "");
      continue;
    }
    payload_.assign(area + sizeof(header), header.payload_bytes);
    const bool deferred = (header.flags & ring::kRequestDeferred) != 0;
    Completion completion(*this, seq);
    RingCallRequest call{absl::string_view(header.method, method_length),
                         header.wait_event, header.signal_event, payload_,
                         deferred ? &completion : nullptr};
    response_.clear();
    const absl::Status status = handler_(call, &response_);
    Answer(seq, status, response_);
    // Nothing queued writes the word for this request (it failed, or its
    // backend finished it already): the client's stream waits for it all
    // the same.
    if (deferred && !completion.queued()) CompleteOnHost(seq);
  }
}

bool CallRing::AwaitQueuedWrites(absl::Duration timeout) {
  if (queued_device_ < 0) return true;
  const uint32_t* word = ring::DoneSeq(base_);
  const absl::Time deadline = absl::Now() + timeout;
  while (!ring::Reached(ring::Load(word), queued_seq_)) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Microseconds(20));
  }
  queued_device_ = -1;
  return true;
}

void CallRing::CompleteOnHost(uint32_t seq) {
  AwaitQueuedWrites(kQueuedWriteWait);
  queued_device_ = -1;
  uint32_t* word = ring::DoneSeq(base_);
  if (!ring::Reached(ring::Load(word), seq)) ring::Store(word, seq);
}

void CallRing::Answer(uint32_t seq, const absl::Status& status,
                      const std::string& payload) {
  char* area = ring::ResponseArea(base_, area_bytes_);
  const uint64_t room = area_bytes_ - sizeof(ring::RingResponse);
  absl::Status answer = status;
  if (answer.ok() && payload.size() > room) {
    answer = absl::ResourceExhaustedError(
        absl::StrCat("call ring: the response of ", payload.size(),
                     " bytes does not fit the ring's area of ", area_bytes_,
                     " bytes; send this call as an RPC"));
  }
  ring::RingResponse header{};
  header.code = static_cast<int32_t>(answer.code());
  if (answer.ok()) {
    header.payload_bytes = static_cast<uint32_t>(payload.size());
    std::memcpy(area + sizeof(header), payload.data(), payload.size());
  } else {
    const size_t length = std::min<size_t>(answer.message().size(), room);
    header.message_bytes = static_cast<uint32_t>(length);
    std::memcpy(area + sizeof(header), answer.message().data(), length);
  }
  std::memcpy(area, &header, sizeof(header));
  answered_ = seq;
  ring::Store(ring::ResponseSeq(base_), seq);
  ring::FutexWake(ring::ResponseSeq(base_));
}

absl::Status CallRings::Add(const std::string& session_id,
                            std::unique_ptr<CallRing> ring) {
  absl::MutexLock lock(&mu_);
  if (rings_.count(session_id) > 0) {
    return absl::AlreadyExistsError("the session already has a call ring");
  }
  rings_[session_id] = std::move(ring);
  return absl::OkStatus();
}

void CallRings::Close(const std::string& session_id) {
  std::unique_ptr<CallRing> ring;
  {
    absl::MutexLock lock(&mu_);
    auto it = rings_.find(session_id);
    if (it == rings_.end()) return;
    ring = std::move(it->second);
    rings_.erase(it);
  }
  ring->Stop();  // outside the lock: it waits for the call being run
}

void CallRings::CloseAll() {
  std::map<std::string, std::unique_ptr<CallRing>> rings;
  {
    absl::MutexLock lock(&mu_);
    rings.swap(rings_);
  }
  for (auto& [id, ring] : rings) ring->Stop();
}

int CallRings::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(rings_.size());
}

}  // namespace mhc::server
