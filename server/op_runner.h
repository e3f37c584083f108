// Runs ops: the single-op RPCs and Execute batches share this one path.
//
// A request is validated completely before anything runs (layers, layer
// kinds, every tensor's dtype/shape/bytes, references between ops of a
// batch, op ids, fetch names, size limits), so a rejected request changes
// nothing. Then the whole request runs on its device under the device's
// lock, which orders gradient accumulation.
//
// Memory: on host-accessible backends inputs are read in place from the
// request's bytes when 16-byte aligned (else copied once into aligned
// scratch), and returned outputs are written directly into the response's
// inline_data. Outputs of a batch that are not returned live in a
// request-scoped arena, named "<op id>.<field>", which later ops read by
// reference. Backends without host access stage every host tensor in the
// executor's staging memory instead (no device allocation per request) and
// overlap the copies with compute: uploads go ahead of the ops on a copy
// queue, each op waits only for its own inputs, downloads run while later
// ops compute, and one synchronization at the end of the request precedes
// any output becoming visible to the client.
//
// Stream order: a request whose metadata names session events (see
// shm.proto) first makes the device's stream wait for the client's event,
// and records the daemon's event after its work. When every tensor is
// device memory (CUDA regions, the layer's own memory, the batch's staged
// intermediates) it is then answered without waiting for the device: the
// client's stream waits for the event instead, and the next request of the
// device runs after it on the same stream.
//
// Shared memory: tensors in a session's regions (TensorRef.shm, and outputs
// named in output_regions) are held for the whole request by its
// RegionScope. Host backends read and write the mapped bytes in place (a
// misaligned range goes through aligned scratch); device backends run on
// CUDA-region memory directly and copy host regions to and from the device,
// asynchronously when the region is page-locked (see ShmRegistry).
#ifndef MHC_SERVER_OP_RUNNER_H_
#define MHC_SERVER_OP_RUNNER_H_

#include "absl/status/status.h"
#include "google/protobuf/message.h"
#include "mhc/backend.h"
#include "mhc/v1/service.pb.h"
#include "server/layer_store.h"
#include "server/shm/shm_registry.h"
#include "server/tensor_resolver.h"

namespace mhc::server {

class OpRunner {
 public:
  OpRunner(LayerStore* store, RequestLimits limits);

  // `request` and `response` are the op's messages (e.g. PreRequest and
  // PreResponse for kPreForward). `regions` resolves and holds the request's
  // shared-memory tensors.
  absl::Status RunSingle(OpKind kind, const google::protobuf::Message& request,
                         google::protobuf::Message* response,
                         RegionScope* regions);

  absl::Status Execute(const v1::ExecuteRequest& request,
                       v1::ExecuteResponse* response, RegionScope* regions);

 private:
  LayerStore* const store_;
  const RequestLimits limits_;
};

}  // namespace mhc::server

#endif  // MHC_SERVER_OP_RUNNER_H_
