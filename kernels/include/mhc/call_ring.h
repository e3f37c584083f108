// The call ring: compute calls of a local client through a shared-memory
// region of its session instead of gRPC messages (see shm.proto, "Call
// ring"). This header is the layout both sides agree on, and the futex
// helpers they wait and wake with.
//
// Region layout, from the region's first byte (64-byte aligned):
//
//   RingHeader                       kRingHeaderBytes
//   request area                     area_bytes: RingRequest, then payload
//   response area                    area_bytes: RingResponse, message, payload
//
// One call at a time: the client writes the request area, then stores
// request_seq + 1 into request_seq and wakes it. The daemon copies the
// request out, runs it, writes the response area, then stores that number
// into response_seq and wakes it. Every other field is written only while
// the writer owns its area, so the two sequence words are the only
// synchronization.
//
// A deferred request (kRequestDeferred) is one whose answer the client
// collects later, before its next request: it returns as soon as the
// request is written. Its device work is then ordered with the client's
// stream by done_seq instead of by a signal event: the daemon's stream
// writes the request's number there after the work, and the client's stream
// waits until done_seq reaches it (cuStreamWaitValue32, greater or equal,
// which compares cyclically). When no work was queued (an error, or a
// backend whose ops finish before they return) the daemon stores the number
// from the host, after every earlier write has landed, so the word never
// moves backwards and a waiting stream never hangs.
#ifndef MHC_CALL_RING_H_
#define MHC_CALL_RING_H_

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>
#include <cstddef>
#include <cstdint>

namespace mhc::call_ring {

inline constexpr uint32_t kMagic = 0x4d484352;  // "MHCR"
inline constexpr uint32_t kVersion = 2;
inline constexpr uint64_t kRingHeaderBytes = 512;
inline constexpr uint64_t kMinAreaBytes = 4096;
inline constexpr uint64_t kMaxAreaBytes = uint64_t{16} << 20;
inline constexpr size_t kMethodBytes = 48;

// Region bytes for areas of `area_bytes` each.
constexpr uint64_t RegionBytes(uint64_t area_bytes) {
  return kRingHeaderBytes + 2 * area_bytes;
}

// Ring states, in RingHeader::state.
inline constexpr uint32_t kStateNew = 0;      // written by the client
inline constexpr uint32_t kStateServing = 1;  // the daemon took the ring
inline constexpr uint32_t kStateClosed = 2;   // the daemon serves no more

struct RingHeader {
  // Written by the client before OpenCallRing, read once by the daemon.
  uint32_t magic;
  uint32_t version;
  uint64_t area_bytes;
  // Each word on its own cache line: one side spins on what the other
  // writes.
  alignas(64) uint32_t request_seq;   // client: the last request submitted
  alignas(64) uint32_t response_seq;  // daemon: the last request answered
  alignas(64) uint32_t state;         // daemon: kState*
  // Written by the daemon's device stream (or its host, see above), read by
  // the client's device stream: the last deferred request whose work is done.
  alignas(64) uint32_t done_seq;
};
static_assert(sizeof(RingHeader) <= kRingHeaderBytes);

struct RingRequest {
  char method[kMethodBytes];  // the RPC's name, NUL-padded ("Pre", ...)
  int32_t wait_event;         // "mhc-wait-event", -1 for none
  int32_t signal_event;       // "mhc-signal-event", -1 for none
  uint32_t payload_bytes;     // the serialized request message that follows
  uint32_t flags;             // kRequest*
};

// RingRequest::flags.
inline constexpr uint32_t kRequestDeferred = 1;

struct RingResponse {
  int32_t code;            // absl::StatusCode
  uint32_t message_bytes;  // the status message that follows
  uint32_t payload_bytes;  // then the serialized response message
  uint32_t reserved;
};

inline uint32_t* RequestSeq(void* region) {
  return &static_cast<RingHeader*>(region)->request_seq;
}
inline uint32_t* ResponseSeq(void* region) {
  return &static_cast<RingHeader*>(region)->response_seq;
}
inline uint32_t* State(void* region) {
  return &static_cast<RingHeader*>(region)->state;
}
inline uint32_t* DoneSeq(void* region) {
  return &static_cast<RingHeader*>(region)->done_seq;
}
// Whether `word` has reached `seq`, counting cyclically as the device's
// greater-or-equal wait does.
inline bool Reached(uint32_t word, uint32_t seq) {
  return static_cast<int32_t>(word - seq) >= 0;
}
inline char* RequestArea(void* region) {
  return static_cast<char*>(region) + kRingHeaderBytes;
}
inline char* ResponseArea(void* region, uint64_t area_bytes) {
  return static_cast<char*>(region) + kRingHeaderBytes + area_bytes;
}

inline uint32_t Load(const uint32_t* word) {
  return __atomic_load_n(word, __ATOMIC_ACQUIRE);
}
inline void Store(uint32_t* word, uint32_t value) {
  __atomic_store_n(word, value, __ATOMIC_RELEASE);
}

// Sleeps while *word == expected, at most `timeout_ns`; wakes early on
// FutexWake or a signal. Shared (not FUTEX_PRIVATE): the word is in memory
// two processes map.
inline void FutexWait(uint32_t* word, uint32_t expected, int64_t timeout_ns) {
  timespec timeout{static_cast<time_t>(timeout_ns / 1000000000),
                   static_cast<long>(timeout_ns % 1000000000)};
  syscall(SYS_futex, word, FUTEX_WAIT, expected, &timeout, nullptr, 0);
}
inline void FutexWake(uint32_t* word) {
  syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Spins for up to `spin_ns` while *word == expected; returns the value
// seen last. Spinning skips the futex's sleep and wake-up on calls that
// follow each other closely.
inline uint32_t SpinWhile(const uint32_t* word, uint32_t expected,
                          int64_t spin_ns) {
  uint32_t value = Load(word);
  if (value != expected || spin_ns <= 0) return value;
  timespec start{};
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (int i = 1;; ++i) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    value = Load(word);
    if (value != expected) return value;
    if (i % 64 == 0) {
      timespec now{};
      clock_gettime(CLOCK_MONOTONIC, &now);
      const int64_t elapsed = (now.tv_sec - start.tv_sec) * 1000000000LL +
                              (now.tv_nsec - start.tv_nsec);
      if (elapsed >= spin_ns) return value;
    }
  }
}

}  // namespace mhc::call_ring

#endif  // MHC_CALL_RING_H_
