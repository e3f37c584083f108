#include "server/nccl_transport.h"

#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "mhc/cuda.h"
#include "mhc/status.h"

namespace mhc::server {
namespace {

// The NCCL entry points mhcd uses, resolved from the loaded library (the
// declarations come from the build's nccl.h; nothing links against it).
struct NcclApi {
  void* library = nullptr;
  decltype(&ncclGetVersion) GetVersion = nullptr;
  decltype(&ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&ncclCommInitRankConfig) CommInitRankConfig = nullptr;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&ncclCommAbort) CommAbort = nullptr;
  decltype(&ncclAllReduce) AllReduce = nullptr;
  decltype(&ncclBroadcast) Broadcast = nullptr;
  decltype(&ncclAllGather) AllGather = nullptr;
  decltype(&ncclGroupStart) GroupStart = nullptr;
  decltype(&ncclGroupEnd) GroupEnd = nullptr;
  decltype(&ncclGetErrorString) GetErrorString = nullptr;
  decltype(&ncclGetLastError) GetLastError = nullptr;
};

bool Pending(ncclResult_t result) {
  return result == ncclSuccess || result == ncclInProgress;
}

absl::Status NcclStatus(const NcclApi& api, ncclComm_t comm,
                        ncclResult_t result, absl::string_view what) {
  if (result == ncclSuccess) return absl::OkStatus();
  const char* last = api.GetLastError(comm);
  std::string message =
      absl::StrCat(what, ": NCCL: ", api.GetErrorString(result));
  if (last != nullptr && *last != '\0')
    absl::StrAppend(&message, " (", last, ")");
  switch (result) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(message);
    case ncclRemoteError:
    case ncclSystemError:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

// `status` with `what` in front of its message.
absl::Status Annotated(const absl::Status& status, absl::string_view what) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(what, ": ", status.message()));
}

// Polls `done` until it is true, the deadline passes or `stop` is set:
// spinning first (collectives of a few ms), then sleeping briefly.
absl::Status PollUntil(absl::FunctionRef<absl::StatusOr<bool>()> done,
                       const std::atomic<bool>& stop, absl::Time deadline,
                       absl::string_view what) {
  const absl::Time start = absl::Now();
  for (int round = 0;; ++round) {
    MHC_ASSIGN_OR_RETURN(bool finished, done());
    if (finished) return absl::OkStatus();
    if (stop.load()) {
      return absl::CancelledError(absl::StrCat(what, ": the group was left"));
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          what, ": not done after ", absl::FormatDuration(now - start),
          " (a member of the group may be gone or making other calls)"));
    }
    if (round < 2000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

class NcclComm final : public GroupComm {
 public:
  NcclComm(const NcclApi* api, int world_size, std::vector<LocalRank> ranks)
      : api_(api), world_size_(world_size) {
    for (const LocalRank& rank : ranks) {
      members_.push_back(Member{rank, nullptr, nullptr});
    }
  }
  ~NcclComm() override { Abort(); }

  // Starts every local rank's communicator without waiting for the others.
  absl::Status Start(const ncclUniqueId& id) {
    for (Member& member : members_) {
      absl::StatusOr<std::unique_ptr<CudaStreamMarker>> done =
          MakeCudaStreamMarker(member.rank.executor->cuda_ordinal());
      MHC_RETURN_IF_ERROR(Annotated(done.status(), "group: event"));
      member.done = *std::move(done);
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    absl::Status status;
    api_->GroupStart();
    for (Member& member : members_) {
      // NCCL takes the communicator's device from the calling thread.
      UseCudaDevice(member.rank.executor->cuda_ordinal()).IgnoreError();
      const ncclResult_t result = api_->CommInitRankConfig(
          &member.comm, world_size_, id, member.rank.rank, &config);
      if (!Pending(result) && status.ok()) {
        status = NcclStatus(*api_, member.comm, result, "group: connect");
      }
    }
    const ncclResult_t end = api_->GroupEnd();
    if (!Pending(end) && status.ok()) {
      status = NcclStatus(*api_, nullptr, end, "group: connect");
    }
    return status;
  }

  absl::Status WaitConnected(absl::Time deadline) override {
    return WaitIdle(deadline, "group: connecting");
  }

  absl::StatusOr<std::vector<std::vector<uint64_t>>> AllGather(
      const std::vector<std::vector<uint64_t>>& words,
      absl::Time deadline) override {
    const size_t count = words.front().size();
    const size_t bytes = count * sizeof(uint64_t);
    // Formation only: plain allocations and copies through each rank's
    // backend are fine here.
    std::vector<uint64_t*> buffers(members_.size(), nullptr);
    auto on_device = [&](size_t i, auto&& fn) {
      return members_[i].rank.executor->WithDevice(
          [&](Backend& backend) -> absl::Status { return fn(backend); });
    };
    auto free_buffers = [&] {
      for (size_t i = 0; i < members_.size(); ++i) {
        if (buffers[i] == nullptr) continue;
        on_device(i, [&](Backend& backend) {
          backend.Free(buffers[i]);
          return absl::OkStatus();
        }).IgnoreError();
      }
    };
    absl::Status status;
    for (size_t i = 0; i < members_.size() && status.ok(); ++i) {
      status = Annotated(
          on_device(
              i,
              [&](Backend& backend) -> absl::Status {
                MHC_ASSIGN_OR_RETURN(
                    void* buffer, backend.Allocate(bytes * (world_size_ + 1)));
                buffers[i] = static_cast<uint64_t*>(buffer);
                return backend.CopyToDevice(buffer, words[i].data(), bytes);
              }),
          "group: gather");
    }
    if (status.ok()) {
      status = Run(
          [&](size_t i, cudaStream_t stream) {
            return api_->AllGather(buffers[i], buffers[i] + count, count,
                                   ncclUint64, members_[i].comm, stream);
          },
          deadline, "group: layer check");
    }
    std::vector<std::vector<uint64_t>> rows(world_size_,
                                            std::vector<uint64_t>(count));
    if (status.ok()) {
      status =
          Annotated(on_device(0,
                              [&](Backend& backend) -> absl::Status {
                                for (int rank = 0; rank < world_size_; ++rank) {
                                  MHC_RETURN_IF_ERROR(backend.CopyToHost(
                                      rows[rank].data(),
                                      buffers[0] + count * (rank + 1), bytes));
                                }
                                return absl::OkStatus();
                              }),
                    "group: gather");
    }
    free_buffers();
    if (!status.ok()) return status;
    return rows;
  }

  absl::Status AllReduce(const std::vector<RankBuffers>& per_rank, bool mean,
                         absl::Time deadline) override {
    return Run(
        [&](size_t i, cudaStream_t stream) {
          for (const FloatBuffer& buffer : per_rank[i]) {
            const ncclResult_t result = api_->AllReduce(
                buffer.data, buffer.data, buffer.count, ncclFloat32,
                mean ? ncclAvg : ncclSum, members_[i].comm, stream);
            if (!Pending(result)) return result;
          }
          return ncclSuccess;
        },
        deadline, "AllReduceGradients");
  }

  absl::Status Broadcast(const std::vector<RankBuffers>& per_rank, int root,
                         absl::Time deadline) override {
    return Run(
        [&](size_t i, cudaStream_t stream) {
          for (const FloatBuffer& buffer : per_rank[i]) {
            const ncclResult_t result =
                api_->Broadcast(buffer.data, buffer.data, buffer.count,
                                ncclFloat32, root, members_[i].comm, stream);
            if (!Pending(result)) return result;
          }
          return ncclSuccess;
        },
        deadline, "BroadcastParameters");
  }

  void Stop() override { stop_.store(true); }

  void Abort() override {
    for (Member& member : members_) {
      if (member.comm == nullptr) continue;
      api_->CommAbort(member.comm);
      member.comm = nullptr;
    }
  }

 private:
  struct Member {
    LocalRank rank;
    ncclComm_t comm = nullptr;
    std::unique_ptr<CudaStreamMarker> done;  // recorded after each collective
  };

  // Until no local communicator has work in progress on the host side
  // (connecting, or issuing a grouped call).
  absl::Status WaitIdle(absl::Time deadline, absl::string_view what) {
    return PollUntil(
        [&]() -> absl::StatusOr<bool> {
          bool idle = true;
          for (Member& member : members_) {
            if (member.comm == nullptr) {
              return absl::FailedPreconditionError(
                  absl::StrCat(what, ": the group was aborted"));
            }
            ncclResult_t state = ncclSuccess;
            api_->CommGetAsyncError(member.comm, &state);
            if (state == ncclInProgress) {
              idle = false;
            } else if (state != ncclSuccess) {
              return NcclStatus(*api_, member.comm, state, what);
            }
          }
          return idle;
        },
        stop_, deadline, what);
  }

  // Issues one grouped call on every local rank's op stream, holding all
  // their executors (taken in device order, as every group does, so two
  // groups never wait for each other), then waits for the devices without
  // holding them.
  absl::Status Run(absl::FunctionRef<ncclResult_t(size_t, cudaStream_t)> issue,
                   absl::Time deadline, absl::string_view what) {
    std::vector<size_t> order(members_.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return members_[a].rank.executor->cuda_ordinal() <
             members_[b].rank.executor->cuda_ordinal();
    });
    std::vector<cudaStream_t> streams(members_.size());
    std::function<absl::Status(size_t)> hold = [&](size_t k) -> absl::Status {
      if (k == order.size()) return IssueHeld(issue, streams, deadline, what);
      Member& member = members_[order[k]];
      return member.rank.executor->WithDevice([&](Backend& backend) {
        MHC_ASSIGN_OR_RETURN(void* stream, CudaOpStream(backend));
        streams[order[k]] = static_cast<cudaStream_t>(stream);
        return hold(k + 1);
      });
    };
    MHC_RETURN_IF_ERROR(hold(0));
    return PollUntil(
        [&]() -> absl::StatusOr<bool> {
          bool finished = true;
          for (Member& member : members_) {
            absl::StatusOr<bool> done = member.done->Done();
            MHC_RETURN_IF_ERROR(Annotated(done.status(), what));
            if (!*done) finished = false;
            ncclResult_t state = ncclSuccess;
            api_->CommGetAsyncError(member.comm, &state);
            if (!Pending(state)) {
              return NcclStatus(*api_, member.comm, state, what);
            }
          }
          return finished;
        },
        stop_, deadline, what);
  }

  absl::Status IssueHeld(
      absl::FunctionRef<ncclResult_t(size_t, cudaStream_t)> issue,
      const std::vector<cudaStream_t>& streams, absl::Time deadline,
      absl::string_view what) {
    absl::Status status;
    api_->GroupStart();
    for (size_t i = 0; i < members_.size(); ++i) {
      const ncclResult_t result = issue(i, streams[i]);
      if (!Pending(result) && status.ok()) {
        status = NcclStatus(*api_, members_[i].comm, result, what);
      }
    }
    const ncclResult_t end = api_->GroupEnd();
    if (!Pending(end) && status.ok()) {
      status = NcclStatus(*api_, nullptr, end, what);
    }
    MHC_RETURN_IF_ERROR(status);
    MHC_RETURN_IF_ERROR(WaitIdle(deadline, what));
    for (size_t i = 0; i < members_.size(); ++i) {
      MHC_RETURN_IF_ERROR(
          Annotated(members_[i].done->Record(streams[i]), what));
    }
    return absl::OkStatus();
  }

  const NcclApi* const api_;
  const int world_size_;
  std::vector<Member> members_;
  std::atomic<bool> stop_{false};
};

class NcclTransport final : public GroupTransport {
 public:
  explicit NcclTransport(NcclApi api) : api_(api) {}
  ~NcclTransport() override = default;

  std::string Describe() const override {
    int version = 0;
    api_.GetVersion(&version);
    // 2.19 and later: major * 10000 + minor * 100 + patch.
    return absl::StrCat("NCCL ", version / 10000, ".", version / 100 % 100, ".",
                        version % 100);
  }

  absl::StatusOr<std::string> NewUniqueId() override {
    ncclUniqueId id;
    MHC_RETURN_IF_ERROR(NcclStatus(api_, nullptr, api_.GetUniqueId(&id),
                                   "CreateGroup: unique id"));
    return std::string(id.internal, sizeof(id.internal));
  }

  absl::StatusOr<std::unique_ptr<GroupComm>> Open(
      absl::string_view unique_id, int world_size,
      std::vector<LocalRank> ranks) override {
    ncclUniqueId id;
    if (unique_id.size() != sizeof(id.internal)) {
      return absl::InvalidArgumentError(
          absl::StrCat("unique_id: expected ", sizeof(id.internal),
                       " bytes (GroupInfo.unique_id of rank 0's daemon), got ",
                       unique_id.size()));
    }
    std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
    auto comm = std::make_unique<NcclComm>(&api_, world_size, std::move(ranks));
    MHC_RETURN_IF_ERROR(comm->Start(id));
    return std::unique_ptr<GroupComm>(std::move(comm));
  }

 private:
  const NcclApi api_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GroupTransport>> LoadNcclTransport(
    const std::string& library) {
  NcclApi api;
  api.library = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (api.library == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("NCCL could not be loaded (--nccl_library=", library,
                     "): ", dlerror()));
  }
  absl::Status missing;
  auto resolve = [&](auto& entry, const char* name) {
    entry = reinterpret_cast<std::remove_reference_t<decltype(entry)>>(
        dlsym(api.library, name));
    if (entry == nullptr && missing.ok()) {
      missing = absl::FailedPreconditionError(absl::StrCat(
          library, " has no ", name, " (NCCL 2.19 or later is needed)"));
    }
  };
  resolve(api.GetVersion, "ncclGetVersion");
  resolve(api.GetUniqueId, "ncclGetUniqueId");
  resolve(api.CommInitRankConfig, "ncclCommInitRankConfig");
  resolve(api.CommGetAsyncError, "ncclCommGetAsyncError");
  resolve(api.CommAbort, "ncclCommAbort");
  resolve(api.AllReduce, "ncclAllReduce");
  resolve(api.Broadcast, "ncclBroadcast");
  resolve(api.AllGather, "ncclAllGather");
  resolve(api.GroupStart, "ncclGroupStart");
  resolve(api.GroupEnd, "ncclGroupEnd");
  resolve(api.GetErrorString, "ncclGetErrorString");
  resolve(api.GetLastError, "ncclGetLastError");
  if (!missing.ok()) {
    dlclose(api.library);
    return missing;
  }
  return std::unique_ptr<GroupTransport>(new NcclTransport(api));
}

}  // namespace mhc::server
