// checkpoint save|load|list: the daemon's checkpoints in its --state_dir.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "mhcctl/commands.h"
#include "mhcctl/output.h"

ABSL_FLAG(std::string, layers, "",
          "checkpoint save/load: comma-separated layer names (empty: all)");
ABSL_FLAG(bool, gradients, false,
          "checkpoint save: include the gradient accumulators");
ABSL_FLAG(bool, replace, false,
          "checkpoint load: replace layers that already exist");

namespace mhc::mhcctl {
namespace {

std::vector<std::string> LayerList() {
  return absl::StrSplit(absl::GetFlag(FLAGS_layers), ',', absl::SkipEmpty());
}

}  // namespace

int RunCheckpoint(client::Client& client,
                  const std::vector<std::string>& args) {
  const bool json = absl::GetFlag(FLAGS_json);
  if (args.empty() || args.size() > 2) {
    std::fprintf(stderr, "mhcctl checkpoint: save|load|list [NAME]\n");
    return kExitUsage;
  }
  const std::string& verb = args[0];
  const std::string name =
      args.size() == 2 ? args[1] : absl::GetFlag(FLAGS_name);
  if (verb == "list") {
    auto list = client.ListCheckpoints();
    if (!list.ok()) return ReportError("checkpoint list", list.status(), json);
    if (json) {
      std::printf("%s\n", ProtoJson(*list).c_str());
      return kExitOk;
    }
    for (const v1::CheckpointInfo& info : list->checkpoints()) {
      const absl::Time modified =
          absl::FromUnixNanos(info.modified_unix_nanos());
      std::printf("%s  %llu bytes  %s\n", info.name().c_str(),
                  static_cast<unsigned long long>(info.bytes()),
                  absl::FormatTime(modified, absl::UTCTimeZone()).c_str());
    }
    return kExitOk;
  }
  if (name.empty()) {
    std::fprintf(stderr, "mhcctl checkpoint %s: needs NAME (or --name)\n",
                 verb.c_str());
    return kExitUsage;
  }
  if (verb == "save") {
    v1::SaveCheckpointRequest request;
    request.set_name(name);
    for (const std::string& layer : LayerList()) request.add_layers(layer);
    request.set_include_gradients(absl::GetFlag(FLAGS_gradients));
    auto saved = client.SaveCheckpoint(request);
    if (!saved.ok())
      return ReportError("checkpoint save", saved.status(), json);
    if (json) {
      std::printf("%s\n", ProtoJson(*saved).c_str());
    } else {
      std::printf("saved %s: %d layers, %llu bytes in %.3f s\n", name.c_str(),
                  saved->layers_size(),
                  static_cast<unsigned long long>(saved->bytes()),
                  saved->seconds());
    }
    return kExitOk;
  }
  if (verb == "load") {
    v1::LoadCheckpointRequest request;
    request.set_name(name);
    for (const std::string& layer : LayerList()) request.add_layers(layer);
    request.set_replace(absl::GetFlag(FLAGS_replace));
    request.set_device(absl::GetFlag(FLAGS_device));
    auto loaded = client.LoadCheckpoint(request);
    if (!loaded.ok()) {
      return ReportError("checkpoint load", loaded.status(), json);
    }
    if (json) {
      std::printf("%s\n", ProtoJson(*loaded).c_str());
    } else {
      std::vector<std::string> names;
      for (const v1::LayerInfo& info : loaded->layers()) {
        names.push_back(info.name());
      }
      std::printf("loaded %s: %s (%llu bytes in %.3f s)\n", name.c_str(),
                  absl::StrJoin(names, ", ").c_str(),
                  static_cast<unsigned long long>(loaded->bytes()),
                  loaded->seconds());
    }
    return kExitOk;
  }
  std::fprintf(stderr, "mhcctl checkpoint: unknown verb '%s'\n", verb.c_str());
  return kExitUsage;
}

}  // namespace mhc::mhcctl
