// mhcd --fault_injection: test only. Makes the CUDA backend fail on purpose
// (mhc/cuda.h, InjectCudaFaults) so that tests can see how the daemon
// answers a full device and a lost device context.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "mhc/cuda.h"
#include "mhc/status.h"
#include "server/flags.h"

ABSL_FLAG(std::string, fault_injection, "",
          "TEST ONLY, never in production: make the CUDA backend fail the "
          "Nth device allocation, op launch or host-device copy after the "
          "daemon is ready, given as alloc:N, launch:N, copy:N (comma "
          "separated). A failed allocation answers RESOURCE_EXHAUSTED and "
          "the daemon serves on; a failed launch or copy loses the CUDA "
          "context: health goes NOT_SERVING and mhcd exits with status 3.");

namespace mhc::server {
namespace {

absl::StatusOr<CudaFaultPlan> ParseFaultInjection(absl::string_view text) {
  CudaFaultPlan plan;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    const std::vector<absl::string_view> parts = absl::StrSplit(item, ':');
    int64_t nth = 0;
    int64_t* slot = nullptr;
    if (parts.size() == 2) {
      if (parts[0] == "alloc") slot = &plan.alloc;
      if (parts[0] == "launch") slot = &plan.launch;
      if (parts[0] == "copy") slot = &plan.copy;
    }
    if (slot == nullptr || !absl::SimpleAtoi(parts[1], &nth) || nth < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--fault_injection: expected alloc:N, launch:N or copy:N with N "
          ">= 1, separated by commas; got '",
          item, "'"));
    }
    if (*slot != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--fault_injection: '", parts[0], "' given twice"));
    }
    *slot = nth;
  }
  return plan;
}

}  // namespace

absl::Status CheckFaultInjectionFlag(
    const std::vector<DeviceBackend>& devices) {
  const std::string text = absl::GetFlag(FLAGS_fault_injection);
  if (text.empty()) return absl::OkStatus();
  MHC_RETURN_IF_ERROR(ParseFaultInjection(text).status());
  for (const DeviceBackend& device : devices) {
    if (device.cuda_index < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--fault_injection: only the CUDA backend injects faults, and ",
          device.device, " is not a CUDA device"));
    }
  }
  return absl::OkStatus();
}

std::string FaultInjectionNotice() {
  const std::string text = absl::GetFlag(FLAGS_fault_injection);
  if (text.empty()) return "";
  return absl::StrCat("warning: --fault_injection=", text,
                      " (test only): the CUDA backend will fail on purpose");
}

void ArmFaultInjectionFromFlags() {
#ifdef MHC_HAVE_CUDA
  const absl::StatusOr<CudaFaultPlan> plan =
      ParseFaultInjection(absl::GetFlag(FLAGS_fault_injection));
  if (plan.ok()) InjectCudaFaults(*plan);
#endif
}

}  // namespace mhc::server
