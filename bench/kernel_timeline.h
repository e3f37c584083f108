// What the GPU ran, kernel by kernel, with CUPTI's activity records: each
// kernel, memset and memcpy between Begin and End, with its start and end
// on the GPU's clock. The GPU benchmark's --timeline prints one run of an
// op this way, so that the gaps and overlaps between an op's kernels (what
// programmatic launches hide, what a kernel's tail costs the next) are
// measured where the events see only the sum.
#ifndef MHC_BENCH_KERNEL_TIMELINE_H_
#define MHC_BENCH_KERNEL_TIMELINE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace mhc::bench {

struct GpuSpan {
  std::string name;  // the kernel's demangled name, or "memset" / "memcpy"
  uint64_t start_ns = 0, end_ns = 0;
};

// One recording at a time per process (CUPTI's activity buffers are
// global). Begin enables the records; End waits for the device, collects
// them and returns the spans in start order.
class KernelTimeline {
 public:
  KernelTimeline() = default;
  KernelTimeline(const KernelTimeline&) = delete;
  KernelTimeline& operator=(const KernelTimeline&) = delete;
  ~KernelTimeline();

  absl::Status Begin();
  absl::StatusOr<std::vector<GpuSpan>> End();

 private:
  bool recording_ = false;
};

// The spans as lines of text: start and duration from the first span, the
// gap since the previous span's end (negative: they overlapped), the name
// cut to `name_chars` without its template arguments and parameters.
std::string FormatTimeline(const std::vector<GpuSpan>& spans,
                           int name_chars = 60);

}  // namespace mhc::bench

#endif  // MHC_BENCH_KERNEL_TIMELINE_H_
