// mhcctl: command-line client of mhcd.
//
//   mhcctl --address=ADDR [--json] COMMAND [ARGS]
//
// Commands: info, health, layer create|list|show NAME|delete NAME, run,
// checkpoint save|load|list.
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "mhc/client/client.h"
#include "mhcctl/commands.h"
#include "mhcctl/output.h"

ABSL_FLAG(std::string, address, "127.0.0.1:50051",
          "daemon address: host:port or unix:/path");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(120),
          "deadline of each RPC (absl duration, e.g. 30s)");
ABSL_FLAG(bool, json, false, "print one JSON object instead of text");
ABSL_FLAG(std::string, name, "",
          "layer create/show/delete: the layer name; checkpoint: its name");
ABSL_FLAG(std::string, preset, "deepseek_v4",
          "deepseek_v4, tilekernels, transformer_engine, megatron or liger");
ABSL_FLAG(int32_t, n, 4, "residual streams (1..16)");
ABSL_FLAG(int64_t, hidden, 0,
          "C, width of one stream (layer create: required; run: 256)");
ABSL_FLAG(uint64_t, seed, 0, "parameter initialisation seed");
ABSL_FLAG(std::string, device, "", "device of the layer: '', cpu, cuda:N");
ABSL_FLAG(std::string, kind, "", "override: mhc or head");
ABSL_FLAG(std::string, layout, "", "override: stream_major or stream_minor");
ABSL_FLAG(std::string, orientation, "", "override: source_rows or dest_rows");
ABSL_FLAG(std::string, sinkhorn_mode, "", "override: linear or log");
ABSL_FLAG(std::string, sinkhorn_iterations, "", "override: T, 1..1000");
ABSL_FLAG(std::string, eps_sk, "", "override: Sinkhorn epsilon");
ABSL_FLAG(std::string, eps_rms, "", "override: RMS epsilon");
ABSL_FLAG(std::string, eps_placement, "", "override: inside or outside");
ABSL_FLAG(std::string, eps_pre, "", "override: epsilon added to H_pre");
ABSL_FLAG(std::string, post_mult, "", "override: H_post multiplier");
ABSL_FLAG(std::string, dynamic, "", "override: true or false (static layer)");
ABSL_FLAG(bool, has_gamma, false, "the layer has an RMSNorm weight gamma");
ABSL_FLAG(bool, has_post_bias, false, "the layer has F's bias fused in post");
ABSL_FLAG(std::string, matmul_precision, "", "override: ieee or tf32");
ABSL_FLAG(int64_t, tokens, 128, "run: tokens M");
ABSL_FLAG(std::string, dtype, "bf16", "run: activation dtype bf16|fp16|fp32");
ABSL_FLAG(int32_t, iterations, 3, "run: forward+backward passes timed");
ABSL_FLAG(std::string, layer, "",
          "run: use this existing layer instead of creating one");
ABSL_FLAG(std::string, f, "tanh",
          "run: the client-side sub-layer F, tanh or identity");
ABSL_FLAG(uint64_t, data_seed, 1, "run: seed of the random activations");
ABSL_FLAG(std::string, optimizer, "",
          "run: after the checks, one OptimizerStep (sgd or adamw, clipped "
          "at norm 1, gradients zeroed)");
ABSL_FLAG(float, learning_rate, 1e-3f, "run: learning rate of --optimizer");
ABSL_FLAG(bool, shm, false,
          "run: pass the forward tensors (Pre, Post) through POSIX shared "
          "memory in a session instead of inline (daemon needs --allow_shm "
          "and a unix-socket address)");

namespace {

constexpr char kUsage[] =
    R"(mhcctl --address=ADDR [--json] [--tls --tls_ca=F --tls_cert=F --tls_key=F]
       [--token_file=F] COMMAND

Commands:
  info                      server version, backend, devices, limits
  health                    grpc.health.v1 status of the daemon
  layer create --name=N --hidden=C [--preset=P --n=4 --seed=S --device=D
               --layout=... --sinkhorn_iterations=... (spec overrides)]
  layer list
  layer show --name=N       (or: layer show N)
  layer delete --name=N     (or: layer delete N)
  checkpoint save NAME [--layers=a,b --gradients]
  checkpoint load NAME [--layers=a,b --replace --device=D]
  checkpoint list           checkpoints in the daemon's --state_dir
  run [--tokens=128 --n=4 --hidden=256 --dtype=bf16 --preset=deepseek_v4
       --iterations=3 --layer=EXISTING --f=tanh --shm
       --optimizer=sgd|adamw --learning_rate=1e-3]
      one mHC layer forward and backward through the daemon on random data,
      checked against the float64 reference computed here, then optionally
      one optimizer step; exit code 1 when a check fails.
)";

bool IsMhcctlFlagFile(absl::string_view file) {
  return absl::StrContains(file, "mhcctl/");
}

// --help and -h: the usage and mhcctl's own flags on stdout, exit 0 (absl's
// own --help exits 1, and lists only flags of a file named after the
// program).
bool PrintHelpIfAsked(int argc, char** argv) {
  bool asked = false;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    asked = asked || arg == "--help" || arg == "-h" || arg == "--helpshort";
  }
  if (!asked) return false;
  std::map<std::string, std::string> lines;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!IsMhcctlFlagFile(flag->Filename())) continue;
    lines[std::string(name)] =
        absl::StrCat("  --", name, "  ", flag->Help(),
                     " (default: ", flag->DefaultValue(), ")\n");
  }
  std::printf("%s\nFlags:\n", kUsage);
  for (const auto& [name, line] : lines) std::printf("%s", line.c_str());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (PrintHelpIfAsked(argc, argv)) return 0;
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = IsMhcctlFlagFile;
  usage.contains_helpshort_flags = IsMhcctlFlagFile;
  usage.version_string = [] { return std::string("mhcctl " MHC_VERSION "\n"); };
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  std::vector<std::string> args(positional.begin() + 1, positional.end());
  if (args.empty()) {
    std::fprintf(stderr, "%s", kUsage);
    return mhc::mhcctl::kExitUsage;
  }
  const bool json = absl::GetFlag(FLAGS_json);
  absl::StatusOr<mhc::client::ClientOptions> options =
      mhc::mhcctl::ConnectOptionsFromFlags();
  if (!options.ok()) {
    mhc::mhcctl::ReportError("connect", options.status(), json);
    return mhc::mhcctl::kExitUsage;
  }
  options->timeout = absl::GetFlag(FLAGS_timeout);
  auto client =
      mhc::client::Client::Connect(absl::GetFlag(FLAGS_address), *options);
  if (!client.ok()) {
    mhc::mhcctl::ReportError("connect", client.status(), json);
    return mhc::mhcctl::kExitUsage;
  }
  const std::string& command = args[0];
  if (command == "info" && args.size() == 1) {
    return mhc::mhcctl::RunInfo(**client);
  }
  if (command == "health" && args.size() == 1) {
    return mhc::mhcctl::RunHealth(**client);
  }
  if (command == "layer") {
    return mhc::mhcctl::RunLayer(
        **client, std::vector<std::string>(args.begin() + 1, args.end()));
  }
  if (command == "checkpoint") {
    return mhc::mhcctl::RunCheckpoint(
        **client, std::vector<std::string>(args.begin() + 1, args.end()));
  }
  if (command == "run" && args.size() == 1) {
    return mhc::mhcctl::RunRun(**client);
  }
  std::fprintf(stderr, "mhcctl: unknown command or extra arguments\n\n%s",
               kUsage);
  return mhc::mhcctl::kExitUsage;
}
