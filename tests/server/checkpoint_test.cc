// Checkpoints over a real mhcd: bitwise round trips (parameters, gradients,
// selected layers), refusal of corrupt, truncated, foreign and clashing
// files without side effects, names that would leave --state_dir, a SIGKILL
// in the middle of a write, and --restore after a kill. The optimizer's
// state and training across a load: checkpoint_optimizer_test.cc.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "checkpoint_test_util.h"
#include "gtest/gtest.h"
#include "server/checkpoint_format.h"
#include "server/crc32c.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

namespace fs = std::filesystem;
using client::ToTensorRef;

// Three layers of different kinds, layouts and optional parameters, with
// random values.
void CreateLayers(client::Client& c, int64_t hidden = 48) {
  v1::CreateLayerRequest minor = LayerRequest("minor", 4, hidden);
  minor.mutable_spec()->set_layout(v1::LAYOUT_STREAM_MINOR);
  minor.mutable_spec()->set_has_gamma(true);
  minor.mutable_spec()->set_eps_rms(3.0e-7f);
  v1::CreateLayerRequest head = LayerRequest("head", 2, hidden, "megatron");
  head.mutable_spec()->set_kind(v1::LAYER_KIND_HEAD);
  v1::CreateLayerRequest plain = LayerRequest("plain", 3, hidden, "liger");
  plain.mutable_spec()->set_has_post_bias(true);
  for (const auto& request : {minor, head, plain}) {
    auto created = CreateRandomLayer(c, request);
    ASSERT_TRUE(created.ok()) << created.status();
  }
}

// Accumulates gradients (and tokens) into layer `name` of n streams.
void AccumulateGradients(client::Client& c, const std::string& name, int n,
                         int64_t tokens) {
  const int64_t logits = 2 * n + n * n;
  v1::ScaleBackwardRequest r;
  r.set_layer(name);
  *r.mutable_h() = ToTensorRef(RandomF32({tokens, logits}));
  *r.mutable_mean_square() = ToTensorRef(RandomF32({tokens}, 0.5f, 2.0f));
  *r.mutable_dh_pre() = ToTensorRef(RandomF32({tokens, n}));
  *r.mutable_dh_post() = ToTensorRef(RandomF32({tokens, n}));
  *r.mutable_dlogits() = ToTensorRef(RandomF32({tokens, n, n}));
  ASSERT_TRUE(c.ScaleBackward(r).ok());
}

// Sets every parameter of `name` to new random values.
void Scramble(client::Client& c, const std::string& name) {
  MHC_ASSERT_OK_AND_ASSIGN(v1::Parameters params, c.GetParameters(name));
  v1::SetParametersRequest set;
  set.set_layer(name);
  for (const auto& [param, ref] : params.tensors()) {
    (*set.mutable_parameters()->mutable_tensors())[param] =
        ToTensorRef(RandomF32(
            std::vector<int64_t>(ref.shape().begin(), ref.shape().end())));
  }
  MHC_ASSERT_OK(c.SetParameters(set).status());
}

TEST(CheckpointTest, RoundTripIsBitwise) {
  StateDir state;
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start({state.Flag()}));
  MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
  CreateLayers(*c);
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot saved, Observe(*c));
  MHC_ASSERT_OK(Save(*c, "round"));
  EXPECT_TRUE(fs::exists(state.File("round")));

  Scramble(*c, "minor");
  MHC_ASSERT_OK(c->DeleteLayer("head").status());
  MHC_ASSERT_OK(Load(*c, "round", /*replace=*/true));
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot loaded, Observe(*c));
  EXPECT_EQ(loaded.parameters, saved.parameters);
  for (const auto& [name, info_bytes] : saved.infos) {
    v1::LayerInfo want, got;
    ASSERT_TRUE(want.ParseFromString(info_bytes));
    ASSERT_TRUE(got.ParseFromString(loaded.infos[name]));
    EXPECT_EQ(got.spec().SerializeAsString(), want.spec().SerializeAsString())
        << name;
    EXPECT_EQ(got.preset(), want.preset()) << name;
    // A replaced layer's version moves on; a recreated one keeps its own.
    EXPECT_GE(got.parameters_version(), want.parameters_version()) << name;
  }

  // A fresh daemon on the same directory loads the same layers.
  MHC_ASSERT_OK_AND_ASSIGN(auto second, Daemon::Start({state.Flag()}));
  MHC_ASSERT_OK_AND_ASSIGN(auto c2, second->Connect());
  MHC_ASSERT_OK(Load(*c2, "round"));
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot fresh, Observe(*c2));
  EXPECT_TRUE(fresh == saved);

  MHC_ASSERT_OK_AND_ASSIGN(
      std::string scrape,
      HttpGet(daemon->metrics_host(), daemon->metrics_port(), "/metrics"));
  EXPECT_EQ(MetricSample(scrape, "mhcd_checkpoint_bytes_total",
                         {"direction=\"save\""}),
            static_cast<double>(fs::file_size(state.File("round"))));
  EXPECT_GT(MetricSample(scrape, "mhcd_checkpoint_duration_seconds_count",
                         {"direction=\"load\""}),
            0);
}

TEST(CheckpointTest, GradientsAndTheirTokensOnlyWhenAsked) {
  StateDir state;
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start({state.Flag()}));
  MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
  CreateLayers(*c);
  AccumulateGradients(*c, "minor", 4, 5);
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot saved, Observe(*c));
  MHC_ASSERT_OK_AND_ASSIGN(v1::LayerInfo before, c->GetLayer("minor"));
  ASSERT_EQ(before.gradient_tokens(), 5);
  MHC_ASSERT_OK(Save(*c, "with", {}, /*gradients=*/true));
  MHC_ASSERT_OK(Save(*c, "without"));
  EXPECT_GT(fs::file_size(state.File("with")),
            fs::file_size(state.File("without")));

  MHC_ASSERT_OK_AND_ASSIGN(auto second, Daemon::Start({state.Flag()}));
  MHC_ASSERT_OK_AND_ASSIGN(auto c2, second->Connect());
  MHC_ASSERT_OK(Load(*c2, "with"));
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot with, Observe(*c2));
  EXPECT_EQ(with.gradients, saved.gradients);
  EXPECT_EQ(with.parameters, saved.parameters);
  MHC_ASSERT_OK_AND_ASSIGN(v1::LayerInfo info, c2->GetLayer("minor"));
  EXPECT_EQ(info.gradient_tokens(), 5);

  MHC_ASSERT_OK(Load(*c2, "without", /*replace=*/true));
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot without, Observe(*c2));
  EXPECT_EQ(without.parameters, saved.parameters);
  MHC_ASSERT_OK_AND_ASSIGN(auto zero, c2->GetGradients("minor"));
  EXPECT_EQ(zero.gradient_tokens(), 0);
  for (const auto& [name, ref] : zero.gradients().tensors()) {
    EXPECT_EQ(ref.inline_data(), std::string(ref.inline_data().size(), '\0'))
        << name;
  }
}

TEST(CheckpointTest, SelectedLayersOnly) {
  StateDir state;
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start({state.Flag()}));
  MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
  CreateLayers(*c);
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot saved, Observe(*c));
  MHC_ASSERT_OK(Save(*c, "two", {"plain", "minor"}));
  EXPECT_EQ(Save(*c, "x", {"minor", "minor"}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Save(*c, "x", {"nope"}).code(), absl::StatusCode::kNotFound);

  MHC_ASSERT_OK_AND_ASSIGN(auto second, Daemon::Start({state.Flag()}));
  MHC_ASSERT_OK_AND_ASSIGN(auto c2, second->Connect());
  absl::Status missing = Load(*c2, "two", false, {"head"});
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_TRUE(absl::StrContains(missing.message(), "minor, plain")) << missing;
  v1::LoadCheckpointRequest elsewhere;
  elsewhere.set_name("two");
  elsewhere.set_device("cuda:7");
  absl::Status no_device = c2->LoadCheckpoint(elsewhere).status();
  EXPECT_EQ(no_device.code(), absl::StatusCode::kInvalidArgument) << no_device;
  EXPECT_TRUE(absl::StrContains(no_device.message(), "device")) << no_device;
  MHC_ASSERT_OK(Load(*c2, "two", false, {"plain"}));
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot one, Observe(*c2));
  ASSERT_EQ(one.parameters.size(), 1u);
  EXPECT_EQ(one.parameters["plain"], saved.parameters["plain"]);
  MHC_ASSERT_OK(Load(*c2, "two", false, {"minor"}));
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot two, Observe(*c2));
  ASSERT_EQ(two.parameters.size(), 2u);
  EXPECT_EQ(two.parameters["minor"], saved.parameters["minor"]);
}

TEST(CheckpointTest, WithoutStateDirEveryRpcIsFailedPrecondition) {
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start());
  MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
  for (const absl::Status& status :
       {Save(*c, "a"), Load(*c, "a"), c->ListCheckpoints().status()}) {
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), "--state_dir")) << status;
  }
}

TEST(CheckpointTest, NamesNeverLeaveTheStateDir) {
  StateDir state;
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon,
                           Daemon::Start({state.Flag() + "/inner"}));
  MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
  CreateLayers(*c);
  const std::string escape = "../escape-" + std::to_string(getpid());
  for (const std::string& name :
       {escape, std::string("a/b"), state.path() + "/abs", std::string(".."),
        std::string(".hidden"), std::string("")}) {
    absl::Status saved = Save(*c, name);
    EXPECT_EQ(saved.code(), absl::StatusCode::kInvalidArgument)
        << name << ": " << saved;
    EXPECT_EQ(Load(*c, name).code(), absl::StatusCode::kInvalidArgument)
        << name;
  }
  EXPECT_FALSE(fs::exists(state.path() + "/inner/" + escape + ".safetensors"));
  EXPECT_TRUE(fs::is_empty(state.path() + "/inner"));
}

// Each variant of a good file goes into the directory under its own name;
// loading it must fail with `code` and leave the daemon as it was.
TEST(CheckpointTest, BadFilesChangeNothing) {
  StateDir state;
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start({state.Flag()}));
  MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
  CreateLayers(*c);
  MHC_ASSERT_OK(Save(*c, "good"));
  const std::string good = ReadFile(state.File("good"));
  ASSERT_GT(good.size(), 1000u);
  // The daemon keeps one of the layers, scrambled, and loses the others.
  Scramble(*c, "minor");
  MHC_ASSERT_OK(c->DeleteLayer("head").status());
  MHC_ASSERT_OK(c->DeleteLayer("plain").status());
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot before, Observe(*c));

  std::string flipped = good;
  flipped[flipped.size() - 3] ^= 0x10;  // inside the last tensor
  std::string version = good;
  const size_t at = version.find("\"format_version\":\"1\"");
  ASSERT_NE(at, std::string::npos);
  version[at + std::string("\"format_version\":\"").size()] = '9';
  std::string foreign = good;
  foreign.replace(foreign.find("mhcd.checkpoint"), 15, "other.checkpnt!");
  std::string spec = good;  // a bit of the manifest (its checksum catches it)
  const size_t n_at = spec.find("n\\\":4");  // n\":4 inside the JSON string
  ASSERT_NE(n_at, std::string::npos);
  spec[n_at + 4] = '5';
  const struct {
    const char* name;
    std::string bytes;
    absl::StatusCode code;
    const char* message;
  } cases[] = {
      {"flipped", flipped, absl::StatusCode::kDataLoss, "checksum"},
      {"truncated", good.substr(0, good.size() - 100),
       absl::StatusCode::kDataLoss, "truncated"},
      {"stub", good.substr(0, 5), absl::StatusCode::kDataLoss, "truncated"},
      {"headless", good.substr(0, 200), absl::StatusCode::kDataLoss,
       "truncated"},
      {"version", version, absl::StatusCode::kFailedPrecondition,
       "version '9'"},
      {"foreign", foreign, absl::StatusCode::kInvalidArgument,
       "not an mhcd checkpoint"},
      {"manifest", spec, absl::StatusCode::kDataLoss, "checksum"},
  };
  for (const auto& bad : cases) {
    WriteFile(state.File(bad.name), bad.bytes);
    ExpectLoadRefused(*c, bad.name, bad.code, bad.message, before);
  }
  // The clash: 'minor' exists, so without replace nothing is loaded, not
  // even the layers that do not clash.
  absl::Status clash = Load(*c, "good");
  EXPECT_EQ(clash.code(), absl::StatusCode::kAlreadyExists) << clash;
  EXPECT_TRUE(absl::StrContains(clash.message(), "'minor'")) << clash;
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot after, Observe(*c));
  EXPECT_TRUE(after == before);
  EXPECT_EQ(Load(*c, "absent").code(), absl::StatusCode::kNotFound);
}

TEST(CheckpointTest, ListNewestFirst) {
  StateDir state;
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start({state.Flag()}));
  MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
  CreateLayers(*c);
  MHC_ASSERT_OK(Save(*c, "older"));
  absl::SleepFor(absl::Milliseconds(20));
  MHC_ASSERT_OK(Save(*c, "newer"));
  WriteFile(state.path() + "/not-a-checkpoint.txt", "x");
  MHC_ASSERT_OK_AND_ASSIGN(auto list, c->ListCheckpoints());
  ASSERT_EQ(list.checkpoints_size(), 2);
  EXPECT_EQ(list.checkpoints(0).name(), "newer");
  EXPECT_EQ(list.checkpoints(1).name(), "older");
  EXPECT_EQ(list.checkpoints(0).bytes(), fs::file_size(state.File("newer")));
}

TEST(CheckpointTest, RestartWithRestoreServesTheSameLayers) {
  StateDir state;
  Snapshot saved;
  {
    MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start({state.Flag()}));
    MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
    CreateLayers(*c);
    AccumulateGradients(*c, "plain", 3, 4);
    MHC_ASSERT_OK(Save(*c, "first"));
    Scramble(*c, "plain");
    absl::SleepFor(absl::Milliseconds(20));
    MHC_ASSERT_OK(Save(*c, "latest", {}, /*gradients=*/true));
    MHC_ASSERT_OK_AND_ASSIGN(saved, Observe(*c));
    KillDaemon(*daemon);
  }
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, StartRestored(state, "latest"));
  MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot restored, Observe(*c));
  EXPECT_TRUE(restored == saved);

  // An empty directory restores nothing; --restore needs --state_dir.
  StateDir empty;
  MHC_ASSERT_OK_AND_ASSIGN(auto bare,
                           Daemon::Start({empty.Flag(), "--restore"}));
  MHC_ASSERT_OK_AND_ASSIGN(auto cb, bare->Connect());
  MHC_ASSERT_OK_AND_ASSIGN(auto none, cb->ListLayers());
  EXPECT_EQ(none.layers_size(), 0);
  EXPECT_FALSE(Daemon::Start({"--restore"}).ok());
}

TEST(CheckpointTest, RestoreRefusesACorruptNewestCheckpoint) {
  StateDir state;
  {
    MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start({state.Flag()}));
    MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
    CreateLayers(*c);
    MHC_ASSERT_OK(Save(*c, "latest"));
  }
  std::string bytes = ReadFile(state.File("latest"));
  WriteFile(state.File("latest"), bytes.substr(0, bytes.size() / 2));
  EXPECT_FALSE(Daemon::Start({state.Flag(), "--restore"}).ok());
  // The file is left for the operator to inspect.
  EXPECT_EQ(ReadFile(state.File("latest")), bytes.substr(0, bytes.size() / 2));
}

// A SIGKILL while a save streams its data (throttled, so the kill lands
// mid-write) leaves the previous checkpoint byte for byte, and a restart
// restores it and clears the temp file.
TEST(CheckpointTest, KillDuringWriteKeepsThePreviousCheckpoint) {
  StateDir state;
  constexpr int64_t kHidden = 2048;  // ~0.8 MB of parameters per layer
  Snapshot first;
  std::string first_bytes;
  {
    MHC_ASSERT_OK_AND_ASSIGN(
        auto daemon,
        Daemon::Start(
            {state.Flag(), "--checkpoint_write_bytes_per_second=1000000"}));
    MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
    CreateLayers(*c, kHidden);
    MHC_ASSERT_OK(Save(*c, "model", {}, /*gradients=*/true));
    first_bytes = ReadFile(state.File("model"));
    MHC_ASSERT_OK_AND_ASSIGN(first, Observe(*c));
    Scramble(*c, "minor");
    Scramble(*c, "plain");

    auto doomed = std::async(std::launch::async, [&] {
      return Save(*c, "model", {}, /*gradients=*/true);
    });
    // Each layer is written at once, then the throttle holds the save for
    // a second per MB: once the temp file holds more than the small first
    // layer ('head'), the save sleeps after 'minor' (~1.6 MB); kill then.
    std::string temp;
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (temp.empty() && absl::Now() < deadline) {
      std::error_code error;
      for (const auto& entry : fs::directory_iterator(state.path(), error)) {
        const std::string file = entry.path().filename().string();
        if (absl::StartsWith(file, ".tmp-") &&
            entry.file_size(error) > (uint64_t{1} << 20)) {
          temp = entry.path().string();
        }
      }
      absl::SleepFor(absl::Milliseconds(1));
    }
    ASSERT_FALSE(temp.empty()) << "no temp file with data appeared";
    ASSERT_EQ(doomed.wait_for(std::chrono::seconds(0)),
              std::future_status::timeout)
        << "the save finished before the kill";
    KillDaemon(*daemon);
    EXPECT_FALSE(doomed.get().ok());
    EXPECT_TRUE(fs::exists(temp));
    EXPECT_EQ(ReadFile(state.File("model")), first_bytes);
  }
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, StartRestored(state, "model"));
  MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot restored, Observe(*c));
  EXPECT_TRUE(restored == first);
  for (const auto& entry : fs::directory_iterator(state.path())) {
    EXPECT_FALSE(absl::StartsWith(entry.path().filename().string(), ".tmp-"))
        << entry.path() << " survived the restart";
  }
}

TEST(CheckpointTest, MhcctlSavesListsAndLoads) {
  StateDir state;
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start({state.Flag()}));
  MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
  CreateLayers(*c);
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot saved, Observe(*c));
  const std::string address = "--address=" + daemon->address();
  MHC_ASSERT_OK_AND_ASSIGN(
      auto save, RunCommand({MHC_MHCCTL_PATH, address, "checkpoint", "save",
                             "ctl", "--layers=minor,head", "--gradients"}));
  EXPECT_EQ(save.first, 0) << save.second;
  EXPECT_TRUE(absl::StrContains(save.second, "saved ctl: 2 layers"))
      << save.second;
  MHC_ASSERT_OK_AND_ASSIGN(
      auto list,
      RunCommand({MHC_MHCCTL_PATH, address, "--json", "checkpoint", "list"}));
  EXPECT_EQ(list.first, 0);
  EXPECT_TRUE(absl::StrContains(list.second, "\"name\":\"ctl\""))
      << list.second;
  Scramble(*c, "minor");
  MHC_ASSERT_OK_AND_ASSIGN(
      auto refused,
      RunCommand({MHC_MHCCTL_PATH, address, "checkpoint", "load", "ctl"}));
  EXPECT_EQ(refused.first, 1);
  MHC_ASSERT_OK_AND_ASSIGN(
      auto load, RunCommand({MHC_MHCCTL_PATH, address, "checkpoint", "load",
                             "ctl", "--replace"}));
  EXPECT_EQ(load.first, 0) << load.second;
  EXPECT_TRUE(absl::StrContains(load.second, "loaded ctl: head, minor"))
      << load.second;
  MHC_ASSERT_OK_AND_ASSIGN(auto params, c->GetParameters("minor"));
  EXPECT_EQ(Raw(params), saved.parameters["minor"]);
}

}  // namespace
}  // namespace mhc::testing
