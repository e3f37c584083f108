#include "bench/kernel_timeline.h"

#include <cuda_runtime.h>
#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"

namespace mhc::bench {
namespace {

constexpr size_t kBufferBytes = size_t{8} << 20;
constexpr size_t kBufferAlign = 8;  // what CUPTI asks of its buffers

const CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                     CUPTI_ACTIVITY_KIND_MEMSET,
                                     CUPTI_ACTIVITY_KIND_MEMCPY};

// CUPTI hands completed buffers to a callback of its own: the spans of the
// recording under way, if any.
std::mutex g_mutex;
std::vector<GpuSpan>* g_spans = nullptr;

std::string Demangled(const char* name) {
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> out(
      abi::__cxa_demangle(name, nullptr, nullptr, &status), &std::free);
  return status == 0 && out != nullptr ? std::string(out.get())
                                       : std::string(name);
}

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size,
                              size_t* max_records) {
  *buffer =
      static_cast<uint8_t*>(std::aligned_alloc(kBufferAlign, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t,
                              size_t valid) {
  std::lock_guard<std::mutex> lock(g_mutex);
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (g_spans == nullptr) continue;
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        g_spans->push_back({Demangled(k->name), k->start, k->end});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
        g_spans->push_back({"memset", m->start, m->end});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        g_spans->push_back({"memcpy", m->start, m->end});
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
}

absl::Status Checked(CUptiResult result, const char* what) {
  if (result == CUPTI_SUCCESS) return absl::OkStatus();
  const char* text = nullptr;
  cuptiGetResultString(result, &text);
  return absl::InternalError(
      absl::StrCat("CUPTI ", what, ": ", text != nullptr ? text : "?"));
}

// "void ns::(anonymous namespace)::kernel<...>(args)" -> "kernel".
std::string ShortName(const std::string& name) {
  std::string s = absl::StrReplaceAll(name, {{"(anonymous namespace)::", ""}});
  if (s.rfind("void ", 0) == 0) s.erase(0, 5);
  s = s.substr(0, s.find_first_of("<("));
  const size_t scope = s.rfind("::");
  return scope == std::string::npos ? s : s.substr(scope + 2);
}

}  // namespace

KernelTimeline::~KernelTimeline() {
  if (recording_) (void)End();
}

absl::Status KernelTimeline::Begin() {
  if (recording_) return absl::FailedPreconditionError("timeline: recording");
  static const CUptiResult registered =
      cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted);
  if (absl::Status st = Checked(registered, "register callbacks"); !st.ok()) {
    return st;
  }
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_spans != nullptr) {
      return absl::FailedPreconditionError("timeline: another is recording");
    }
    g_spans = new std::vector<GpuSpan>();
  }
  recording_ = true;
  for (CUpti_ActivityKind kind : kKinds) {
    if (absl::Status st = Checked(cuptiActivityEnable(kind), "enable");
        !st.ok()) {
      (void)End();  // the kinds enabled so far, and the spans, released
      return st;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<GpuSpan>> KernelTimeline::End() {
  if (!recording_) return absl::FailedPreconditionError("timeline: not begun");
  recording_ = false;
  const cudaError_t synced = cudaDeviceSynchronize();
  absl::Status st = Checked(cuptiActivityFlushAll(0), "flush");
  for (CUpti_ActivityKind kind : kKinds) {
    const absl::Status off = Checked(cuptiActivityDisable(kind), "disable");
    if (st.ok()) st = off;
  }
  std::unique_ptr<std::vector<GpuSpan>> spans;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    spans.reset(g_spans);
    g_spans = nullptr;
  }
  if (synced != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("timeline: ", cudaGetErrorString(synced)));
  }
  if (!st.ok()) return st;
  std::sort(spans->begin(), spans->end(),
            [](const GpuSpan& a, const GpuSpan& b) {
              return a.start_ns < b.start_ns;
            });
  return std::move(*spans);
}

std::string FormatTimeline(const std::vector<GpuSpan>& spans, int name_chars) {
  if (spans.empty()) return "  (nothing ran)\n";
  std::string out = "  start us   dur us   gap us  name\n";
  const uint64_t t0 = spans.front().start_ns;
  uint64_t prev_end = t0, last_end = t0, busy = 0;
  for (const GpuSpan& s : spans) {
    const double gap =
        (static_cast<double>(s.start_ns) - static_cast<double>(prev_end)) *
        1e-3;
    absl::StrAppendFormat(&out, "  %8.2f %8.2f %8.2f  %s\n",
                          (s.start_ns - t0) * 1e-3,
                          (s.end_ns - s.start_ns) * 1e-3, gap,
                          ShortName(s.name).substr(0, name_chars));
    prev_end = s.end_ns;
    last_end = std::max(last_end, s.end_ns);
    busy += s.end_ns - s.start_ns;
  }
  absl::StrAppendFormat(
      &out, "  first start to last end %.2f us, spans' sum %.2f us\n",
      (last_end - t0) * 1e-3, busy * 1e-3);
  return out;
}

}  // namespace mhc::bench
