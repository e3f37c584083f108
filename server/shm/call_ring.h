// The daemon's side of sessions' call rings (mhc/call_ring.h; shm.proto,
// "Call ring"): a thread per ring takes each request out of the shared
// memory, runs it like the RPC it names and writes the answer back. The
// ring only moves bytes; what a call may do is decided by its handler.
#ifndef MHC_SERVER_SHM_CALL_RING_H_
#define MHC_SERVER_SHM_CALL_RING_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/shm/shm_registry.h"

namespace mhc::server {

// One request as taken from a ring; the views live for the handler's call.
struct RingCallRequest {
  absl::string_view method;  // an RPC name of mhc.v1.Mhc
  int wait_event = -1;
  int signal_event = -1;
  absl::string_view payload;  // the serialized request message
  // A deferred request's completion (see mhc/call_ring.h); null for others.
  DeviceCompletion* completion = nullptr;
};

class CallRing {
 public:
  // Runs `call`; on OK, `response` holds the serialized response message.
  using Handler = std::function<absl::Status(const RingCallRequest& call,
                                             std::string* response)>;

  // Serves the ring laid out in system region `region` (held by the caller
  // through ShmRegistry::Find; released when the ring stops). `spin`: how
  // long the thread polls for the next request before it sleeps.
  // INVALID_ARGUMENT when the region does not hold a ring.
  static absl::StatusOr<std::unique_ptr<CallRing>> Start(
      std::shared_ptr<Region> region, Handler handler, absl::Duration spin);
  // Stops the ring (see Stop).
  ~CallRing();
  CallRing(const CallRing&) = delete;
  CallRing& operator=(const CallRing&) = delete;

  uint64_t area_bytes() const { return area_bytes_; }
  // Finishes the call being run, answers one submitted but not started
  // with UNAVAILABLE, marks the ring closed and wakes the client.
  void Stop();

 private:
  CallRing(std::shared_ptr<Region> region, Handler handler, uint64_t area_bytes,
           absl::Duration spin);
  // The ring's area size when `region` holds a valid ring (and locks its
  // object for the ring's life).
  static absl::StatusOr<uint64_t> CheckRing(const Region& region);
  void Serve();
  // The done word of a deferred request (mhc/call_ring.h).
  class Completion;
  // Waits until every write of the done word queued on a device stream has
  // landed, at most `timeout`; false when it did not.
  bool AwaitQueuedWrites(absl::Duration timeout);
  // Stores `seq` into the done word from this thread, once the queued
  // writes are in, so that the word never moves backwards.
  void CompleteOnHost(uint32_t seq);
  // Answers request `seq` with `status` (and `payload` when OK).
  void Answer(uint32_t seq, const absl::Status& status,
              const std::string& payload);

  const std::shared_ptr<Region> region_;
  void* const base_;
  const Handler handler_;
  const uint64_t area_bytes_;
  const int64_t spin_ns_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
  uint32_t answered_ = 0;
  // The done word as devices address it; null when the ring's memory is not
  // page-locked, and deferred requests then finish before their answer.
  void* done_word_device_ = nullptr;
  // The last deferred request whose done-word write is queued on a device
  // stream, and that device (-1: none outstanding).
  uint32_t queued_seq_ = 0;
  int queued_device_ = -1;
  // Reused by every call: the request copied out of shared memory (the
  // client could change it while it is parsed) and the response.
  std::string payload_;
  std::string response_;
};

// The open rings, at most one per session.
class CallRings {
 public:
  // ALREADY_EXISTS when the session has one.
  absl::Status Add(const std::string& session_id,
                   std::unique_ptr<CallRing> ring);
  // Stops the session's ring, if any.
  void Close(const std::string& session_id);
  void CloseAll();
  int size() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<CallRing>> rings_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mhc::server

#endif  // MHC_SERVER_SHM_CALL_RING_H_
