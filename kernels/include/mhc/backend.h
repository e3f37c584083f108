// The Backend interface: every mHC operator, forward and backward, on one
// device. The server talks to kernels only through this class.
//
// Contract shared by all backends:
// - Public entry points validate their params (kernels/common/backend.cc:
//   spec, token count, required pointers) and then call the backend's Run*
//   implementation; implementations may assume valid params.
// - All pointers address this backend's memory (HostAccessible() says whether
//   that is host memory). Outputs are overwritten; LayerGrads are added to.
// - One Backend instance is driven by one caller at a time (the server's
//   per-device executor serialises requests); backends may use many threads
//   or streams internally.
// - Results are bitwise deterministic and batch invariant as each op header
//   states; no result depends on the number of threads.
#ifndef MHC_BACKEND_H_
#define MHC_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "mhc/ops/aggregate.h"
#include "mhc/ops/expand.h"
#include "mhc/ops/fused.h"
#include "mhc/ops/optimizer.h"
#include "mhc/ops/post.h"
#include "mhc/ops/projection.h"
#include "mhc/ops/scale.h"
#include "mhc/ops/sinkhorn.h"
#include "mhc/ops/weights.h"
#include "mhc/types.h"

namespace mhc {

// Every operator the backends run, one value per direction.
enum class OpKind : uint8_t {
  kProjectionForward,
  kProjectionBackward,
  kScaleForward,
  kScaleBackward,
  kSinkhornForward,
  kSinkhornBackward,
  kAggregateForward,
  kAggregateBackward,
  kPostForward,
  kPostBackward,
  kExpandForward,
  kExpandBackward,
  kPreForward,
  kPreBackward,
  kHeadForward,
  kHeadBackward,
};
inline constexpr int kNumOpKinds = 16;

// "projection", "scale", ... (the op family) and "forward" / "backward".
absl::string_view OpFamilyName(OpKind op);
absl::string_view OpDirectionName(OpKind op);

// Device time of the work a backend issues between Start and Stop (CUDA
// events on a GPU stream). Measurements finish in the order they were
// stopped, and reading them never waits for the device, so timing every
// launch adds no host synchronization. Used by one caller at a time.
class DeviceTimer {
 public:
  virtual ~DeviceTimer() = default;
  virtual void Start() = 0;
  // Ends the measurement begun by Start; Poll returns its seconds once the
  // device has done the work.
  virtual absl::Status Stop() = 0;
  // Seconds of the oldest stopped measurement not yet returned, or nullopt
  // while the device still runs it (or none is pending).
  virtual absl::StatusOr<std::optional<double>> Poll() = 0;
};

// An event of the device's own kind (cudaEvent_t on CUDA), created or opened
// by the caller; backends only wait for and record it on their stream.
using DeviceEvent = void*;

// Names one CopyToDeviceAsync of a backend; tickets grow in queue order.
using CopyTicket = int64_t;
// The ticket of a copy that needs no waiting for (nothing was copied).
inline constexpr CopyTicket kNoCopy = -1;

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string Name() const = 0;  // "reference", "cpu", "cuda"
  // Human-readable device, e.g. "cpu (2 threads)" or "NVIDIA H200 (0)".
  virtual std::string DeviceDescription() const = 0;
  // True when op pointers are plain host memory (CPU backends).
  virtual bool HostAccessible() const = 0;

  // Memory in this backend's address space (device memory on GPUs). Never
  // called on a request's hot path by the server, except through workspace
  // growth which is amortised.
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  virtual void Free(void* pointer) = 0;
  virtual absl::Status CopyToDevice(void* dst, const void* host_src,
                                    size_t bytes) = 0;
  virtual absl::Status CopyToHost(void* host_dst, const void* src,
                                  size_t bytes) = 0;
  virtual absl::Status Memset(void* dst, int value, size_t bytes) = 0;
  // Waits until all work issued so far, copies included, is complete.
  virtual absl::Status Synchronize() = 0;

  // Copies that overlap compute. The copies above run in order with the
  // ops and return when done; these are queued beside the ops, so that a
  // request's transfers run while its other ops compute. They return as soon
  // as the copy is queued when the host memory is page-locked; with pageable
  // memory a copy to the device returns once the driver has staged the
  // bytes, and a copy to the host only when it is done. The host memory must
  // stay valid, and the host must not touch it, until Synchronize() returns.
  // The defaults copy synchronously, which keeps the same contract for
  // backends that have nothing to overlap.
  //
  // Queues a copy of host memory into `dst` and returns its ticket, or
  // kNoCopy for 0 bytes. Ops do not wait for it until OpsWaitForCopy.
  virtual absl::StatusOr<CopyTicket> CopyToDeviceAsync(void* dst,
                                                       const void* host_src,
                                                       size_t bytes);
  // Everything issued in order with the ops after this call (ops, Memset,
  // the synchronous copies) starts after the copy `ticket`, and every copy
  // to the device queued before it, has completed.
  virtual absl::Status OpsWaitForCopy(CopyTicket ticket);
  // Queues a copy of `src` into host memory that starts once every op
  // issued so far is complete. Ops issued later must not write `src` before
  // Synchronize().
  virtual absl::Status CopyToHostAsync(void* host_dst, const void* src,
                                       size_t bytes);
  // A timer of this backend's device work, or null when the host clock
  // around a call is exact (backends whose ops return when they are done).
  virtual std::unique_ptr<DeviceTimer> MakeDeviceTimer() { return nullptr; }

  // Stream order with other processes (CUDA IPC events). Work issued after
  // WaitForEvent starts once `event`, as last recorded before the call, has
  // completed; RecordEvent records `event` after all work issued so far,
  // copies included. Backends whose ops finish before they return have
  // nothing to order and refuse both (FAILED_PRECONDITION).
  virtual absl::Status WaitForEvent(DeviceEvent event);
  virtual absl::Status RecordEvent(DeviceEvent event);
  // Queues a write of `value` to the 32-bit word at device address `word`
  // (page-locked host memory mapped for devices, see DeviceIpc) that runs
  // after all work issued so far, copies included, like RecordEvent. Another
  // process's stream can wait for it without an event. Refused like
  // RecordEvent by backends whose ops finish before they return.
  virtual absl::Status WriteWordAfterWork(void* word, uint32_t value);
  // Whether work issued earlier failed on the device, without waiting for
  // it: OK while it runs or succeeded. An error here is sticky on CUDA
  // (the context is lost) and fails every later request of the device.
  virtual absl::Status CheckDevice() { return absl::OkStatus(); }
  // What another process on this node opens to use the memory at
  // `pointer` (inside an allocation of Allocate): the handle of the whole
  // device allocation holding it (a 64-byte cudaIpcMemHandle_t on CUDA),
  // and where `pointer` lies in it. The driver may place several small
  // allocations in one, so the offset need not be 0. Host backends have
  // none (UNIMPLEMENTED).
  struct ExportedMemory {
    std::string handle;
    uint64_t offset = 0;  // of `pointer` from the allocation's start
    uint64_t bytes = 0;   // the allocation's size
  };
  virtual absl::StatusOr<ExportedMemory> ExportMemory(void* pointer);

  // Scratch bytes `op` needs for this spec, token count and dtype.
  virtual size_t WorkspaceBytes(OpKind op, const LayerSpec& spec,
                                int64_t tokens, DType act_dtype) const = 0;

  // The kernel variant a launch with these params takes: a name from a
  // small fixed set per op (docs/kernels.md), the `variant` label of the
  // kernel metrics; kDefaultVariant where the backend has one kernel.
  static constexpr absl::string_view kDefaultVariant = "default";
  virtual absl::string_view KernelVariant(
      const ProjectionForwardParams& p) const;
  virtual absl::string_view KernelVariant(
      const ProjectionBackwardParams& p) const;
  virtual absl::string_view KernelVariant(const ScaleForwardParams& p) const;
  virtual absl::string_view KernelVariant(const ScaleBackwardParams& p) const;
  virtual absl::string_view KernelVariant(const SinkhornForwardParams& p) const;
  virtual absl::string_view KernelVariant(
      const SinkhornBackwardParams& p) const;
  virtual absl::string_view KernelVariant(
      const AggregateForwardParams& p) const;
  virtual absl::string_view KernelVariant(
      const AggregateBackwardParams& p) const;
  virtual absl::string_view KernelVariant(const PostForwardParams& p) const;
  virtual absl::string_view KernelVariant(const PostBackwardParams& p) const;
  virtual absl::string_view KernelVariant(const ExpandForwardParams& p) const;
  virtual absl::string_view KernelVariant(const ExpandBackwardParams& p) const;
  virtual absl::string_view KernelVariant(const PreForwardParams& p) const;
  virtual absl::string_view KernelVariant(const PreBackwardParams& p) const;
  virtual absl::string_view KernelVariant(const HeadForwardParams& p) const;
  virtual absl::string_view KernelVariant(const HeadBackwardParams& p) const;

  absl::Status ProjectionForward(const ProjectionForwardParams& p,
                                 Workspace ws);
  absl::Status ProjectionBackward(const ProjectionBackwardParams& p,
                                  Workspace ws);
  absl::Status ScaleForward(const ScaleForwardParams& p, Workspace ws);
  absl::Status ScaleBackward(const ScaleBackwardParams& p, Workspace ws);
  absl::Status SinkhornForward(const SinkhornForwardParams& p, Workspace ws);
  absl::Status SinkhornBackward(const SinkhornBackwardParams& p, Workspace ws);
  absl::Status AggregateForward(const AggregateForwardParams& p, Workspace ws);
  absl::Status AggregateBackward(const AggregateBackwardParams& p,
                                 Workspace ws);
  absl::Status PostForward(const PostForwardParams& p, Workspace ws);
  absl::Status PostBackward(const PostBackwardParams& p, Workspace ws);
  absl::Status ExpandForward(const ExpandForwardParams& p, Workspace ws);
  absl::Status ExpandBackward(const ExpandBackwardParams& p, Workspace ws);
  absl::Status PreForward(const PreForwardParams& p, Workspace ws);
  absl::Status PreBackward(const PreBackwardParams& p, Workspace ws);
  absl::Status HeadForward(const HeadForwardParams& p, Workspace ws);
  absl::Status HeadBackward(const HeadBackwardParams& p, Workspace ws);

  // Scratch bytes OptimizerStep needs for `p`: the clip scale and the norm
  // partials when it computes the norm, else 0. The same on every backend.
  size_t OptimizerWorkspaceBytes(const OptimizerStepParams& p) const;
  // Updates every block of `p` in place (mhc/ops/optimizer.h). The clip
  // scale is computed and applied on the device: no host synchronization.
  absl::Status OptimizerStep(const OptimizerStepParams& p, Workspace ws);

 protected:
  virtual absl::Status RunProjectionForward(const ProjectionForwardParams& p,
                                            Workspace ws) = 0;
  virtual absl::Status RunProjectionBackward(const ProjectionBackwardParams& p,
                                             Workspace ws) = 0;
  virtual absl::Status RunScaleForward(const ScaleForwardParams& p,
                                       Workspace ws) = 0;
  virtual absl::Status RunScaleBackward(const ScaleBackwardParams& p,
                                        Workspace ws) = 0;
  virtual absl::Status RunSinkhornForward(const SinkhornForwardParams& p,
                                          Workspace ws) = 0;
  virtual absl::Status RunSinkhornBackward(const SinkhornBackwardParams& p,
                                           Workspace ws) = 0;
  virtual absl::Status RunAggregateForward(const AggregateForwardParams& p,
                                           Workspace ws) = 0;
  virtual absl::Status RunAggregateBackward(const AggregateBackwardParams& p,
                                            Workspace ws) = 0;
  virtual absl::Status RunPostForward(const PostForwardParams& p,
                                      Workspace ws) = 0;
  virtual absl::Status RunPostBackward(const PostBackwardParams& p,
                                       Workspace ws) = 0;
  virtual absl::Status RunExpandForward(const ExpandForwardParams& p,
                                        Workspace ws) = 0;
  virtual absl::Status RunExpandBackward(const ExpandBackwardParams& p,
                                         Workspace ws) = 0;
  virtual absl::Status RunPreForward(const PreForwardParams& p,
                                     Workspace ws) = 0;
  virtual absl::Status RunPreBackward(const PreBackwardParams& p,
                                      Workspace ws) = 0;
  virtual absl::Status RunHeadForward(const HeadForwardParams& p,
                                      Workspace ws) = 0;
  virtual absl::Status RunHeadBackward(const HeadBackwardParams& p,
                                       Workspace ws) = 0;
  virtual absl::Status RunOptimizerStep(const OptimizerStepParams& p,
                                        Workspace ws) = 0;
};

// The float64 plain-loop oracle (kernels/cpu/reference). Single threaded.
std::unique_ptr<Backend> MakeReferenceBackend();
// The fast multithreaded CPU backend; threads <= 0 means all cores.
std::unique_ptr<Backend> MakeCpuBackend(int threads);

}  // namespace mhc

#endif  // MHC_BACKEND_H_
