// mhc::client::CallRing: compute calls to a daemon on this node through a
// shared-memory ring of the client's session instead of gRPC messages (see
// shm.proto, "Call ring"). A call then costs a memory copy of its small
// request and a futex wake each way.
//
//   auto session = Session::Open(*client);          // mhc/client/shm.h
//   auto ring = CallRing::Open(*client);
//   client->set_call_ring(*ring);                    // Compute() uses it
//
// The ring carries the compute RPCs (single ops and Execute) with the same
// messages and answers. Anything else, and a call whose messages do not fit
// the ring, goes over gRPC as before. One call runs at a time; concurrent
// callers take turns.
//
// Deferred calls (Post) return once the request is written; the answer is
// collected before the next call, which reports a failure instead of
// running. Their device work is ordered with the caller's stream by the
// ring's done word (done_word(), see mhc/call_ring.h): the caller's stream
// waits for it to reach the call's number.
#ifndef MHC_CLIENT_CALL_RING_H_
#define MHC_CLIENT_CALL_RING_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "google/protobuf/message.h"
#include "mhc/client/client.h"

namespace mhc::client {

class CallRing {
 public:
  static constexpr uint64_t kDefaultAreaBytes = uint64_t{64} << 10;

  // Creates a ring: a shared-memory object whose key starts with
  // `key_prefix` (the daemon's --shm_key_prefix), registered as region
  // "call_ring" of the client's open session and opened as its ring.
  static absl::StatusOr<std::shared_ptr<CallRing>> Open(
      Client& client, uint64_t area_bytes = kDefaultAreaBytes,
      const std::string& key_prefix = "mhcd_");
  ~CallRing();
  CallRing(const CallRing&) = delete;
  CallRing& operator=(const CallRing&) = delete;

  const std::string& session_id() const { return session_id_; }
  // The ring's shared-memory object, which the ring unlinks when it goes.
  const std::string& key() const { return key_; }
  // Calls sent through the ring so far.
  uint64_t calls() const { return calls_.load(std::memory_order_relaxed); }
  // Time callers spent waiting for a deferred call's answer before their
  // own call could go: what the daemon's handling costs beyond the
  // caller's own work between calls.
  absl::Duration deferred_wait() const {
    return absl::Nanoseconds(deferred_wait_ns_.load(std::memory_order_relaxed));
  }
  // False once the daemon closed the ring or a call left it in an unknown
  // state (timeout, daemon gone): callers go back to gRPC.
  bool usable() const;

  // Runs compute RPC `method` (its name, e.g. "Pre"). `*sent` says whether
  // the daemon may have run it: when false, nothing ran and the call may
  // go over gRPC instead. Waits at most `timeout` (DEADLINE_EXCEEDED then,
  // and the ring is unusable since the daemon may still answer).
  absl::Status Call(absl::string_view method,
                    const google::protobuf::Message& request,
                    google::protobuf::Message& response,
                    const StreamOrder& order, absl::Duration timeout,
                    bool* sent);

  // Sends compute RPC `method` as a deferred call and returns without its
  // answer. First collects the answer of the previous deferred call (at
  // most `timeout`): if that call failed, returns its error and sends
  // nothing. `before_send` runs just before the request becomes visible to
  // the daemon, after that answer: the place to record the call's wait
  // event, which the previous call has then waited for. On OK, `*seq` is
  // the number done_word() reaches once the call's device work is done.
  // `order.signal_event` must be -1: the done word replaces it.
  absl::Status Post(absl::string_view method,
                    const google::protobuf::Message& request,
                    const StreamOrder& order,
                    absl::FunctionRef<absl::Status()> before_send,
                    absl::Duration timeout, uint32_t* seq, bool* sent);
  // Collects the answer of the last deferred call: its error if it failed.
  absl::Status Flush(absl::Duration timeout);
  // The word the daemon's stream writes each deferred call's number to
  // once the call's work is done. It lies in the first page of the ring's
  // mapping (ring_page(), kRingPageBytes), which a caller whose stream waits
  // on it page-locks for its device.
  uint32_t* done_word() const;
  void* ring_page() const { return base_; }
  static constexpr size_t kRingPageBytes = 4096;

 private:
  CallRing() = default;
  // Writes the request and makes it visible to the daemon; returns its
  // number.
  absl::StatusOr<uint32_t> Submit(absl::string_view method,
                                  const google::protobuf::Message& request,
                                  const StreamOrder& order, uint32_t flags,
                                  absl::FunctionRef<absl::Status()> before_send)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for the answer to request `seq` and reads it (the ring is
  // unusable after a wait that failed).
  absl::Status Receive(uint32_t seq, absl::Time deadline,
                       google::protobuf::Message* response, bool* sent)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reads the answer to the request just answered.
  absl::Status ReadAnswer(google::protobuf::Message* response, bool* sent)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Collects the pending deferred call's answer, if any.
  absl::Status CollectDeferred(absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for the answer to request `seq`.
  absl::Status AwaitAnswer(uint32_t seq, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the daemon still holds the object's lock (it serves the ring).
  bool DaemonAlive() const;

  std::string key_;
  std::string session_id_;
  bool owned_ = false;  // created here: unlinked when destroyed
  int fd_ = -1;
  void* base_ = nullptr;
  uint64_t bytes_ = 0;
  uint64_t area_bytes_ = 0;
  std::atomic<uint64_t> calls_{0};
  std::atomic<int64_t> deferred_wait_ns_{0};
  mutable absl::Mutex mu_;
  uint32_t seq_ ABSL_GUARDED_BY(mu_) = 0;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  // A deferred call whose answer is not collected yet, and its method.
  bool pending_ ABSL_GUARDED_BY(mu_) = false;
  std::string pending_method_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mhc::client

#endif  // MHC_CLIENT_CALL_RING_H_
