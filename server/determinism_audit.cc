#include "server/determinism_audit.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/random/distributions.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/log.h"

namespace mhc::server {

namespace {

constexpr char kReplay[] = "replay";
constexpr char kBatchInvariance[] = "batch_invariance";
constexpr size_t kRecentMismatches = 16;

// Sign-magnitude bits of a `width`-bit float as a signed integer, so that
// adjacent floats are 1 apart across zero.
template <typename Bits>
int64_t Ordered(Bits bits) {
  constexpr Bits kSign = Bits{1} << (sizeof(Bits) * 8 - 1);
  const int64_t magnitude = static_cast<int64_t>(bits & (kSign - 1));
  return (bits & kSign) != 0 ? -magnitude : magnitude;
}

template <typename Bits>
UlpDiff CompareTyped(const void* a, const void* b, int64_t elements) {
  UlpDiff diff;
  const char* pa = static_cast<const char*>(a);
  const char* pb = static_cast<const char*>(b);
  for (int64_t i = 0; i < elements; ++i) {
    Bits x, y;
    std::memcpy(&x, pa + i * sizeof(Bits), sizeof(Bits));
    std::memcpy(&y, pb + i * sizeof(Bits), sizeof(Bits));
    if (x == y) continue;
    if (diff.first_differing < 0) diff.first_differing = i;
    const int64_t distance = Ordered(x) - Ordered(y);
    const uint64_t ulp =
        static_cast<uint64_t>(distance < 0 ? -distance : distance);
    if (ulp > diff.max_ulp) diff.max_ulp = ulp;
  }
  return diff;
}

// Scratch memory of one check in the backend's address space.
class Scratch {
 public:
  explicit Scratch(Backend& backend) : backend_(backend) {}
  ~Scratch() {
    for (void* p : buffers_) backend_.Free(p);
  }
  void* Allocate(uint64_t bytes) {
    absl::StatusOr<void*> p = backend_.Allocate(bytes);
    if (!p.ok()) return nullptr;
    buffers_.push_back(*p);
    return *p;
  }

 private:
  Backend& backend_;
  std::vector<void*> buffers_;
};

// Bytes of `bytes` at `p` in backend memory, readable on the host.
const void* HostView(Backend& backend, const void* p, uint64_t bytes,
                     std::string* copy) {
  if (backend.HostAccessible()) return p;
  copy->resize(bytes);
  if (!backend.CopyToHost(copy->data(), p, bytes).ok()) return nullptr;
  return copy->data();
}

}  // namespace

UlpDiff CompareBits(DType dtype, const void* a, const void* b,
                    int64_t elements) {
  if (DTypeSize(dtype) == 4) return CompareTyped<uint32_t>(a, b, elements);
  return CompareTyped<uint16_t>(a, b, elements);
}

DeterminismAudit::DeterminismAudit(double replay_rate,
                                   double batch_invariance_rate,
                                   Metrics* metrics)
    : replay_rate_(replay_rate),
      batch_rate_(batch_invariance_rate),
      metrics_(metrics) {}

bool DeterminismAudit::Sample(double rate) {
  if (rate <= 0) return false;
  if (rate >= 1) return true;
  absl::MutexLock lock(&mu_);
  return absl::Bernoulli(rng_, rate);
}

void DeterminismAudit::MaybeAudit(Backend& backend, Workspace ws,
                                  const AuditedLaunch& launch) {
  const int64_t tokens = launch.bound->tokens;
  if (tokens == 0) return;
  if (Sample(replay_rate_)) {
    Check(backend, ws, launch, kReplay, 0, tokens);
  }
  // One token of a one-token launch is the launch itself.
  if (tokens > 1 && Sample(batch_rate_)) {
    int64_t token = 0;
    {
      absl::MutexLock lock(&mu_);
      token = absl::Uniform<int64_t>(rng_, 0, tokens);
    }
    const BoundOp& bound = *launch.bound;
    if (backend.WorkspaceBytes(launch.kind, *bound.spec, 1, bound.act_dtype) <=
        ws.bytes) {
      Check(backend, ws, launch, kBatchInvariance, token, 1);
    }
  }
}

void DeterminismAudit::Check(Backend& backend, Workspace ws,
                             const AuditedLaunch& launch,
                             absl::string_view check, int64_t first,
                             int64_t tokens) {
  const BoundOp& bound = *launch.bound;
  const int64_t total = bound.tokens;
  BoundOp rerun = bound;
  rerun.tokens = tokens;
  rerun.grads = LayerGrads{};
  for (size_t i = 0; i < rerun.in.size(); ++i) {
    if (rerun.in[i] == nullptr) continue;
    const uint64_t per_token = launch.input_bytes[i] / total;
    rerun.in[i] = static_cast<const char*>(bound.in[i]) + first * per_token;
  }
  Scratch scratch(backend);
  for (size_t j = 0; j < rerun.out.size(); ++j) {
    if (bound.out[j] == nullptr) continue;
    const uint64_t bytes = launch.outputs[j].bytes / total * tokens;
    if (bytes == 0) continue;
    rerun.out[j] = scratch.Allocate(bytes);
    if (rerun.out[j] == nullptr) return;
  }
  if (!launch.launch(backend, rerun, ws).ok()) return;
  if (!backend.Synchronize().ok()) return;

  uint64_t max_ulp = 0;
  v1::DeterminismMismatch mismatch;
  bool matched = true;
  for (size_t j = 0; j < rerun.out.size(); ++j) {
    if (bound.out[j] == nullptr) continue;
    const AuditedLaunch::Output& out = launch.outputs[j];
    const uint64_t per_token = out.bytes / total;
    const uint64_t bytes = per_token * tokens;
    if (bytes == 0) continue;
    std::string original_copy, rerun_copy;
    const void* original = HostView(
        backend, static_cast<const char*>(bound.out[j]) + first * per_token,
        bytes, &original_copy);
    const void* again = HostView(backend, rerun.out[j], bytes, &rerun_copy);
    if (original == nullptr || again == nullptr) return;
    if (std::memcmp(original, again, bytes) == 0) continue;
    const int64_t elements = static_cast<int64_t>(bytes / DTypeSize(out.dtype));
    const UlpDiff diff = CompareBits(out.dtype, original, again, elements);
    if (matched) {
      mismatch.set_output(out.name);
      mismatch.set_dtype(std::string(DTypeName(out.dtype)));
      const int64_t per_token_elements =
          static_cast<int64_t>(per_token / DTypeSize(out.dtype));
      mismatch.set_element(first * per_token_elements + diff.first_differing);
    }
    matched = false;
    if (diff.max_ulp > max_ulp) max_ulp = diff.max_ulp;
  }
  if (matched) {
    Record(launch, check, nullptr, 0);
    return;
  }
  mismatch.set_op(std::string(OpFamilyName(launch.kind)));
  mismatch.set_direction(std::string(OpDirectionName(launch.kind)));
  mismatch.set_check(std::string(check));
  mismatch.set_layer(launch.layer);
  mismatch.set_tokens(total);
  mismatch.set_ulp_difference(max_ulp);
  mismatch.set_time_unix_nanos(absl::ToUnixNanos(absl::Now()));
  // Operators need to see this without a dashboard: it breaks the contract.
  Log(LogLevel::kError,
      absl::StrCat("determinism mismatch (", check, "): ", mismatch.op(), " ",
                   mismatch.direction(), " on ", launch.layer, ", ", total,
                   " tokens, output ", mismatch.output(), " element ",
                   mismatch.element(), ", up to ", max_ulp, " ulp"));
  Record(launch, check, &mismatch, max_ulp);
}

void DeterminismAudit::Record(const AuditedLaunch& launch,
                              absl::string_view check,
                              const v1::DeterminismMismatch* mismatch,
                              uint64_t max_ulp) {
  if (metrics_ != nullptr) {
    metrics_->RecordDeterminismCheck(launch.kind, check, mismatch == nullptr,
                                     max_ulp);
  }
  absl::MutexLock lock(&mu_);
  Stats& stats = stats_[{static_cast<int>(launch.kind), std::string(check)}];
  if (mismatch == nullptr) {
    ++stats.matches;
    return;
  }
  ++stats.mismatches;
  if (max_ulp > stats.max_ulp) stats.max_ulp = max_ulp;
  recent_.push_back(*mismatch);
  if (recent_.size() > kRecentMismatches) recent_.pop_front();
}

void DeterminismAudit::FillReport(
    v1::GetDeterminismReportResponse* report) const {
  report->set_determinism_audit_rate(replay_rate_);
  report->set_batch_invariance_audit_rate(batch_rate_);
  absl::MutexLock lock(&mu_);
  for (const auto& [key, stats] : stats_) {
    const OpKind kind = static_cast<OpKind>(std::get<0>(key));
    v1::DeterminismCheckStats* out = report->add_checks();
    out->set_op(std::string(OpFamilyName(kind)));
    out->set_direction(std::string(OpDirectionName(kind)));
    out->set_check(std::get<1>(key));
    out->set_matches(stats.matches);
    out->set_mismatches(stats.mismatches);
    out->set_max_ulp_difference(stats.max_ulp);
  }
  for (const v1::DeterminismMismatch& mismatch : recent_) {
    *report->add_recent_mismatches() = mismatch;
  }
}

}  // namespace mhc::server
