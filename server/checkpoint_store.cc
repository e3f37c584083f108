#include "server/checkpoint_store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <system_error>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "mhc/status.h"
#include "server/checkpoint_file.h"
#include "server/checkpoint_format.h"

namespace mhc::server {

CheckpointStore::CheckpointStore(CheckpointOptions options, LayerStore* layers,
                                 Metrics* metrics)
    : options_(std::move(options)), layers_(layers), metrics_(metrics) {}

absl::Status CheckpointStore::Init() {
  if (options_.state_dir.empty()) return absl::OkStatus();
  namespace fs = std::filesystem;
  std::error_code error;
  fs::create_directories(options_.state_dir, error);
  if (error || !fs::is_directory(options_.state_dir, error)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--state_dir: ", options_.state_dir,
                     " is not a directory and cannot be created",
                     error ? absl::StrCat(" (", error.message(), ")") : ""));
  }
  if (access(options_.state_dir.c_str(), W_OK | X_OK) != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "--state_dir: ", options_.state_dir, " is not writable by mhcd"));
  }
  // A save that crashed left its temp file; the checkpoint it was to
  // replace is whole, so the temp file is garbage.
  for (const auto& entry : fs::directory_iterator(options_.state_dir, error)) {
    if (absl::StartsWith(entry.path().filename().string(),
                         kCheckpointTempPrefix)) {
      fs::remove(entry.path(), error);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> CheckpointStore::PathOf(
    absl::string_view rpc, absl::string_view name) const {
  if (options_.state_dir.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(rpc,
                     ": this mhcd has no checkpoint directory; start it with "
                     "--state_dir=DIR to save and load checkpoints"));
  }
  // Names are file names inside state_dir, never paths: the layer-name
  // rules exclude '/', leading dots and so '..'.
  MHC_RETURN_IF_ERROR(ValidateLayerName(name, "name"));
  return absl::StrCat(options_.state_dir, "/", name, kCheckpointExtension);
}

absl::StatusOr<v1::ListCheckpointsResponse> CheckpointStore::List() const {
  if (options_.state_dir.empty()) {
    return absl::FailedPreconditionError(
        "ListCheckpoints: this mhcd has no checkpoint directory; start it "
        "with --state_dir=DIR to save and load checkpoints");
  }
  namespace fs = std::filesystem;
  std::error_code error;
  std::vector<v1::CheckpointInfo> found;
  for (const auto& entry : fs::directory_iterator(options_.state_dir, error)) {
    const std::string file = entry.path().filename().string();
    if (!absl::EndsWith(file, kCheckpointExtension)) continue;
    const std::string name =
        file.substr(0, file.size() - std::string(kCheckpointExtension).size());
    struct stat info {};
    if (!ValidateLayerName(name, "name").ok() ||
        stat(entry.path().c_str(), &info) != 0 || !S_ISREG(info.st_mode)) {
      continue;
    }
    v1::CheckpointInfo& checkpoint = found.emplace_back();
    checkpoint.set_name(name);
    checkpoint.set_bytes(static_cast<uint64_t>(info.st_size));
    checkpoint.set_modified_unix_nanos(
        static_cast<int64_t>(info.st_mtim.tv_sec) * 1000000000 +
        info.st_mtim.tv_nsec);
  }
  if (error) {
    return absl::InternalError(absl::StrCat("ListCheckpoints: cannot read ",
                                            options_.state_dir, ": ",
                                            error.message()));
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) {
    return std::make_tuple(-a.modified_unix_nanos(), a.name()) <
           std::make_tuple(-b.modified_unix_nanos(), b.name());
  });
  v1::ListCheckpointsResponse response;
  for (auto& checkpoint : found) {
    *response.add_checkpoints() = std::move(checkpoint);
  }
  return response;
}

absl::StatusOr<std::string> CheckpointStore::RestoreNewest() {
  MHC_ASSIGN_OR_RETURN(v1::ListCheckpointsResponse list, List());
  if (list.checkpoints().empty()) return std::string();
  v1::LoadCheckpointRequest request;
  request.set_name(list.checkpoints(0).name());
  absl::Status loaded = Load(request).status();
  if (!loaded.ok()) {
    return absl::Status(
        loaded.code(),
        absl::StrCat("--restore: checkpoint '", request.name(),
                     "' (the newest in --state_dir): ", loaded.message()));
  }
  return request.name();
}

}  // namespace mhc::server
