// What a data-parallel group needs from a collective library, for the ranks
// that one daemon hosts. NCCL provides it (nccl_transport.h); the group
// registry (groups.h) holds everything else: names, layers, states.
//
// Every collective is enqueued on the op streams of the ranks' devices,
// under their executors (so it runs after the ops queued before it and
// before those queued after), then waited for without holding them. The
// waits end at a deadline or at Stop(), never later: a peer that is gone
// shows up as a timeout, after which the owner calls Abort().
#ifndef MHC_SERVER_GROUP_TRANSPORT_H_
#define MHC_SERVER_GROUP_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/executor.h"

namespace mhc::server {

// A rank of the group on one of this daemon's devices.
struct LocalRank {
  int rank = 0;
  Executor* executor = nullptr;
};

// The fp32 device buffers of one local rank for one collective; the i-th
// buffer of every rank has the same length.
struct FloatBuffer {
  float* data = nullptr;
  size_t count = 0;
};
using RankBuffers = std::vector<FloatBuffer>;

// The connected communicators of this daemon's ranks of one group. Not
// thread safe: the group calls it from one thread at a time, except Stop().
class GroupComm {
 public:
  virtual ~GroupComm() = default;

  // Until every local rank is connected to the whole group.
  virtual absl::Status WaitConnected(absl::Time deadline) = 0;
  // Every rank's `words` (the same count from each local rank), in rank
  // order: one row per rank of the group.
  virtual absl::StatusOr<std::vector<std::vector<uint64_t>>> AllGather(
      const std::vector<std::vector<uint64_t>>& words, absl::Time deadline) = 0;
  // In place; `per_rank` follows the order of the local ranks.
  virtual absl::Status AllReduce(const std::vector<RankBuffers>& per_rank,
                                 bool mean, absl::Time deadline) = 0;
  virtual absl::Status Broadcast(const std::vector<RankBuffers>& per_rank,
                                 int root, absl::Time deadline) = 0;
  // Makes the current or next wait return CANCELLED. Thread safe.
  virtual void Stop() = 0;
  // Ends every operation still running (also on the devices) and releases
  // the communicators; later calls fail.
  virtual void Abort() = 0;
};

class GroupTransport {
 public:
  virtual ~GroupTransport() = default;

  // "NCCL 2.28.9".
  virtual std::string Describe() const = 0;
  // A fresh id for a new group, to be shared with every member.
  virtual absl::StatusOr<std::string> NewUniqueId() = 0;
  // Starts connecting `ranks` (this daemon's, in the order collectives will
  // name them) to a group of `world_size` ranks; returns without waiting.
  virtual absl::StatusOr<std::unique_ptr<GroupComm>> Open(
      absl::string_view unique_id, int world_size,
      std::vector<LocalRank> ranks) = 0;
};

}  // namespace mhc::server

#endif  // MHC_SERVER_GROUP_TRANSPORT_H_
