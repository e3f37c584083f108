// Data-parallel groups (group.proto): names, members, states, and the
// collectives over the members' layers. The collective library comes in as
// a GroupTransport; without one (CPU devices, or NCCL not loadable) every
// group request is refused with the reason.
//
// A group forms in the background: its communicators connect, then every
// rank's layer fingerprint (count, parameters, spec hash) is gathered and
// compared, so that replicas of different shapes fail at formation rather
// than corrupting memory. Collectives of one group run one at a time. Any
// failure of a collective, including a timeout or a layer of the group that
// is gone, leaves the group FAILED: its peers cannot tell a skipped call
// from a slow one, so the only way on is a new group.
#ifndef MHC_SERVER_GROUPS_H_
#define MHC_SERVER_GROUPS_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mhc/v1/group.pb.h"
#include "server/executor.h"
#include "server/group_transport.h"
#include "server/layer_store.h"
#include "server/metrics.h"

namespace mhc::server {

class Group;

class GroupRegistry {
 public:
  // `transport` may be null: then `unavailable` says why groups are refused.
  // `default_timeout` applies to requests with timeout_seconds = 0.
  GroupRegistry(LayerStore* store, std::vector<Executor*> executors,
                std::unique_ptr<GroupTransport> transport,
                std::string unavailable, absl::Duration default_timeout,
                Metrics* metrics);
  // Leaves every group (aborting what still runs).
  ~GroupRegistry();

  absl::StatusOr<v1::GroupInfo> Create(const v1::CreateGroupRequest& request);
  absl::StatusOr<v1::GroupInfo> Join(const v1::JoinGroupRequest& request);
  absl::StatusOr<v1::GroupInfo> Get(const v1::GetGroupRequest& request);
  absl::StatusOr<v1::CollectiveResponse> AllReduceGradients(
      const v1::AllReduceGradientsRequest& request);
  absl::StatusOr<v1::CollectiveResponse> BroadcastParameters(
      const v1::BroadcastParametersRequest& request);
  absl::Status Leave(const v1::LeaveGroupRequest& request);

 private:
  // Create (empty `unique_id`) and Join.
  absl::StatusOr<v1::GroupInfo> Start(
      const std::string& name, int world_size, std::string unique_id,
      const google::protobuf::RepeatedPtrField<v1::GroupRank>& ranks,
      double timeout_seconds, bool wait);
  absl::StatusOr<std::shared_ptr<Group>> Find(const std::string& name) const;
  absl::StatusOr<absl::Time> Deadline(double timeout_seconds) const;
  void PublishStates() const;

  LayerStore* const store_;
  const std::vector<Executor*> executors_;
  const std::unique_ptr<GroupTransport> transport_;
  const std::string unavailable_;
  const absl::Duration default_timeout_;
  Metrics* const metrics_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Group>> groups_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mhc::server

#endif  // MHC_SERVER_GROUPS_H_
