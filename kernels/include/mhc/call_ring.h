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
inline constexpr uint32_t kVersion = 1;
inline constexpr uint64_t kRingHeaderBytes = 256;
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
};
static_assert(sizeof(RingHeader) <= kRingHeaderBytes);

struct RingRequest {
  char method[kMethodBytes];  // the RPC's name, NUL-padded ("Pre", ...)
  int32_t wait_event;         // "mhc-wait-event", -1 for none
  int32_t signal_event;       // "mhc-signal-event", -1 for none
  uint32_t payload_bytes;     // the serialized request message that follows
  uint32_t reserved;
};

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
