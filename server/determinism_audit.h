// The determinism audit (docs/SPEC.md section 6 checked in production). A
// sampled launch is run again on the device, right after it, on the same inputs
// into scratch outputs, and the outputs are compared bit for bit ("replay");
// a sampled launch of several tokens has one token re-run alone and compared
// with its slice of the batched outputs ("batch_invariance"). Re-runs never
// add to parameter gradients (they run as if skip_parameter_gradients were
// set) and only per-token outputs are compared. Results go to the metrics
// and to GetDeterminismReport. With both rates at 0 the audit is inactive
// and the op runner does no extra work.
#ifndef MHC_SERVER_DETERMINISM_AUDIT_H_
#define MHC_SERVER_DETERMINISM_AUDIT_H_

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "mhc/backend.h"
#include "mhc/types.h"
#include "mhc/v1/service.pb.h"
#include "server/metrics.h"
#include "server/op_defs.h"

namespace mhc::server {

// Largest distance between two arrays of `dtype` values in units in the last
// place (ordered bit patterns; +0 and -0 are 0 apart), and the first element
// whose bits differ (-1 when none).
struct UlpDiff {
  uint64_t max_ulp = 0;
  int64_t first_differing = -1;
};
UlpDiff CompareBits(DType dtype, const void* a, const void* b,
                    int64_t elements);

// One launch as the op runner made it.
struct AuditedLaunch {
  struct Output {
    std::string name;  // response field
    DType dtype = DType::kF32;
    uint64_t bytes = 0;  // the whole output; 0 when it does not take part
  };
  OpKind kind = OpKind::kPreForward;
  LaunchFn launch = nullptr;
  const BoundOp* bound = nullptr;     // pointers as launched
  std::vector<uint64_t> input_bytes;  // by input slot; 0 when absent
  std::vector<Output> outputs;        // by output slot
  std::string layer;                  // "layer 'l1' (STREAM_MAJOR)"
};

class DeterminismAudit {
 public:
  // Rates are fractions of launches in [0, 1].
  DeterminismAudit(double replay_rate, double batch_invariance_rate,
                   Metrics* metrics);

  bool active() const { return replay_rate_ > 0 || batch_rate_ > 0; }

  // Samples and audits `launch`, which just succeeded. Runs on the device
  // (inside Executor::Run) with its workspace. A re-run that cannot be made
  // (no memory, too little workspace for one token) is skipped: the audit
  // never fails the client's request.
  void MaybeAudit(Backend& backend, Workspace ws, const AuditedLaunch& launch);

  void FillReport(v1::GetDeterminismReportResponse* report) const;

 private:
  struct Stats {
    uint64_t matches = 0;
    uint64_t mismatches = 0;
    uint64_t max_ulp = 0;
  };

  bool Sample(double rate);
  // Re-runs `launch` on `tokens` tokens starting at `first` into scratch and
  // compares with the same slice of the original outputs.
  void Check(Backend& backend, Workspace ws, const AuditedLaunch& launch,
             absl::string_view check, int64_t first, int64_t tokens);
  void Record(const AuditedLaunch& launch, absl::string_view check,
              const v1::DeterminismMismatch* mismatch, uint64_t max_ulp);

  const double replay_rate_;
  const double batch_rate_;
  Metrics* const metrics_;
  mutable absl::Mutex mu_;
  absl::BitGen rng_ ABSL_GUARDED_BY(mu_);
  // Keyed by (op kind, check) so the report comes out in a stable order.
  std::map<std::tuple<int, std::string>, Stats> stats_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::DeterminismMismatch> recent_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mhc::server

#endif  // MHC_SERVER_DETERMINISM_AUDIT_H_
