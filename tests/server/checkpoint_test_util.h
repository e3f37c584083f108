// Helpers of the checkpoint tests (checkpoint_test.cc,
// checkpoint_optimizer_test.cc): a --state_dir that outlives one test's
// daemons, raw file access for forging variants, everything a client can
// observe of the daemon's layers, and the save / load calls.
#ifndef MHC_TESTS_SERVER_CHECKPOINT_TEST_UTIL_H_
#define MHC_TESTS_SERVER_CHECKPOINT_TEST_UTIL_H_

#include <signal.h>
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "mhc/status.h"
#include "server_test_util.h"

namespace mhc::testing {

// A directory for --state_dir that outlives the daemons of one test.
class StateDir {
 public:
  StateDir() {
    char dir[] = "/tmp/mhcd-state-XXXXXX";
    path_ = mkdtemp(dir) != nullptr ? dir : "";
  }
  ~StateDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }
  std::string Flag() const { return "--state_dir=" + path_; }
  std::string File(const std::string& name) const {
    return path_ + "/" + name + ".safetensors";
  }

 private:
  std::string path_;
};

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

inline void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// Parameters as name -> (shape, raw bytes): equal means bitwise equal.
using RawTensors =
    std::map<std::string, std::pair<std::vector<int64_t>, std::string>>;

inline RawTensors Raw(const v1::Parameters& parameters) {
  RawTensors raw;
  for (const auto& [name, ref] : parameters.tensors()) {
    raw[name] = {std::vector<int64_t>(ref.shape().begin(), ref.shape().end()),
                 ref.inline_data()};
  }
  return raw;
}

// Everything a client can observe of the daemon's layers.
struct Snapshot {
  std::map<std::string, std::string> infos;  // name -> LayerInfo bytes
  std::map<std::string, RawTensors> parameters;
  std::map<std::string, RawTensors> gradients;
  bool operator==(const Snapshot& o) const {
    return infos == o.infos && parameters == o.parameters &&
           gradients == o.gradients;
  }
};

inline absl::StatusOr<Snapshot> Observe(client::Client& c) {
  Snapshot snapshot;
  auto list = c.ListLayers();
  if (!list.ok()) return list.status();
  for (const v1::LayerInfo& info : list->layers()) {
    snapshot.infos[info.name()] = info.SerializeAsString();
    auto params = c.GetParameters(info.name());
    if (!params.ok()) return params.status();
    snapshot.parameters[info.name()] = Raw(*params);
    auto grads = c.GetGradients(info.name());
    if (!grads.ok()) return grads.status();
    snapshot.gradients[info.name()] = Raw(grads->gradients());
  }
  return snapshot;
}

// Saves checkpoint `name` of `layers` (all when empty), with the
// gradients and the optimizer state as asked.
inline absl::Status Save(client::Client& c, const std::string& name,
                         std::vector<std::string> layers = {},
                         bool gradients = false, bool optimizer = true) {
  v1::SaveCheckpointRequest r;
  r.set_name(name);
  for (const auto& layer : layers) r.add_layers(layer);
  r.set_include_gradients(gradients);
  r.set_skip_optimizer_state(!optimizer);
  return c.SaveCheckpoint(r).status();
}

// Loads checkpoint `name` (its `layers`, all when empty), over existing
// layers with `replace`.
inline absl::Status Load(client::Client& c, const std::string& name,
                         bool replace = false,
                         std::vector<std::string> layers = {}) {
  v1::LoadCheckpointRequest r;
  r.set_name(name);
  r.set_replace(replace);
  for (const auto& layer : layers) r.add_layers(layer);
  return c.LoadCheckpoint(r).status();
}

// Ends `daemon` as a crash would: SIGKILL, which it must die of.
inline void KillDaemon(Daemon& daemon) {
  daemon.Signal(SIGKILL);
  absl::StatusOr<int> code = daemon.Wait(absl::Seconds(10));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 128 + SIGKILL);
}

// Loading checkpoint `name` must fail with `code` and a message holding
// `message`, and leave the daemon as `before` observed it. With replace,
// a load that got through would change every layer.
inline void ExpectLoadRefused(client::Client& c, const std::string& name,
                              absl::StatusCode code, const std::string& message,
                              const Snapshot& before) {
  absl::Status status = Load(c, name, /*replace=*/true);
  EXPECT_EQ(status.code(), code) << name << ": " << status;
  EXPECT_TRUE(absl::StrContains(status.message(), message))
      << name << ": " << status;
  absl::StatusOr<Snapshot> after = Observe(c);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(*after == before) << name << " changed the daemon";
}

// A daemon started on `state` with --restore, which must report that it
// restored checkpoint `name`.
inline absl::StatusOr<std::unique_ptr<Daemon>> StartRestored(
    const StateDir& state, const std::string& name) {
  MHC_ASSIGN_OR_RETURN(std::unique_ptr<Daemon> daemon,
                       Daemon::Start({state.Flag(), "--restore"}));
  const std::string said =
      absl::StrCat("mhcd: restored checkpoint '", name, "'");
  if (!absl::StrContains(daemon->Stdout(), said)) {
    return absl::InternalError(
        absl::StrCat("no \"", said, "\" in: ", daemon->Stdout()));
  }
  return daemon;
}

}  // namespace mhc::testing

#endif  // MHC_TESTS_SERVER_CHECKPOINT_TEST_UTIL_H_
