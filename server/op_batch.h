// A request's ops as OpRunner runs them (op_runner.h): planned, then bound
// to memory and issued. Internal to the op runner, whose work is split by
// job:
//
//   op_planning.cc      validates every op of a request against its layer
//                       and earlier outputs and builds the Batch; runs
//                       nothing
//   op_host_binding.cc  host backends: binds tensors to the request's and
//                       response's bytes in place and runs the ops
//   op_device_issue.cc  backends without host access: stages host tensors
//                       and queues copies and ops on the device
//   op_runner.cc        launches each op through its executor, and runs a
//                       whole request (RunSingle, Execute)
#ifndef MHC_SERVER_OP_BATCH_H_
#define MHC_SERVER_OP_BATCH_H_

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"
#include "mhc/backend.h"
#include "mhc/v1/service.pb.h"
#include "server/executor.h"
#include "server/layer_store.h"
#include "server/op_defs.h"
#include "server/shm/shm_registry.h"
#include "server/tensor_resolver.h"

namespace mhc::server::op_batch {

// Host memory from std::aligned_alloc.
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using HostBuffer = std::unique_ptr<void, FreeDeleter>;

struct PlannedInput {
  bool present = false;
  TensorInfo info;
  absl::string_view bytes;  // inline data of the request
  int source = -1;          // an earlier output of the batch (Execute refs)
  const void* data = nullptr;
  bool device = false;  // data is device memory of a CUDA region
  HostBuffer scratch;
};

struct PlannedOutput {
  std::string name;  // "<op id>.<field>", or the field for single RPCs
  TensorInfo info;
  v1::TensorRef* dest = nullptr;  // set when the client gets it back
  void* data = nullptr;           // where the op writes, backend memory
  HostBuffer scratch;
  bool copy_to_dest = false;  // data is not dest's own bytes
  // An output_regions destination: written in place, returned as shm.
  std::optional<v1::SharedMemoryRef> region;
  RegionSpan span;
  bool copy_to_region = false;  // data is not the region's bytes
};

struct PlannedOp {
  const OpDef* def = nullptr;
  std::string context;  // message prefix, "ops[2] (pre1): " in a batch
  std::shared_ptr<Layer> layer;
  int64_t tokens = 0;
  DType act_dtype = DType::kF32;
  std::vector<PlannedInput> inputs;  // by input slot
  std::vector<int> outputs;          // by output slot; -1: not produced
  bool accumulate = false;
  // Device backends: the last upload of its host inputs, which it waits for.
  CopyTicket upload = kNoCopy;
};

// Everything one request runs: its ops in order and the arena of their
// outputs. Outputs are held by pointer so their addresses stay put.
struct Batch {
  std::vector<PlannedOp> ops;
  std::vector<std::unique_ptr<PlannedOutput>> outputs;
  absl::flat_hash_map<std::string, int> by_name;
};

// Planning (op_planning.cc).
//
// Validates one op against its layer and the outputs of earlier ops, and
// adds its outputs to the arena. Runs nothing.
absl::Status PlanOp(const OpDef& def, const google::protobuf::Message& request,
                    absl::string_view id, const LayerStore& store,
                    bool in_batch, Batch* batch, ByteBudget* budget,
                    RegionScope* regions);
// An Execute op id: 1..64 characters of [A-Za-z0-9_-].
absl::Status ValidateOpId(absl::string_view id, absl::string_view field);

// Host binding (op_host_binding.cc).
//
// Sets dest's dtype and shape; a region output is returned as its shm
// reference, without bytes.
void DescribeDest(const PlannedOutput& out);
// Sets dest's dtype and shape and chooses where the op writes: into dest's
// bytes when the backend can address them, else into scratch.
absl::Status PrepareHostOutput(PlannedOutput& out);
// Points `in` at its inline bytes, or at an aligned copy of them.
absl::Status PrepareHostInput(PlannedInput& in);
// Host backends: the ops read and write the request's memory in place
// (PrepareHostInput/Output); only misaligned tensors are copied.
absl::Status RunOnHost(Batch& batch, Executor& executor, Backend& backend,
                       Workspace ws);

// Device issue (op_device_issue.cc).
//
// The staging memory `batch` takes on a backend without host access.
uint64_t StagingBytes(const Batch& batch);
// Backends without host access: binds every tensor to device memory and
// queues the batch's copies and ops, without waiting for any of them.
// How the copies overlap the ops: op_device_issue.cc.
absl::Status IssueOnDevice(Batch& batch, Executor& executor, Backend& backend,
                           Workspace ws, StagingArena& staging,
                           bool* host_copies);

// Launching (op_runner.cc).
//
// Runs `op`, whose tensors are bound to backend memory: checks that its
// layer is still current, launches it through the executor (which times
// it), audits it when sampled and counts its gradient tokens.
absl::Status LaunchOp(Executor& executor, Backend& backend, Workspace ws,
                      const Batch& batch, const PlannedOp& op);

}  // namespace mhc::server::op_batch

#endif  // MHC_SERVER_OP_BATCH_H_
