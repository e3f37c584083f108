#include "server/flags.h"

#include <climits>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "mhc/status.h"
#include "server/log.h"
#ifdef MHC_HAVE_CUDA
#include "mhc/cuda.h"
#endif

#ifndef MHC_VERSION
#define MHC_VERSION "0.0.0"
#endif

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "Comma-separated gRPC listen addresses: host:port (port 0 picks a "
          "free port) and unix:/path sockets.");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "host:port of the Prometheus endpoint (/metrics); port 0 picks a "
          "free port; empty disables it.");
ABSL_FLAG(std::string, backend, "auto",
          "Compute backend: cpu (fast multithreaded CPU), reference (float64 "
          "oracle, slow), cuda, or auto (cuda when built with CUDA and a GPU "
          "is present, else cpu).");
ABSL_FLAG(int, threads, 0, "Threads of the cpu backend; 0 uses all cores.");
ABSL_FLAG(std::string, nccl_library, "libnccl.so.2",
          "NCCL shared library for data-parallel groups (a name the dynamic "
          "loader finds, or a path); loaded when the daemon serves CUDA "
          "devices. Without it groups are refused and all else works.");
ABSL_FLAG(absl::Duration, group_timeout, absl::Seconds(120),
          "Deadline of group requests that give no timeout_seconds: forming "
          "a group, and each collective. A member that is gone shows up as "
          "this timeout.");
ABSL_FLAG(std::string, devices, "",
          "CUDA devices to serve, comma-separated indices (e.g. 0,1), each "
          "with its own executor and stream; empty serves every visible GPU. "
          "Used by --backend=cuda and by auto when it picks cuda.");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{1} << 30,
          "Largest gRPC message accepted or sent, in bytes (at most "
          "2147483647).");
ABSL_FLAG(int64_t, max_tensor_bytes, int64_t{1} << 30,
          "Largest single inline tensor of a request (input or output), in "
          "bytes; larger gets RESOURCE_EXHAUSTED. Tensors in shared-memory "
          "regions are bounded by their regions.");
ABSL_FLAG(int64_t, max_request_bytes, int64_t{1} << 30,
          "Largest total of the inline tensors (inputs and outputs) of one "
          "request or Execute batch, in bytes; larger gets "
          "RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, max_parameter_bytes, 0,
          "Device memory all layers together may hold for their parameters "
          "and gradient accumulators, in bytes; a CreateLayer beyond it gets "
          "RESOURCE_EXHAUSTED. 0: no limit but the devices' memory.");
ABSL_FLAG(int, max_inflight, 64,
          "Requests handled at once; beyond it a request gets "
          "RESOURCE_EXHAUSTED at once instead of queueing.");
ABSL_FLAG(int, max_batch_ops, 256, "Most ops in one Execute batch.");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(30),
          "On SIGTERM/SIGINT: how long in-flight requests get to finish "
          "before they are cancelled (e.g. 30s, 500ms).");
ABSL_FLAG(double, determinism_audit_rate, 0.0,
          "Fraction (0..1) of kernel launches re-run on the same inputs and "
          "compared bit for bit; results in the metrics and "
          "GetDeterminismReport. Each audited launch costs a second launch.");
ABSL_FLAG(double, batch_invariance_audit_rate, 0.0,
          "Fraction (0..1) of kernel launches of several tokens of which one "
          "token is re-run alone and compared with the batched result.");
ABSL_FLAG(bool, allow_shm, false,
          "Accept shared-memory tensors (POSIX shm, CUDA IPC) from clients "
          "on this node: sessions (OpenSession), region registration, and "
          "TensorRef.shm / output_regions in compute requests.");
ABSL_FLAG(bool, shm_allow_tcp, false,
          "Also accept shared memory over TCP listeners (by default only "
          "unix-socket clients may use it). Only for TCP on loopback.");
ABSL_FLAG(std::string, shm_key_prefix, "mhcd_",
          "Shared-memory keys (shm_open names) a client may register must "
          "start with this non-empty prefix of [A-Za-z0-9_.-].");
ABSL_FLAG(int, shm_max_regions_per_session, 64,
          "Most regions one session may hold at once.");
ABSL_FLAG(int64_t, shm_max_bytes_per_session, int64_t{64} << 30,
          "Most bytes the regions of one session may span together.");
ABSL_FLAG(int, shm_max_sessions, 64,
          "Most sessions open at once (each holds a server thread).");
ABSL_FLAG(int, shm_call_ring_spin_us, -1,
          "How long (microseconds, 0..100000) a session's call ring thread "
          "polls for the next request before it sleeps on a futex: polling "
          "answers calls that follow each other closely sooner, at the cost "
          "of a busy core meanwhile. 0: sleep at once. -1: 300 on machines "
          "with at least 8 hardware threads, 50 on smaller ones.");
ABSL_FLAG(bool, shm_pin_host, true,
          "On a daemon serving CUDA devices, page-lock (cudaHostRegister) the "
          "mapping of each system shared-memory region while it is "
          "registered, so that copies between it and the GPU run "
          "asynchronously at full bandwidth, overlapped with compute. When "
          "locking fails the region still works, through slower pageable "
          "copies. false: never lock (pageable copies).");
ABSL_FLAG(std::string, state_dir, "",
          "Directory of named checkpoints (SaveCheckpoint / LoadCheckpoint "
          "write and read <state_dir>/<name>.safetensors); created when "
          "missing. Empty: checkpoints are refused (FAILED_PRECONDITION). "
          "One daemon per directory: leftovers of a crashed save are "
          "removed at start.");
ABSL_FLAG(bool, restore, false,
          "At start, load the newest checkpoint in --state_dir (if any) "
          "before serving; a checkpoint that fails to load stops the start.");
ABSL_FLAG(int64_t, checkpoint_write_bytes_per_second, 0,
          "Throttle of checkpoint writes, so that a save does not starve "
          "other users of the disk; 0: unthrottled.");
ABSL_FLAG(std::string, log_format, "text",
          "Log lines: text (\"mhcd: ...\", for people and scripts) or json "
          "(one object per line with time, level, msg and fields, for log "
          "collectors). Info goes to stdout, warnings and errors to stderr.");
ABSL_FLAG(std::string, log_requests, "failed",
          "Access log lines, with request id, method, status code, seconds "
          "and peer: none, failed (RPCs that did not end OK, as warnings) or "
          "all (also successful ones, as info).");

namespace mhc::server {

namespace {

constexpr char kUsage[] =
    "gRPC kernel server for mHC (Manifold-Constrained "
    "Hyper-Connections).\n"
    "Usage: mhcd [--listen=127.0.0.1:50051,unix:/run/mhcd.sock] "
    "[--backend=auto|cpu|reference|cuda] [flags]\n"
    "Stops gracefully on SIGTERM/SIGINT (see --drain_timeout).";

bool IsMhcdFlagFile(absl::string_view file) {
  return absl::EndsWith(file, "server/flags.cc") ||
         absl::EndsWith(file, "server/security_flags.cc") ||
         absl::EndsWith(file, "server/fault_injection_flags.cc");
}

}  // namespace

void ConfigureFlagUsage() {
  absl::FlagsUsageConfig config;
  config.contains_helpshort_flags = IsMhcdFlagFile;
  config.contains_help_flags = IsMhcdFlagFile;
  config.version_string = [] { return std::string("mhcd " MHC_VERSION "\n"); };
  config.normalize_filename = [](absl::string_view file) {
    size_t pos = file.rfind("server/");
    return std::string(pos == absl::string_view::npos ? file
                                                      : file.substr(pos));
  };
  absl::SetFlagsUsageConfig(config);
  absl::SetProgramUsageMessage(kUsage);
}

bool HandleHelpOrVersion(int argc, char** argv) {
  bool help = false;
  bool version = false;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    help = help || arg == "--help" || arg == "-h" || arg == "--helpshort" ||
           arg == "--helpfull";
    version = version || arg == "--version";
  }
  if (help) {
    std::map<std::string, std::string> lines;
    for (const auto& [name, flag] : absl::GetAllFlags()) {
      if (!IsMhcdFlagFile(flag->Filename())) continue;
      lines[std::string(name)] =
          absl::StrCat("  --", name, "  ", flag->Help(),
                       " (default: ", flag->DefaultValue(), ")\n");
    }
    std::printf("%s\n\nFlags:\n", kUsage);
    for (const auto& [name, line] : lines) std::printf("%s", line.c_str());
  } else if (version) {
    std::printf("mhcd %s\n", MHC_VERSION);
  }
  return help || version;
}

absl::Status ConfigureLoggingFromFlags() {
  MHC_ASSIGN_OR_RETURN(LogFormat format,
                       ParseLogFormat(absl::GetFlag(FLAGS_log_format)));
  SetLogFormat(format);
  return absl::OkStatus();
}

absl::StatusOr<ServerConfig> ConfigFromFlags() {
  ServerConfig config;
  MHC_ASSIGN_OR_RETURN(config.log_requests,
                       ParseRequestLogMode(absl::GetFlag(FLAGS_log_requests)));
  for (absl::string_view part :
       absl::StrSplit(absl::GetFlag(FLAGS_listen), ',', absl::SkipEmpty())) {
    part = absl::StripAsciiWhitespace(part);
    if (!part.empty()) config.listen.emplace_back(part);
  }
  if (config.listen.empty()) {
    return absl::InvalidArgumentError(
        "--listen: expected at least one host:port or unix:/path");
  }
  config.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  for (auto [flag, rate, out] :
       {std::make_tuple("determinism_audit_rate",
                        absl::GetFlag(FLAGS_determinism_audit_rate),
                        &config.determinism_audit_rate),
        std::make_tuple("batch_invariance_audit_rate",
                        absl::GetFlag(FLAGS_batch_invariance_audit_rate),
                        &config.batch_invariance_audit_rate)}) {
    if (!(rate >= 0 && rate <= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": expected 0..1, got ", rate));
    }
    *out = rate;
  }

  const int64_t message = absl::GetFlag(FLAGS_max_message_bytes);
  if (message < 1 || message > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_message_bytes: expected 1..", INT_MAX, ", got ", message));
  }
  config.service.max_message_bytes = static_cast<uint64_t>(message);
  const int64_t tensor = absl::GetFlag(FLAGS_max_tensor_bytes);
  const int64_t request = absl::GetFlag(FLAGS_max_request_bytes);
  if (tensor < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_tensor_bytes: expected >= 1, got ", tensor));
  }
  if (request < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_request_bytes: expected >= 1, got ", request));
  }
  const int64_t parameters = absl::GetFlag(FLAGS_max_parameter_bytes);
  if (parameters < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_parameter_bytes: expected >= 0, got ", parameters));
  }
  config.service.limits.max_parameter_bytes = static_cast<uint64_t>(parameters);
  config.service.limits.max_tensor_bytes = static_cast<uint64_t>(tensor);
  config.service.limits.max_request_bytes = static_cast<uint64_t>(request);
  const int inflight = absl::GetFlag(FLAGS_max_inflight);
  if (inflight < 1 || inflight > 100000) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_inflight: expected 1..100000, got ", inflight));
  }
  config.service.max_inflight = inflight;
  const int batch_ops = absl::GetFlag(FLAGS_max_batch_ops);
  if (batch_ops < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_batch_ops: expected >= 1, got ", batch_ops));
  }
  config.service.limits.max_batch_ops = batch_ops;
  if (absl::GetFlag(FLAGS_drain_timeout) < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--drain_timeout: expected >= 0");
  }
  config.nccl_library = absl::GetFlag(FLAGS_nccl_library);
  config.group_timeout = absl::GetFlag(FLAGS_group_timeout);
  if (config.group_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--group_timeout: expected > 0");
  }
  ShmOptions& shm = config.service.shm;
  shm.enabled = absl::GetFlag(FLAGS_allow_shm);
  shm.allow_tcp = absl::GetFlag(FLAGS_shm_allow_tcp);
  shm.key_prefix = absl::GetFlag(FLAGS_shm_key_prefix);
  bool prefix_ok = !shm.key_prefix.empty() && shm.key_prefix.size() < 200 &&
                   shm.key_prefix.find("..") == std::string::npos;
  for (char c : shm.key_prefix) {
    prefix_ok =
        prefix_ok && (absl::ascii_isalnum(static_cast<unsigned char>(c)) ||
                      c == '_' || c == '.' || c == '-');
  }
  if (!prefix_ok) {
    return absl::InvalidArgumentError(
        "--shm_key_prefix: expected 1..199 characters of [A-Za-z0-9_.-] "
        "without '..'");
  }
  shm.max_regions_per_session =
      absl::GetFlag(FLAGS_shm_max_regions_per_session);
  if (shm.max_regions_per_session < 1 || shm.max_regions_per_session > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shm_max_regions_per_session: expected 1..4096, got ",
                     shm.max_regions_per_session));
  }
  const int64_t shm_bytes = absl::GetFlag(FLAGS_shm_max_bytes_per_session);
  if (shm_bytes < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--shm_max_bytes_per_session: expected >= 1, got ", shm_bytes));
  }
  shm.max_bytes_per_session = static_cast<uint64_t>(shm_bytes);
  shm.pin_host = absl::GetFlag(FLAGS_shm_pin_host);
  int spin_us = absl::GetFlag(FLAGS_shm_call_ring_spin_us);
  if (spin_us < -1 || spin_us > 100000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--shm_call_ring_spin_us: expected -1 or 0..100000, got ", spin_us));
  }
  if (spin_us == -1) {
    // A torch step's calls come a few hundred microseconds apart: polling
    // that long saves each a wake-up, but where cores are few the poller
    // takes one from the client itself.
    spin_us = std::thread::hardware_concurrency() >= 8 ? 300 : 50;
  }
  shm.call_ring_spin = absl::Microseconds(spin_us);
  shm.max_sessions = absl::GetFlag(FLAGS_shm_max_sessions);
  if (shm.max_sessions < 1 || shm.max_sessions > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--shm_max_sessions: expected 1..1024, got ", shm.max_sessions));
  }
  config.checkpoints.state_dir = absl::GetFlag(FLAGS_state_dir);
  config.checkpoints.restore = absl::GetFlag(FLAGS_restore);
  if (config.checkpoints.restore && config.checkpoints.state_dir.empty()) {
    return absl::InvalidArgumentError(
        "--restore: needs --state_dir (the directory to restore from)");
  }
  const int64_t write_rate =
      absl::GetFlag(FLAGS_checkpoint_write_bytes_per_second);
  if (write_rate < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--checkpoint_write_bytes_per_second: expected >= 0, got ",
                     write_rate));
  }
  config.checkpoints.max_write_bytes_per_second =
      static_cast<uint64_t>(write_rate);
  MHC_ASSIGN_OR_RETURN(config.security, SecurityConfigFromFlags());
  if (absl::GetFlag(FLAGS_threads) < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--threads: expected >= 0 (0: all cores), got ",
                     absl::GetFlag(FLAGS_threads)));
  }
  return config;
}

absl::Duration DrainTimeoutFromFlags() {
  return absl::GetFlag(FLAGS_drain_timeout);
}

namespace {

// The CUDA devices --devices names (empty: all visible), one backend each.
absl::StatusOr<std::vector<DeviceBackend>> CudaBackendsFromFlags() {
#ifdef MHC_HAVE_CUDA
  const int visible = CudaDeviceCount();
  if (visible == 0) {
    return absl::FailedPreconditionError(
        "--backend=cuda: no CUDA device is visible (driver missing, no GPU, "
        "or CUDA_VISIBLE_DEVICES hides them)");
  }
  std::vector<int> indices;
  const std::string list = absl::GetFlag(FLAGS_devices);
  if (list.empty()) {
    for (int i = 0; i < visible; ++i) indices.push_back(i);
  }
  for (absl::string_view item : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    int index = -1;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(item), &index) ||
        index < 0 || index >= visible) {
      return absl::InvalidArgumentError(
          absl::StrCat("--devices: expected indices in 0..", visible - 1,
                       " separated by commas, got '", list, "'"));
    }
    for (int seen : indices) {
      if (seen == index) {
        return absl::InvalidArgumentError(
            absl::StrCat("--devices: device ", index, " listed twice"));
      }
    }
    indices.push_back(index);
  }
  std::vector<DeviceBackend> devices;
  for (int index : indices) {
    MHC_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend,
                         MakeCudaBackend(index));
    devices.push_back(
        {absl::StrCat("cuda:", index), std::move(backend), index});
  }
  return devices;
#else
  return absl::FailedPreconditionError(
      "--backend=cuda: this build of mhcd has no CUDA backend (built without "
      "nvcc); use --backend=cpu (or auto)");
#endif
}

bool CudaAvailable() {
#ifdef MHC_HAVE_CUDA
  return CudaDeviceCount() > 0;
#else
  return false;
#endif
}

}  // namespace

absl::StatusOr<std::vector<DeviceBackend>> BackendsFromFlags() {
  const std::string name = absl::GetFlag(FLAGS_backend);
  if (name == "cuda" || (name == "auto" && CudaAvailable())) {
    MHC_ASSIGN_OR_RETURN(std::vector<DeviceBackend> devices,
                         CudaBackendsFromFlags());
    MHC_RETURN_IF_ERROR(CheckFaultInjectionFlag(devices));
    return devices;
  }
  if (!absl::GetFlag(FLAGS_devices).empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--devices: only for CUDA devices, but the backend is ",
                     name == "auto" ? "cpu (auto found no GPU)" : name));
  }
  std::vector<DeviceBackend> devices;
  if (name == "cpu" || name == "auto") {
    devices.push_back({"cpu", MakeCpuBackend(absl::GetFlag(FLAGS_threads))});
  } else if (name == "reference") {
    devices.push_back({"cpu", MakeReferenceBackend()});
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--backend: expected cpu, reference, cuda or auto, got '", name, "'"));
  }
  MHC_RETURN_IF_ERROR(CheckFaultInjectionFlag(devices));
  return devices;
}

std::vector<std::string> FlagNotices() {
  std::vector<std::string> notices;
  const absl::StatusOr<SecurityConfig> security = SecurityConfigFromFlags();
  if (security.ok() && security->allow_insecure_remote && !security->tls() &&
      !security->auth_tokens_file.empty()) {
    notices.push_back(
        "warning: bearer tokens cross plaintext TCP listeners off loopback "
        "(--allow_insecure_remote without --tls_cert)");
  }
  if (!absl::GetFlag(FLAGS_allow_shm) && absl::GetFlag(FLAGS_shm_allow_tcp)) {
    notices.push_back(
        "note: --shm_allow_tcp has no effect without --allow_shm");
  }
  if (std::string fault = FaultInjectionNotice(); !fault.empty()) {
    notices.push_back(std::move(fault));
  }
  return notices;
}

}  // namespace mhc::server
