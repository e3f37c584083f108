// The fast multithreaded CPU backend: a Backend over host memory whose ops
// run on a persistent thread pool (see cpu_ops.h for the determinism rules
// every op follows).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "cpu/fast/cpu_ops.h"
#include "cpu/fast/thread_pool.h"
#include "mhc/backend.h"

namespace mhc {
namespace cpu {
namespace {

constexpr size_t kAlign = 64;

size_t AlignUp(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

bool NeedsHistory(OpKind op) {
  return op == OpKind::kSinkhornBackward || op == OpKind::kPreBackward;
}

bool UsesChannelBlocks(OpKind op) {
  return op == OpKind::kProjectionBackward || op == OpKind::kPreBackward ||
         op == OpKind::kHeadBackward;
}

int64_t SmallFloats(const LayerSpec& spec) {
  const int64_t n = spec.n;
  return 4 * spec.NumLogits() + 6 * n * n + 8 * n + 64;
}

int64_t V2Floats(const LayerSpec& spec) {
  return std::max<int64_t>(spec.n * kBlock,
                           kTokenGroup * spec.n * BackwardChannels(spec));
}

}  // namespace

int64_t BackwardChannels(const LayerSpec& spec) {
  if (!spec.dynamic) return kBlock;
  return std::max<int64_t>(1, 256 / spec.n);
}

WorkspaceLayout ComputeWorkspaceLayout(OpKind op, const LayerSpec& spec,
                                       int64_t tokens) {
  const int64_t n = spec.n;
  const int64_t big_n = spec.NumLogits();
  int64_t floats = 4 * n * kBlock + 4 * kBlock + SmallFloats(spec) +
                   kProjGroup * (kBlock + big_n + 1);
  if (NeedsHistory(op) && spec.kind == LayerKind::kMhc) {
    floats += SinkhornHistoryFloats(spec);
  }
  if (UsesChannelBlocks(op)) {
    floats += 2 * n * kBlock + V2Floats(spec);
    if (spec.dynamic) {
      floats += (2 * big_n + 1) * n * BackwardChannels(spec);
    }
  }
  WorkspaceLayout layout;
  // Slack for aligning each carved array.
  layout.per_thread_bytes =
      AlignUp(static_cast<size_t>(floats) * sizeof(float) + 32 * kAlign);
  int64_t shared_floats = 0;
  if (op == OpKind::kScaleBackward) {
    shared_floats = tokens * (big_n + 3);
  } else if (op == OpKind::kPreBackward || op == OpKind::kHeadBackward) {
    shared_floats = tokens * MakeFusedRecord(spec).stride;
  }
  layout.shared_bytes = static_cast<size_t>(shared_floats) * sizeof(float);
  return layout;
}

ThreadScratch OpContext::Scratch(int thread) const {
  const LayerSpec& sp = *spec;
  const int64_t n = sp.n;
  char* cursor = scratch + per_thread_bytes * static_cast<size_t>(thread);
  auto carve = [&cursor](int64_t count) {
    float* out = reinterpret_cast<float*>(cursor);
    cursor += AlignUp(static_cast<size_t>(count) * sizeof(float));
    return out;
  };
  ThreadScratch s{};
  s.xs = carve(n * kBlock);
  s.xs2 = carve(n * kBlock);
  s.os = carve(n * kBlock);
  s.tmp = carve(n * kBlock);
  s.a1 = carve(kBlock);
  s.a2 = carve(kBlock);
  s.v = carve(kBlock);
  s.vg = carve(kBlock);
  s.small = carve(SmallFloats(sp));
  s.vgroup = carve(kProjGroup * kBlock);
  s.hgroup = carve(kProjGroup * sp.NumLogits());
  s.msgroup = carve(kProjGroup);
  if (NeedsHistory(op) && sp.kind == LayerKind::kMhc) {
    s.hist = carve(SinkhornHistoryFloats(sp));
  }
  if (UsesChannelBlocks(op)) {
    s.t2 = carve(n * kBlock);
    s.v2 = carve(V2Floats(sp));
    s.u2 = carve(n * kBlock);
    if (sp.dynamic) {
      const int64_t kb = n * BackwardChannels(sp);
      s.acc = carve(sp.NumLogits() * kb);
      s.phi = carve(sp.NumLogits() * kb);
      s.gamma = carve(kb);
    }
  }
  return s;
}

int64_t TokenChunk(const OpContext& ctx, int64_t tokens) {
  const int64_t target_tasks = 8 * static_cast<int64_t>(ctx.pool->threads());
  return std::max<int64_t>(1, (tokens + target_tasks - 1) / target_tasks);
}

namespace {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads) : pool_(threads) {}

  std::string Name() const override { return "cpu"; }
  std::string DeviceDescription() const override {
    return absl::StrCat("cpu (", pool_.threads(), " threads",
                        UsingAvx2() ? ", avx2" : "", ")");
  }
  bool HostAccessible() const override { return true; }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    void* pointer =
        std::aligned_alloc(kAlign, AlignUp(std::max<size_t>(bytes, 1)));
    if (pointer == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cpu: cannot allocate ", bytes, " bytes"));
    }
    return pointer;
  }
  void Free(void* pointer) override { std::free(pointer); }
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Memset(void* dst, int value, size_t bytes) override {
    if (bytes > 0) std::memset(dst, value, bytes);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }

  size_t WorkspaceBytes(OpKind op, const LayerSpec& spec, int64_t tokens,
                        DType) const override {
    return ComputeWorkspaceLayout(op, spec, tokens).total(pool_.threads());
  }

 protected:
  absl::Status RunProjectionForward(const ProjectionForwardParams& p,
                                    Workspace ws) override {
    return Dispatch(OpKind::kProjectionForward, p, ws, &cpu::ProjectionForward);
  }
  absl::Status RunProjectionBackward(const ProjectionBackwardParams& p,
                                     Workspace ws) override {
    return Dispatch(OpKind::kProjectionBackward, p, ws,
                    &cpu::ProjectionBackward);
  }
  absl::Status RunScaleForward(const ScaleForwardParams& p,
                               Workspace ws) override {
    return Dispatch(OpKind::kScaleForward, p, ws, &cpu::ScaleForward);
  }
  absl::Status RunScaleBackward(const ScaleBackwardParams& p,
                                Workspace ws) override {
    return Dispatch(OpKind::kScaleBackward, p, ws, &cpu::ScaleBackward);
  }
  absl::Status RunSinkhornForward(const SinkhornForwardParams& p,
                                  Workspace ws) override {
    return Dispatch(OpKind::kSinkhornForward, p, ws, &cpu::SinkhornForward);
  }
  absl::Status RunSinkhornBackward(const SinkhornBackwardParams& p,
                                   Workspace ws) override {
    return Dispatch(OpKind::kSinkhornBackward, p, ws, &cpu::SinkhornBackward);
  }
  absl::Status RunAggregateForward(const AggregateForwardParams& p,
                                   Workspace ws) override {
    return Dispatch(OpKind::kAggregateForward, p, ws, &cpu::AggregateForward);
  }
  absl::Status RunAggregateBackward(const AggregateBackwardParams& p,
                                    Workspace ws) override {
    return Dispatch(OpKind::kAggregateBackward, p, ws, &cpu::AggregateBackward);
  }
  absl::Status RunPostForward(const PostForwardParams& p,
                              Workspace ws) override {
    return Dispatch(OpKind::kPostForward, p, ws, &cpu::PostForward);
  }
  absl::Status RunPostBackward(const PostBackwardParams& p,
                               Workspace ws) override {
    return Dispatch(OpKind::kPostBackward, p, ws, &cpu::PostBackward);
  }
  absl::Status RunExpandForward(const ExpandForwardParams& p,
                                Workspace ws) override {
    return Dispatch(OpKind::kExpandForward, p, ws, &cpu::ExpandForward);
  }
  absl::Status RunExpandBackward(const ExpandBackwardParams& p,
                                 Workspace ws) override {
    return Dispatch(OpKind::kExpandBackward, p, ws, &cpu::ExpandBackward);
  }
  absl::Status RunPreForward(const PreForwardParams& p, Workspace ws) override {
    return Dispatch(OpKind::kPreForward, p, ws, &cpu::PreForward);
  }
  absl::Status RunPreBackward(const PreBackwardParams& p,
                              Workspace ws) override {
    return Dispatch(OpKind::kPreBackward, p, ws, &cpu::PreBackward);
  }
  absl::Status RunHeadForward(const HeadForwardParams& p,
                              Workspace ws) override {
    return Dispatch(OpKind::kHeadForward, p, ws, &cpu::HeadForward);
  }
  absl::Status RunHeadBackward(const HeadBackwardParams& p,
                               Workspace ws) override {
    return Dispatch(OpKind::kHeadBackward, p, ws, &cpu::HeadBackward);
  }
  absl::Status RunOptimizerStep(const OptimizerStepParams& p,
                                Workspace ws) override {
    if (reinterpret_cast<uintptr_t>(ws.data) % alignof(double) != 0) {
      return absl::InvalidArgumentError("cpu: workspace is not aligned");
    }
    return cpu::OptimizerStep(pool_, p, ws);
  }

 private:
  // Checks the workspace and carves it; the op then runs on the pool.
  template <typename Params>
  absl::Status Dispatch(OpKind op, const Params& p, Workspace ws,
                        absl::Status (*fn)(const OpContext&, const Params&)) {
    const WorkspaceLayout layout =
        ComputeWorkspaceLayout(op, *p.spec, p.tokens);
    const size_t needed = layout.total(pool_.threads());
    if (ws.bytes < needed || (needed > 0 && ws.data == nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat(
          OpFamilyName(op), " ", OpDirectionName(op), ": workspace of ",
          ws.bytes, " bytes, needs ", needed, " (WorkspaceBytes)"));
    }
    if (reinterpret_cast<uintptr_t>(ws.data) % alignof(float) != 0) {
      return absl::InvalidArgumentError("cpu: workspace is not aligned");
    }
    OpContext ctx;
    ctx.pool = &pool_;
    ctx.scratch = static_cast<char*>(ws.data);
    ctx.per_thread_bytes = layout.per_thread_bytes;
    ctx.shared = ctx.scratch +
                 layout.per_thread_bytes * static_cast<size_t>(pool_.threads());
    ctx.spec = p.spec;
    ctx.op = op;
    return fn(ctx, p);
  }

  ThreadPool pool_;
};

}  // namespace
}  // namespace cpu

std::unique_ptr<Backend> MakeCpuBackend(int threads) {
  return std::make_unique<cpu::CpuBackend>(threads);
}

}  // namespace mhc
