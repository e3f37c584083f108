#include "server/groups.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "mhc/status.h"

namespace mhc::server {
namespace {

constexpr double kMaxTimeoutSeconds = 24 * 3600;

struct Member {
  LocalRank rank;
  std::vector<std::string> layers;
};

const char* StateName(v1::GroupInfo::State state) {
  switch (state) {
    case v1::GroupInfo::FORMING:
      return "FORMING";
    case v1::GroupInfo::READY:
      return "READY";
    case v1::GroupInfo::FAILED:
      return "FAILED";
    default:
      return "UNSPECIFIED";
  }
}

// FNV-1a: the same on every host and build, unlike absl::Hash.
uint64_t HashBytes(absl::string_view bytes, uint64_t hash) {
  for (unsigned char c : bytes) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  return hash;
}

// Layer count, parameter count and a hash of the layers' presets and
// parameter shapes: equal on every rank whose replicas match.
std::vector<uint64_t> Fingerprint(
    const std::vector<std::shared_ptr<Layer>>& layers) {
  uint64_t parameters = 0;
  uint64_t hash = 14695981039346656037ull;
  for (const auto& layer : layers) {
    parameters += static_cast<uint64_t>(layer->parameter_count());
    hash = HashBytes(layer->preset(), hash);
    for (const Layer::Param& param : layer->params()) {
      hash = HashBytes(
          absl::StrCat(param.name, ":", absl::StrJoin(param.shape, "x"), ";"),
          hash);
    }
  }
  return {layers.size(), parameters, hash};
}

}  // namespace

// One group as this daemon sees it: its local ranks and their communicator.
class Group {
 public:
  Group(std::string name, int world_size, std::string unique_id,
        std::vector<Member> members, int64_t parameter_count,
        std::string library)
      : name_(std::move(name)),
        world_size_(world_size),
        unique_id_(std::move(unique_id)),
        members_(std::move(members)),
        parameter_count_(parameter_count),
        library_(std::move(library)) {}
  ~Group() { Leave(); }

  const std::string& name() const { return name_; }
  int world_size() const { return world_size_; }
  const std::vector<Member>& members() const { return members_; }
  int64_t parameter_count() const { return parameter_count_; }

  // Connects and checks the layers in the background.
  void Form(std::unique_ptr<GroupComm> comm,
            std::vector<std::vector<uint64_t>> fingerprints,
            absl::Time deadline) {
    comm_ = std::move(comm);
    former_ =
        std::thread([this, fingerprints = std::move(fingerprints), deadline] {
          absl::Status status = comm_->WaitConnected(deadline);
          if (status.ok()) status = CheckLayers(fingerprints, deadline);
          if (!status.ok()) comm_->Abort();
          absl::MutexLock lock(&mu_);
          state_ = status.ok() ? v1::GroupInfo::READY : v1::GroupInfo::FAILED;
          error_ = std::string(status.message());
        });
  }

  // OK once READY; the group's error once FAILED; DEADLINE_EXCEEDED while
  // still forming at `deadline`.
  absl::Status AwaitFormed(absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    auto formed = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return state_ != v1::GroupInfo::FORMING;
    };
    mu_.AwaitWithDeadline(absl::Condition(&formed), deadline);
    return StateStatus();
  }

  // Runs one collective; any error fails the group for good.
  absl::Status Collective(absl::FunctionRef<absl::Status(GroupComm&)> fn) {
    absl::MutexLock op(&op_mu_);
    {
      absl::MutexLock lock(&mu_);
      MHC_RETURN_IF_ERROR(StateStatus());
    }
    absl::Status status = left_ ? absl::FailedPreconditionError(absl::StrCat(
                                      "group '", name_, "' was left"))
                                : fn(*comm_);
    if (!status.ok()) {
      comm_->Abort();
      absl::MutexLock lock(&mu_);
      state_ = v1::GroupInfo::FAILED;
      error_ = std::string(status.message());
    }
    return status;
  }

  // Ends the formation and any running collective, and the communicators.
  void Leave() {
    if (comm_ == nullptr) return;
    comm_->Stop();
    if (former_.joinable()) former_.join();
    absl::MutexLock op(&op_mu_);
    if (!left_) comm_->Abort();
    left_ = true;
  }

  v1::GroupInfo::State state() const {
    absl::MutexLock lock(&mu_);
    return state_;
  }

  void Fill(v1::GroupInfo* info) const {
    info->set_group(name_);
    info->set_world_size(world_size_);
    info->set_unique_id(unique_id_);
    for (const Member& member : members_) {
      v1::GroupRank* rank = info->add_ranks();
      rank->set_rank(member.rank.rank);
      rank->set_device(member.rank.executor->device());
      for (const std::string& layer : member.layers) rank->add_layers(layer);
    }
    info->set_parameter_count(parameter_count_);
    info->set_library(library_);
    absl::MutexLock lock(&mu_);
    info->set_state(state_);
    info->set_error(error_);
  }

 private:
  absl::Status StateStatus() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    switch (state_) {
      case v1::GroupInfo::READY:
        return absl::OkStatus();
      case v1::GroupInfo::FORMING:
        return absl::DeadlineExceededError(absl::StrCat(
            "group '", name_,
            "' is still forming (waiting for its other members to join)"));
      default:
        return absl::FailedPreconditionError(
            absl::StrCat("group '", name_, "' failed: ", error_,
                         "; leave it and form a new one"));
    }
  }

  // Every rank's fingerprint must equal rank 0's.
  absl::Status CheckLayers(const std::vector<std::vector<uint64_t>>& mine,
                           absl::Time deadline) {
    MHC_ASSIGN_OR_RETURN(auto rows, comm_->AllGather(mine, deadline));
    for (int rank = 1; rank < world_size_; ++rank) {
      if (rows[rank] == rows[0]) continue;
      return absl::FailedPreconditionError(absl::StrCat(
          "the ranks' layers differ: rank ", rank, " holds ", rows[rank][0],
          " layers of ", rows[rank][1], " parameters (shape hash ",
          absl::Hex(rows[rank][2]), "), rank 0 holds ", rows[0][0],
          " layers of ", rows[0][1], " (shape hash ", absl::Hex(rows[0][2]),
          ")"));
    }
    return absl::OkStatus();
  }

  const std::string name_;
  const int world_size_;
  const std::string unique_id_;
  const std::vector<Member> members_;
  const int64_t parameter_count_;
  const std::string library_;
  std::unique_ptr<GroupComm> comm_;
  std::thread former_;
  mutable absl::Mutex mu_;
  v1::GroupInfo::State state_ ABSL_GUARDED_BY(mu_) = v1::GroupInfo::FORMING;
  std::string error_ ABSL_GUARDED_BY(mu_);
  // One collective at a time; Leave waits for the running one.
  absl::Mutex op_mu_;
  bool left_ ABSL_GUARDED_BY(op_mu_) = false;
};

GroupRegistry::GroupRegistry(LayerStore* store,
                             std::vector<Executor*> executors,
                             std::unique_ptr<GroupTransport> transport,
                             std::string unavailable,
                             absl::Duration default_timeout, Metrics* metrics)
    : store_(store),
      executors_(std::move(executors)),
      transport_(std::move(transport)),
      unavailable_(std::move(unavailable)),
      default_timeout_(default_timeout),
      metrics_(metrics) {
  PublishStates();
}

GroupRegistry::~GroupRegistry() {
  std::map<std::string, std::shared_ptr<Group>> groups;
  {
    absl::MutexLock lock(&mu_);
    groups.swap(groups_);
  }
  for (auto& [name, group] : groups) group->Leave();
}

absl::StatusOr<absl::Time> GroupRegistry::Deadline(
    double timeout_seconds) const {
  if (!std::isfinite(timeout_seconds) || timeout_seconds < 0 ||
      timeout_seconds > kMaxTimeoutSeconds) {
    return absl::InvalidArgumentError(absl::StrCat(
        "timeout_seconds: expected 0 (the daemon's --group_timeout) to ",
        kMaxTimeoutSeconds, ", got ", timeout_seconds));
  }
  const absl::Duration timeout =
      timeout_seconds == 0 ? default_timeout_ : absl::Seconds(timeout_seconds);
  return absl::Now() + timeout;
}

absl::StatusOr<v1::GroupInfo> GroupRegistry::Create(
    const v1::CreateGroupRequest& request) {
  return Start(request.group(), request.world_size(), "", request.ranks(),
               request.timeout_seconds(), request.wait());
}

absl::StatusOr<v1::GroupInfo> GroupRegistry::Join(
    const v1::JoinGroupRequest& request) {
  if (request.unique_id().empty()) {
    return absl::InvalidArgumentError(
        "unique_id: required (GroupInfo.unique_id from rank 0's daemon)");
  }
  return Start(request.group(), request.world_size(), request.unique_id(),
               request.ranks(), request.timeout_seconds(), request.wait());
}

absl::StatusOr<v1::GroupInfo> GroupRegistry::Start(
    const std::string& name, int world_size, std::string unique_id,
    const google::protobuf::RepeatedPtrField<v1::GroupRank>& ranks,
    double timeout_seconds, bool wait) {
  if (transport_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("data-parallel groups are not available: ", unavailable_));
  }
  const bool creating = unique_id.empty();
  MHC_RETURN_IF_ERROR(ValidateLayerName(name, "group"));
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size: expected at least 1, got ", world_size));
  }
  if (ranks.empty()) {
    return absl::InvalidArgumentError(
        "ranks: expected this daemon's ranks, got none");
  }
  MHC_ASSIGN_OR_RETURN(const absl::Time deadline, Deadline(timeout_seconds));

  std::vector<Member> members;
  std::vector<std::vector<uint64_t>> fingerprints;
  std::set<int> seen_ranks;
  std::set<Executor*> seen_devices;
  int64_t parameter_count = -1;
  bool has_rank0 = false;
  for (int i = 0; i < ranks.size(); ++i) {
    const v1::GroupRank& rank = ranks[i];
    const std::string field = absl::StrCat("ranks[", i, "]");
    if (rank.rank() < 0 || rank.rank() >= world_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".rank: expected 0..", world_size - 1,
                       " (world_size ", world_size, "), got ", rank.rank()));
    }
    if (!seen_ranks.insert(rank.rank()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".rank: rank ", rank.rank(), " listed twice"));
    }
    has_rank0 |= rank.rank() == 0;
    Executor* executor = nullptr;
    for (Executor* candidate : executors_) {
      if (rank.device().empty() ? candidate == executors_.front()
                                : candidate->device() == rank.device()) {
        executor = candidate;
      }
    }
    if (executor == nullptr || executor->cuda_ordinal() < 0) {
      std::vector<std::string> names;
      for (Executor* candidate : executors_) {
        if (candidate->cuda_ordinal() >= 0)
          names.push_back(candidate->device());
      }
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".device: expected one of this daemon's CUDA devices (",
          absl::StrJoin(names, ", "), "), got '", rank.device(), "'"));
    }
    if (!seen_devices.insert(executor).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".device: ", executor->device(),
          " already holds a rank of this group (one rank per device)"));
    }
    if (rank.layers().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".layers: expected the rank's replicas"));
    }
    Member member{{rank.rank(), executor}, {}};
    std::vector<std::shared_ptr<Layer>> layers;
    std::set<std::string> seen_layers;
    for (int j = 0; j < rank.layers().size(); ++j) {
      const std::string layer_field = absl::StrCat(field, ".layers[", j, "]");
      MHC_ASSIGN_OR_RETURN(std::shared_ptr<Layer> layer,
                           store_->Find(rank.layers(j), layer_field));
      if (layer->executor() != executor) {
        return absl::FailedPreconditionError(
            absl::StrCat(layer_field, ": layer '", layer->name(), "' lives on ",
                         layer->executor()->device(), ", rank ", rank.rank(),
                         " on ", executor->device()));
      }
      if (!seen_layers.insert(layer->name()).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            layer_field, ": layer '", layer->name(), "' listed twice"));
      }
      member.layers.push_back(layer->name());
      layers.push_back(std::move(layer));
    }
    fingerprints.push_back(Fingerprint(layers));
    const auto count = static_cast<int64_t>(fingerprints.back()[1]);
    if (parameter_count >= 0 && fingerprints.back() != fingerprints.front()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".layers: differ in number or shapes from ranks[0].layers"));
    }
    parameter_count = count;
    members.push_back(std::move(member));
  }
  if (creating && !has_rank0) {
    return absl::InvalidArgumentError(
        "ranks: CreateGroup must include rank 0 (the other members join "
        "with JoinGroup and the unique_id it returns)");
  }
  if (!creating && has_rank0) {
    return absl::InvalidArgumentError(
        "ranks: rank 0 is CreateGroup's; JoinGroup takes the others");
  }
  {
    absl::MutexLock lock(&mu_);
    if (groups_.count(name) > 0) {
      return absl::AlreadyExistsError(absl::StrCat(
          "group '", name, "' exists on this daemon; LeaveGroup it first"));
    }
  }
  if (creating) {
    MHC_ASSIGN_OR_RETURN(unique_id, transport_->NewUniqueId());
  }
  std::vector<LocalRank> local;
  for (const Member& member : members) local.push_back(member.rank);
  MHC_ASSIGN_OR_RETURN(std::unique_ptr<GroupComm> comm,
                       transport_->Open(unique_id, world_size, local));
  auto group =
      std::make_shared<Group>(name, world_size, unique_id, std::move(members),
                              parameter_count, transport_->Describe());
  group->Form(std::move(comm), std::move(fingerprints), deadline);
  {
    absl::MutexLock lock(&mu_);
    if (!groups_.emplace(name, group).second) {
      return absl::AlreadyExistsError(
          absl::StrCat("group '", name, "' was just made by another request"));
    }
  }
  if (wait) group->AwaitFormed(deadline).IgnoreError();  // the state says
  PublishStates();
  v1::GroupInfo info;
  group->Fill(&info);
  return info;
}

absl::StatusOr<std::shared_ptr<Group>> GroupRegistry::Find(
    const std::string& name) const {
  if (transport_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("data-parallel groups are not available: ", unavailable_));
  }
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(name);
  if (it == groups_.end()) {
    return absl::NotFoundError(
        absl::StrCat("group: no group '", name, "' on this daemon"));
  }
  return it->second;
}

absl::StatusOr<v1::GroupInfo> GroupRegistry::Get(
    const v1::GetGroupRequest& request) {
  MHC_ASSIGN_OR_RETURN(std::shared_ptr<Group> group, Find(request.group()));
  v1::GroupInfo info;
  group->Fill(&info);
  return info;
}

namespace {

// The group's layers on each local rank, current and on the rank's device;
// `gradients` picks the accumulators, else the parameters.
absl::StatusOr<std::vector<RankBuffers>> GroupBuffers(
    const LayerStore& store, const Group& group, bool gradients,
    std::vector<std::shared_ptr<Layer>>* hold) {
  std::vector<RankBuffers> buffers;
  for (const Member& member : group.members()) {
    RankBuffers rank;
    for (const std::string& name : member.layers) {
      MHC_ASSIGN_OR_RETURN(std::shared_ptr<Layer> layer,
                           store.Find(name, "group layer"));
      MHC_RETURN_IF_ERROR(layer->CheckCurrent());
      if (layer->executor() != member.rank.executor) {
        return absl::FailedPreconditionError(
            absl::StrCat("group layer '", name, "' moved off ",
                         member.rank.executor->device()));
      }
      rank.push_back({gradients ? layer->grads() : layer->values(),
                      static_cast<size_t>(layer->parameter_count())});
      hold->push_back(std::move(layer));
    }
    buffers.push_back(std::move(rank));
  }
  return buffers;
}

}  // namespace

absl::StatusOr<v1::CollectiveResponse> GroupRegistry::AllReduceGradients(
    const v1::AllReduceGradientsRequest& request) {
  if (!v1::ReduceOp_IsValid(request.op())) {
    return absl::InvalidArgumentError(
        absl::StrCat("op: expected SUM or MEAN, got ", request.op()));
  }
  const bool mean = request.op() == v1::REDUCE_OP_MEAN;
  MHC_ASSIGN_OR_RETURN(std::shared_ptr<Group> group, Find(request.group()));
  MHC_ASSIGN_OR_RETURN(const absl::Time deadline,
                       Deadline(request.timeout_seconds()));
  MHC_RETURN_IF_ERROR(group->AwaitFormed(deadline));
  const absl::Time start = absl::Now();
  absl::Status status = group->Collective([&](GroupComm& comm) {
    std::vector<std::shared_ptr<Layer>> hold;
    MHC_ASSIGN_OR_RETURN(auto buffers,
                         GroupBuffers(*store_, *group, true, &hold));
    return comm.AllReduce(buffers, mean, deadline);
  });
  PublishStates();
  MHC_RETURN_IF_ERROR(status);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const double bytes =
      static_cast<double>(group->parameter_count()) * sizeof(float);
  const int n = group->world_size();
  v1::CollectiveResponse response;
  response.set_bytes(static_cast<uint64_t>(bytes));
  response.set_seconds(seconds);
  response.set_bus_bytes_per_second(
      seconds > 0 ? bytes * 2 * (n - 1) / n / seconds : 0);
  metrics_->RecordCollective("all_reduce", bytes, seconds,
                             response.bus_bytes_per_second());
  return response;
}

absl::StatusOr<v1::CollectiveResponse> GroupRegistry::BroadcastParameters(
    const v1::BroadcastParametersRequest& request) {
  MHC_ASSIGN_OR_RETURN(std::shared_ptr<Group> group, Find(request.group()));
  if (request.root_rank() < 0 || request.root_rank() >= group->world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("root_rank: expected 0..", group->world_size() - 1,
                     ", got ", request.root_rank()));
  }
  MHC_ASSIGN_OR_RETURN(const absl::Time deadline,
                       Deadline(request.timeout_seconds()));
  MHC_RETURN_IF_ERROR(group->AwaitFormed(deadline));
  const absl::Time start = absl::Now();
  std::vector<std::shared_ptr<Layer>> hold;
  absl::Status status = group->Collective([&](GroupComm& comm) {
    MHC_ASSIGN_OR_RETURN(auto buffers,
                         GroupBuffers(*store_, *group, false, &hold));
    return comm.Broadcast(buffers, request.root_rank(), deadline);
  });
  PublishStates();
  MHC_RETURN_IF_ERROR(status);
  // Readers of the parameters (clients that cache them) see new values.
  for (const auto& layer : hold) layer->set_version(layer->version() + 1);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const double bytes =
      static_cast<double>(group->parameter_count()) * sizeof(float);
  v1::CollectiveResponse response;
  response.set_bytes(static_cast<uint64_t>(bytes));
  response.set_seconds(seconds);
  response.set_bus_bytes_per_second(seconds > 0 ? bytes / seconds : 0);
  metrics_->RecordCollective("broadcast", bytes, seconds,
                             response.bus_bytes_per_second());
  return response;
}

absl::Status GroupRegistry::Leave(const v1::LeaveGroupRequest& request) {
  MHC_ASSIGN_OR_RETURN(std::shared_ptr<Group> group, Find(request.group()));
  {
    absl::MutexLock lock(&mu_);
    auto it = groups_.find(request.group());
    if (it != groups_.end() && it->second == group) groups_.erase(it);
  }
  group->Leave();
  PublishStates();
  return absl::OkStatus();
}

void GroupRegistry::PublishStates() const {
  std::map<v1::GroupInfo::State, double> counts{{v1::GroupInfo::FORMING, 0},
                                                {v1::GroupInfo::READY, 0},
                                                {v1::GroupInfo::FAILED, 0}};
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, group] : groups_) ++counts[group->state()];
  }
  for (const auto& [state, count] : counts) {
    metrics_->SetGroups(StateName(state), count);
  }
}

}  // namespace mhc::server
