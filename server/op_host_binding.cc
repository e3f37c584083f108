// Host binding: on backends that address host memory the ops read and
// write the request's and response's bytes in place; only misaligned
// tensors go through aligned scratch (op_batch.h).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "convert/spec_convert.h"
#include "mhc/status.h"
#include "server/op_batch.h"

namespace mhc::server::op_batch {
namespace {

constexpr size_t kAlignment = 16;

absl::StatusOr<HostBuffer> AllocateHost(size_t bytes) {
  if (bytes == 0) return HostBuffer();
  constexpr size_t kLine = 64;
  void* p = std::aligned_alloc(kLine, (bytes + kLine - 1) / kLine * kLine);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes of host memory"));
  }
  return HostBuffer(p);
}

bool Aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % kAlignment == 0;
}

}  // namespace

// Sets dest's dtype and shape; a region output is returned as its shm
// reference, without bytes.
void DescribeDest(const PlannedOutput& out) {
  out.dest->set_dtype(DTypeToProto(out.info.dtype));
  out.dest->clear_shape();
  for (int64_t d : out.info.shape) out.dest->add_shape(d);
  if (out.region.has_value()) {
    *out.dest->mutable_shm() = *out.region;
  } else {
    out.dest->mutable_inline_data()->resize(out.info.bytes);
  }
}

// Sets dest's dtype and shape and chooses where the op writes: into dest's
// bytes when the backend can address them, else into scratch.
absl::Status PrepareHostOutput(PlannedOutput& out) {
  if (out.dest != nullptr) DescribeDest(out);
  if (out.region.has_value()) {
    if (out.info.bytes == 0 || Aligned(out.span.data)) {
      out.data = out.span.data;
      return absl::OkStatus();
    }
    out.copy_to_region = true;
  } else if (out.dest != nullptr) {
    std::string* bytes = out.dest->mutable_inline_data();
    if (out.info.bytes == 0 || Aligned(bytes->data())) {
      out.data = bytes->data();
      return absl::OkStatus();
    }
    out.copy_to_dest = true;
  }
  MHC_ASSIGN_OR_RETURN(out.scratch, AllocateHost(out.info.bytes));
  out.data = out.scratch.get();
  return absl::OkStatus();
}

absl::Status PrepareHostInput(PlannedInput& in) {
  if (in.bytes.empty() || Aligned(in.bytes.data())) {
    in.data = in.bytes.data();
    return absl::OkStatus();
  }
  MHC_ASSIGN_OR_RETURN(in.scratch, AllocateHost(in.bytes.size()));
  std::memcpy(in.scratch.get(), in.bytes.data(), in.bytes.size());
  in.data = in.scratch.get();
  return absl::OkStatus();
}

// Host backends: the ops read and write the request's memory in place
// (PrepareHostInput/Output); only misaligned tensors are copied.
absl::Status RunOnHost(Batch& batch, Executor& executor, Backend& backend,
                       Workspace ws) {
  for (const PlannedOp& op : batch.ops) {
    MHC_RETURN_IF_ERROR(LaunchOp(executor, backend, ws, batch, op));
    for (int index : op.outputs) {
      if (index < 0) continue;
      const PlannedOutput& out = *batch.outputs[index];
      if (out.info.bytes == 0) continue;
      if (out.copy_to_region) {
        std::memcpy(out.span.data, out.data, out.info.bytes);
      } else if (out.copy_to_dest) {
        std::memcpy(out.dest->mutable_inline_data()->data(), out.data,
                    out.info.bytes);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace mhc::server::op_batch
