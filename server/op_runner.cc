#include "server/op_runner.h"

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/reflection.h"
#include "mhc/status.h"
#include "server/determinism_audit.h"
#include "server/op_batch.h"
#include "server/op_defs.h"
#include "server/op_launch.h"
#include "server/status_util.h"

namespace mhc::server {

namespace op_batch {
namespace {

// What the executor records about one launch of `op`.
KernelSample SampleOf(const Batch& batch, const PlannedOp& op) {
  KernelSample sample;
  sample.kind = op.def->kind;
  sample.dtype = op.act_dtype;
  sample.layout = op.layer->spec().layout;
  sample.n = op.layer->spec().n;
  sample.tokens = op.tokens;
  for (const PlannedInput& in : op.inputs) {
    if (in.present) sample.bytes += in.info.bytes;
  }
  for (int index : op.outputs) {
    if (index >= 0) sample.bytes += batch.outputs[index]->info.bytes;
  }
  return sample;
}

void Audit(DeterminismAudit& audit, Backend& backend, Workspace ws,
           const Batch& batch, const PlannedOp& op, const BoundOp& bound) {
  AuditedLaunch launch;
  launch.kind = op.def->kind;
  launch.launch = op.def->launch;
  launch.bound = &bound;
  launch.layer = op.layer->Describe();
  for (const PlannedInput& in : op.inputs) {
    launch.input_bytes.push_back(in.present ? in.info.bytes : 0);
  }
  for (size_t j = 0; j < op.outputs.size(); ++j) {
    AuditedLaunch::Output out;
    out.name = op.def->outputs[j].name;
    if (op.outputs[j] >= 0) {
      const PlannedOutput& planned = *batch.outputs[op.outputs[j]];
      out.dtype = planned.info.dtype;
      out.bytes = planned.info.bytes;
    }
    launch.outputs.push_back(std::move(out));
  }
  audit.MaybeAudit(backend, ws, launch);
}

}  // namespace

// Runs `op`, whose tensors are bound to backend memory: checks that its
// layer is still current, launches it through the executor (which times
// it), audits it when sampled and counts its gradient tokens.
absl::Status LaunchOp(Executor& executor, Backend& backend, Workspace ws,
                      const Batch& batch, const PlannedOp& op) {
  MHC_RETURN_IF_ERROR(Annotate(op.layer->CheckCurrent(), op.context));
  BoundOp bound;
  bound.spec = &op.layer->spec();
  bound.tokens = op.tokens;
  bound.act_dtype = op.act_dtype;
  bound.weights = op.layer->Weights();
  if (op.accumulate) bound.grads = op.layer->Grads();
  for (const PlannedInput& in : op.inputs) {
    bound.in.push_back(!in.present      ? nullptr
                       : in.source >= 0 ? batch.outputs[in.source]->data
                                        : in.data);
  }
  for (int index : op.outputs) {
    bound.out.push_back(index < 0 ? nullptr : batch.outputs[index]->data);
  }
  KernelSample sample = SampleOf(batch, op);
  sample.variant = KernelVariant(backend, op.def->kind, bound);
  absl::Status status = executor.Launch(
      sample, [&] { return op.def->launch(backend, bound, ws); });
  if (!status.ok()) {
    absl::StatusCode code =
        status.code() == absl::StatusCode::kResourceExhausted
            ? status.code()
            : absl::StatusCode::kInternal;
    return absl::Status(
        code, absl::StrCat(op.context, op.def->rpc, " on ",
                           op.layer->Describe(), " failed in the ",
                           backend.Name(), " backend: ", status.message()));
  }
  DeterminismAudit* audit = executor.audit();
  if (audit != nullptr && audit->active()) {
    Audit(*audit, backend, ws, batch, op, bound);
  }
  if (op.accumulate && op.def->counts_tokens) {
    op.layer->AddGradientTokens(op.tokens);
  }
  return absl::OkStatus();
}

}  // namespace op_batch

namespace {

using google::protobuf::Message;
using google::protobuf::Reflection;
using op_batch::Batch;
using op_batch::DescribeDest;
using op_batch::IssueOnDevice;
using op_batch::PlannedInput;
using op_batch::PlannedOp;
using op_batch::PlanOp;
using op_batch::PrepareHostInput;
using op_batch::PrepareHostOutput;
using op_batch::RunOnHost;
using op_batch::StagingBytes;
using op_batch::ValidateOpId;

absl::Status RunBatch(Batch& batch, Executor& executor, RegionScope& regions) {
  const bool host = executor.HostAccessible();
  MHC_ASSIGN_OR_RETURN(StreamOrder order,
                       regions.Events(executor.cuda_ordinal()));
  if (host) {
    for (PlannedOp& op : batch.ops) {
      for (PlannedInput& in : op.inputs) {
        if (in.present && in.source < 0) {
          MHC_RETURN_IF_ERROR(PrepareHostInput(in));
        }
      }
    }
    for (auto& out : batch.outputs) {
      MHC_RETURN_IF_ERROR(PrepareHostOutput(*out));
    }
  } else {
    for (auto& out : batch.outputs) {
      if (out->dest != nullptr) DescribeDest(*out);
    }
  }
  auto workspace_bytes = [&](const Backend& backend) {
    size_t bytes = 0;
    for (const PlannedOp& op : batch.ops) {
      bytes =
          std::max(bytes, backend.WorkspaceBytes(op.def->kind, op.layer->spec(),
                                                 op.tokens, op.act_dtype));
    }
    return bytes;
  };
  return executor.Run(
      workspace_bytes, host ? 0 : StagingBytes(batch),
      [&](Backend& backend, Workspace ws, StagingArena& staging) {
        if (host) return RunOnHost(batch, executor, backend, ws);
        absl::Status issued = absl::OkStatus();
        if (order.wait != nullptr) issued = backend.WaitForEvent(order.wait);
        bool host_copies = false;
        if (issued.ok()) {
          issued = IssueOnDevice(batch, executor, backend, ws, staging,
                                 &host_copies);
        }
        if (issued.ok() && order.signal != nullptr) {
          issued = backend.RecordEvent(order.signal);
        }
        if (issued.ok() && order.done_word != nullptr) {
          issued =
              backend.WriteWordAfterWork(order.done_word, order.done_value);
          if (issued.ok()) regions.CompletionQueued(executor.cuda_ordinal());
        }
        // Answered once queued only when the client orders its stream after
        // the signal event or the done word and nothing touches host
        // memory: host copies read the request's memory and write the
        // client's, and the next request reuses the staging memory the
        // uploads write. Work on device memory alone is ordered by the
        // stream. A failure waits too, so that nothing still runs on the
        // request's memory.
        const bool client_waits =
            order.signal != nullptr || order.done_word != nullptr;
        if (issued.ok() && client_waits && !host_copies) {
          return absl::OkStatus();
        }
        absl::Status synced = executor.Synchronize(backend, "request");
        if (!issued.ok()) return issued;
        if (!synced.ok()) {
          return absl::InternalError(absl::StrCat(
              "the ", backend.Name(),
              " backend failed to finish the request: ", synced.message()));
        }
        return absl::OkStatus();
      });
}

}  // namespace

OpRunner::OpRunner(LayerStore* store, RequestLimits limits)
    : store_(store), limits_(limits) {}

absl::Status OpRunner::RunSingle(OpKind kind, const Message& request,
                                 Message* response, RegionScope* regions) {
  const OpDef& def = GetOpDef(kind);
  Batch batch;
  ByteBudget budget(limits_);
  MHC_RETURN_IF_ERROR(PlanOp(def, request, "", *store_, /*in_batch=*/false,
                             &batch, &budget, regions));
  const Reflection* refl = response->GetReflection();
  const PlannedOp& op = batch.ops.front();
  for (size_t j = 0; j < def.outputs.size(); ++j) {
    if (op.outputs[j] < 0) continue;
    batch.outputs[op.outputs[j]]->dest = static_cast<v1::TensorRef*>(
        refl->MutableMessage(response, def.outputs[j].field));
  }
  MHC_RETURN_IF_ERROR(RunBatch(batch, *op.layer->executor(), *regions));
  return regions->CheckIntact();
}

absl::Status OpRunner::Execute(const v1::ExecuteRequest& request,
                               v1::ExecuteResponse* response,
                               RegionScope* regions) {
  if (request.ops_size() > limits_.max_batch_ops) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ops: at most ", limits_.max_batch_ops,
        " ops per batch (--max_batch_ops), got ", request.ops_size()));
  }
  Batch batch;
  ByteBudget budget(limits_);
  absl::flat_hash_map<std::string, int> ids;
  Executor* executor = nullptr;
  for (int i = 0; i < request.ops_size(); ++i) {
    const v1::Op& op = request.ops(i);
    std::string context = absl::StrCat("ops[", i, "]");
    MHC_RETURN_IF_ERROR(ValidateOpId(op.id(), absl::StrCat(context, ".id")));
    auto [it, inserted] = ids.emplace(op.id(), i);
    if (!inserted) {
      return absl::InvalidArgumentError(
          absl::StrCat(context, ".id: '", op.id(), "' is already used by ops[",
                       it->second, "]"));
    }
    absl::StrAppend(&context, " (", op.id(), "): ");
    const OpDef* def = FindOpDefByOpField(op.op_case());
    if (def == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(context,
                       "op: not set (expected one of projection, "
                       "projection_backward, scale, ..., head_backward)"));
    }
    const Message& sub = op.GetReflection()->GetMessage(
        op, v1::Op::descriptor()->FindFieldByNumber(op.op_case()));
    MHC_RETURN_IF_ERROR(
        Annotate(PlanOp(*def, sub, op.id(), *store_, /*in_batch=*/true, &batch,
                        &budget, regions),
                 context));
    PlannedOp& planned = batch.ops.back();
    planned.context = context;
    if (executor == nullptr) executor = planned.layer->executor();
    if (planned.layer->executor() != executor) {
      return absl::InvalidArgumentError(
          absl::StrCat(context, "layer: ", planned.layer->Describe(), " is on ",
                       planned.layer->executor()->device(),
                       "; every op of a batch must use layers of one device (",
                       executor->device(), ")"));
    }
  }
  std::vector<int> returned;
  if (request.fetch().empty()) {
    for (size_t k = 0; k < batch.outputs.size(); ++k) {
      returned.push_back(static_cast<int>(k));
    }
  }
  for (int i = 0; i < request.fetch_size(); ++i) {
    auto it = batch.by_name.find(request.fetch(i));
    if (it == batch.by_name.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fetch[", i, "]: '", absl::CEscape(request.fetch(i)),
          "' is not an output of this batch (expected \"<op id>.<output "
          "name>\" with an output field of that op's response)"));
    }
    returned.push_back(it->second);
  }
  if (batch.ops.empty()) return absl::OkStatus();
  // All entries first, then pointers: the map never moves them afterwards.
  auto& outputs = *response->mutable_outputs();
  for (int k : returned) outputs[batch.outputs[k]->name];
  for (int k : returned) {
    batch.outputs[k]->dest = &outputs[batch.outputs[k]->name];
  }
  MHC_RETURN_IF_ERROR(RunBatch(batch, *executor, *regions));
  return regions->CheckIntact();
}

}  // namespace mhc::server
