// Device issue: on backends without host access every host tensor is
// staged in the executor's staging memory and the batch's copies and ops
// are queued on the device, overlapping each other (op_batch.h).
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "mhc/status.h"
#include "server/op_batch.h"
#include "server/status_util.h"

namespace mhc::server::op_batch {
namespace {

// Kernels write a CUDA-region output in place; every other output of a
// device backend lives in staging memory first.
bool WrittenInPlace(const PlannedOutput& out) {
  return out.region.has_value() && out.span.device;
}

bool Staged(const PlannedInput& in) {
  return in.present && in.source < 0 && !in.device;
}

// Where the client reads `out` on the host, or null when it stays on the
// device (a CUDA region, or an output of the batch nobody fetches).
void* HostDestination(PlannedOutput& out) {
  if (out.region.has_value()) return out.span.device ? nullptr : out.span.data;
  if (out.dest != nullptr) return out.dest->mutable_inline_data()->data();
  return nullptr;
}

}  // namespace

// The staging memory `batch` takes on a backend without host access.
uint64_t StagingBytes(const Batch& batch) {
  uint64_t bytes = 0;
  for (const PlannedOp& op : batch.ops) {
    for (const PlannedInput& in : op.inputs) {
      if (Staged(in)) bytes += StagingArena::Footprint(in.info.bytes);
    }
  }
  for (const auto& out : batch.outputs) {
    if (!WrittenInPlace(*out)) {
      bytes += StagingArena::Footprint(out->info.bytes);
    }
  }
  return bytes;
}

// Backends without host access: binds every tensor to device memory and
// queues the batch's copies and ops, without waiting for any of them.
//
// Every host input is uploaded up front, in op order, and each op waits
// only for its own inputs' uploads: with page-locked sources (pinned
// regions) the copy calls return at once, so the uploads of later ops run
// while earlier ops compute. (Up front, because the executor's kernel timer
// waits for each op before the next is issued: only work queued before an
// op can overlap it.) An output bound for page-locked memory is
// downloaded as soon as its op is issued, overlapping the ops after it; one
// bound for pageable memory (inline bytes, an unpinned region) only after
// the last op, since such a copy holds the host until it is done and would
// delay issuing the rest.
absl::Status IssueOnDevice(Batch& batch, Executor& executor, Backend& backend,
                           Workspace ws, StagingArena& staging,
                           bool* host_copies) {
  for (PlannedOp& op : batch.ops) {
    for (size_t i = 0; i < op.inputs.size(); ++i) {
      PlannedInput& in = op.inputs[i];
      if (!Staged(in)) continue;
      *host_copies = true;
      MHC_ASSIGN_OR_RETURN(void* device, staging.Take(in.info.bytes));
      in.data = device;
      absl::StatusOr<CopyTicket> ticket =
          backend.CopyToDeviceAsync(device, in.bytes.data(), in.bytes.size());
      if (!ticket.ok()) {
        return Annotate(ticket.status(),
                        absl::StrCat(op.context, op.def->inputs[i].name,
                                     ": copy to the device: "));
      }
      // Tickets grow in queue order: the op waits for its last one.
      if (*ticket != kNoCopy) op.upload = *ticket;
    }
  }
  for (auto& out : batch.outputs) {
    if (WrittenInPlace(*out)) {
      out->data = out->span.data;
    } else {
      MHC_ASSIGN_OR_RETURN(out->data, staging.Take(out->info.bytes));
    }
  }
  std::vector<std::pair<const PlannedOp*, PlannedOutput*>> deferred;
  auto download = [&](const PlannedOp& op, PlannedOutput& out) {
    *host_copies = true;
    return Annotate(
        backend.CopyToHostAsync(HostDestination(out), out.data, out.info.bytes),
        absl::StrCat(op.context, out.name, ": copy to the host: "));
  };
  for (const PlannedOp& op : batch.ops) {
    MHC_RETURN_IF_ERROR(
        Annotate(backend.OpsWaitForCopy(op.upload), op.context));
    MHC_RETURN_IF_ERROR(LaunchOp(executor, backend, ws, batch, op));
    for (int index : op.outputs) {
      if (index < 0) continue;
      PlannedOutput& out = *batch.outputs[index];
      if (out.info.bytes == 0 || HostDestination(out) == nullptr) continue;
      if (out.region.has_value() && out.span.pinned) {
        MHC_RETURN_IF_ERROR(download(op, out));
      } else {
        deferred.emplace_back(&op, &out);
      }
    }
  }
  for (auto [op, out] : deferred) MHC_RETURN_IF_ERROR(download(*op, *out));
  return absl::OkStatus();
}

}  // namespace mhc::server::op_batch
