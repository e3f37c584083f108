// Checkpoints over a real mhcd: bitwise round trips (parameters, gradients,
// optimizer state, selected layers), training that continues bit for bit
// after a load or a --restore, refusal of corrupt, truncated, foreign,
// clashing and inconsistent files without side effects, names that would
// leave --state_dir, a SIGKILL in the middle of a write, and --restore after
// a kill.
#include <signal.h>

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
#include "gtest/gtest.h"
#include "server/checkpoint_format.h"
#include "server/crc32c.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

namespace fs = std::filesystem;
using client::ToTensorRef;

// A directory for --state_dir that outlives the daemons of one test.
class StateDir {
 public:
  StateDir() {
    char dir[] = "/tmp/mhcd-state-XXXXXX";
    path_ = mkdtemp(dir) != nullptr ? dir : "";
  }
  ~StateDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }
  std::string Flag() const { return "--state_dir=" + path_; }
  std::string File(const std::string& name) const {
    return path_ + "/" + name + ".safetensors";
  }

 private:
  std::string path_;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// Parameters as name -> (shape, raw bytes): equal means bitwise equal.
using RawTensors =
    std::map<std::string, std::pair<std::vector<int64_t>, std::string>>;

RawTensors Raw(const v1::Parameters& parameters) {
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

absl::StatusOr<Snapshot> Observe(client::Client& c) {
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

absl::Status Save(client::Client& c, const std::string& name,
                  std::vector<std::string> layers = {}, bool gradients = false,
                  bool optimizer = true) {
  v1::SaveCheckpointRequest r;
  r.set_name(name);
  for (const auto& layer : layers) r.add_layers(layer);
  r.set_include_gradients(gradients);
  r.set_skip_optimizer_state(!optimizer);
  return c.SaveCheckpoint(r).status();
}

absl::Status Load(client::Client& c, const std::string& name,
                  bool replace = false, std::vector<std::string> layers = {}) {
  v1::LoadCheckpointRequest r;
  r.set_name(name);
  r.set_replace(replace);
  for (const auto& layer : layers) r.add_layers(layer);
  return c.LoadCheckpoint(r).status();
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
    // With replace, a load that got through would change every layer.
    absl::Status status = Load(*c, bad.name, /*replace=*/true);
    EXPECT_EQ(status.code(), bad.code) << bad.name << ": " << status;
    EXPECT_TRUE(absl::StrContains(status.message(), bad.message))
        << bad.name << ": " << status;
    MHC_ASSERT_OK_AND_ASSIGN(Snapshot after, Observe(*c));
    EXPECT_TRUE(after == before) << bad.name << " changed the daemon";
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
    daemon->Signal(SIGKILL);
    MHC_ASSERT_OK_AND_ASSIGN(int code, daemon->Wait(absl::Seconds(10)));
    EXPECT_EQ(code, 128 + SIGKILL);
  }
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon,
                           Daemon::Start({state.Flag(), "--restore"}));
  EXPECT_TRUE(absl::StrContains(daemon->Stdout(),
                                "mhcd: restored checkpoint 'latest'"));
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
    daemon->Signal(SIGKILL);
    MHC_ASSERT_OK_AND_ASSIGN(int code, daemon->Wait(absl::Seconds(10)));
    EXPECT_EQ(code, 128 + SIGKILL);
    EXPECT_FALSE(doomed.get().ok());
    EXPECT_TRUE(fs::exists(temp));
    EXPECT_EQ(ReadFile(state.File("model")), first_bytes);
  }
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon,
                           Daemon::Start({state.Flag(), "--restore"}));
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

// A checkpoint file taken apart, to inspect its tensors or forge variants.
struct CheckpointFile {
  server::CheckpointHeader header;
  std::string data;  // the tensor data after the header
};

absl::StatusOr<CheckpointFile> ParseCheckpoint(const std::string& path) {
  const std::string bytes = ReadFile(path);
  uint64_t size = 0;
  for (int i = 0; i < 8 && i < static_cast<int>(bytes.size()); ++i) {
    size |= uint64_t{static_cast<uint8_t>(bytes[i])} << (8 * i);
  }
  if (bytes.size() < 8 || bytes.size() - 8 < size) {
    return absl::DataLossError(absl::StrCat(path, ": truncated"));
  }
  CheckpointFile file;
  file.data = bytes.substr(8 + size);
  MHC_ASSIGN_OR_RETURN(
      file.header,
      server::DecodeCheckpointHeader(absl::string_view(bytes).substr(8, size),
                                     file.data.size()));
  return file;
}

void WriteCheckpoint(const std::string& path, const CheckpointFile& file) {
  auto json = server::EncodeCheckpointHeader(file.header);
  ASSERT_TRUE(json.ok()) << json.status();
  std::string prefix(8, '\0');
  for (int i = 0; i < 8; ++i) {
    prefix[i] = static_cast<char>((json->size() >> (8 * i)) & 0xFF);
  }
  WriteFile(path, prefix + *json + file.data);
}

// Name -> bytes of the file's optimizer state tensors.
std::map<std::string, std::string> OptimizerTensors(const std::string& path) {
  std::map<std::string, std::string> out;
  auto file = ParseCheckpoint(path);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return out;
  for (const auto& [name, tensor] : file->header.tensors) {
    if (!absl::StrContains(name, "/optim/")) continue;
    out[name] = file->data.substr(tensor.begin, tensor.end - tensor.begin);
  }
  return out;
}

// The layers the optimizer tests train: one per algorithm.
struct TrainedLayer {
  const char* name;
  int n;
  int64_t hidden;
  bool adamw;
};
constexpr TrainedLayer kTrained[] = {{"adam", 3, 24, true},
                                     {"momentum", 4, 40, false}};

void CreateTrainedLayers(client::Client& c) {
  for (const TrainedLayer& t : kTrained) {
    v1::CreateLayerRequest request = LayerRequest(t.name, t.n, t.hidden);
    request.mutable_spec()->set_layout(v1::LAYOUT_STREAM_MAJOR);
    request.mutable_spec()->set_has_gamma(t.adamw);
    auto created = CreateRandomLayer(c, request);
    ASSERT_TRUE(created.ok()) << created.status();
  }
}

// Training step `step` of every trained layer: a backward pass on inputs
// drawn from the step's seeds (the same gradients on every daemon), then
// the layer's optimizer step, clipped, gradients zeroed.
void TrainStep(client::Client& c, int step) {
  constexpr int64_t kTokens = 5;
  for (size_t i = 0; i < std::size(kTrained); ++i) {
    const TrainedLayer& t = kTrained[i];
    const uint64_t seed = 1000 * static_cast<uint64_t>(step) + 10 * i;
    v1::PreBackwardRequest backward;
    backward.set_layer(t.name);
    *backward.mutable_x() = ToTensorRef(
        client::RandomTensor(DType::kF32, {kTokens, t.n, t.hidden}, seed));
    *backward.mutable_dy() = ToTensorRef(
        client::RandomTensor(DType::kF32, {kTokens, t.hidden}, seed + 1));
    *backward.mutable_dh_post() = ToTensorRef(
        client::RandomTensor(DType::kF32, {kTokens, t.n}, seed + 2));
    *backward.mutable_dh_res() = ToTensorRef(
        client::RandomTensor(DType::kF32, {kTokens, t.n, t.n}, seed + 3));
    auto gradients = c.PreBackward(backward);
    ASSERT_TRUE(gradients.ok()) << gradients.status();

    v1::OptimizerStepRequest r;
    r.add_layers(t.name);
    r.set_zero_gradients(true);
    r.set_max_grad_norm(0.5f);
    if (t.adamw) {
      r.set_learning_rate(0.01f);
      r.mutable_adamw()->set_beta1(0.8f);
      r.mutable_adamw()->set_weight_decay(0.1f);
    } else {
      r.set_learning_rate(0.05f);
      r.mutable_sgd()->set_momentum(0.9f);
      r.mutable_sgd()->set_nesterov(true);
      r.mutable_sgd()->set_weight_decay(0.01f);
    }
    auto stepped = c.OptimizerStep(r);
    ASSERT_TRUE(stepped.ok()) << stepped.status();
  }
}

// Each trained layer reports its algorithm and `step`.
void ExpectOptimizer(client::Client& c, int64_t step) {
  for (const TrainedLayer& t : kTrained) {
    MHC_ASSERT_OK_AND_ASSIGN(v1::LayerInfo info, c.GetLayer(t.name));
    EXPECT_EQ(info.optimizer().algorithm(), t.adamw ? "adamw" : "sgd")
        << t.name;
    EXPECT_EQ(info.optimizer().step(), step) << t.name;
  }
}

// Three steps, a save, a fourth step; the checkpoint loaded elsewhere (a
// fresh daemon) or over the layers (replace) takes the same fourth step to
// the same bits: parameters, counters and optimizer state.
TEST(CheckpointTest, TrainingContinuesBitForBitAfterALoad) {
  StateDir state;
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start({state.Flag()}));
  MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
  CreateTrainedLayers(*c);
  for (int step = 1; step <= 3; ++step) TrainStep(*c, step);
  MHC_ASSERT_OK(Save(*c, "step3"));
  TrainStep(*c, 4);
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot original, Observe(*c));
  MHC_ASSERT_OK(Save(*c, "original4"));

  MHC_ASSERT_OK_AND_ASSIGN(CheckpointFile step3,
                           ParseCheckpoint(state.File("step3")));
  ASSERT_EQ(step3.header.manifest.layers_size(), 2);
  for (const v1::CheckpointLayer& record : step3.header.manifest.layers()) {
    ASSERT_TRUE(record.has_optimizer()) << record.name();
    EXPECT_EQ(record.optimizer().step(), 3);
    const bool adamw = record.name() == "adam";
    EXPECT_EQ(record.optimizer().algorithm(), adamw ? "adamw" : "sgd");
    const std::vector<std::string> want =
        adamw ? std::vector<std::string>{"exp_avg", "exp_avg_sq"}
              : std::vector<std::string>{"momentum_buffer"};
    EXPECT_EQ(std::vector<std::string>(record.optimizer().slots().begin(),
                                       record.optimizer().slots().end()),
              want);
  }
  const auto saved_state = OptimizerTensors(state.File("step3"));
  const auto original_state = OptimizerTensors(state.File("original4"));
  ASSERT_FALSE(original_state.empty());
  // The fourth step moved the state, so equal state below is not a given.
  EXPECT_NE(saved_state, original_state);

  MHC_ASSERT_OK_AND_ASSIGN(auto second, Daemon::Start({state.Flag()}));
  MHC_ASSERT_OK_AND_ASSIGN(auto c2, second->Connect());
  MHC_ASSERT_OK(Load(*c2, "step3"));
  ExpectOptimizer(*c2, 3);
  TrainStep(*c2, 4);
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot resumed, Observe(*c2));
  EXPECT_TRUE(resumed == original);
  EXPECT_EQ(resumed.parameters, original.parameters);
  MHC_ASSERT_OK(Save(*c2, "resumed4"));
  EXPECT_EQ(OptimizerTensors(state.File("resumed4")), original_state);

  // Over the original's layers: back to step 3, and the same fourth step.
  MHC_ASSERT_OK(Load(*c, "step3", /*replace=*/true));
  ExpectOptimizer(*c, 3);
  TrainStep(*c, 4);
  ExpectOptimizer(*c, 4);
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot replaced, Observe(*c));
  EXPECT_EQ(replaced.parameters, original.parameters);
  MHC_ASSERT_OK(Save(*c, "replaced4"));
  EXPECT_EQ(OptimizerTensors(state.File("replaced4")), original_state);
}

TEST(CheckpointTest, RestoreKeepsAlgorithmAndStep) {
  StateDir state;
  Snapshot step4, step5;
  {
    MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start({state.Flag()}));
    MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
    CreateTrainedLayers(*c);
    for (int step = 1; step <= 3; ++step) TrainStep(*c, step);
    MHC_ASSERT_OK(Save(*c, "latest"));
    TrainStep(*c, 4);
    MHC_ASSERT_OK_AND_ASSIGN(step4, Observe(*c));
    TrainStep(*c, 5);
    MHC_ASSERT_OK_AND_ASSIGN(step5, Observe(*c));
    daemon->Signal(SIGKILL);
    MHC_ASSERT_OK_AND_ASSIGN(int code, daemon->Wait(absl::Seconds(10)));
    EXPECT_EQ(code, 128 + SIGKILL);
  }
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon,
                           Daemon::Start({state.Flag(), "--restore"}));
  EXPECT_TRUE(absl::StrContains(daemon->Stdout(),
                                "mhcd: restored checkpoint 'latest'"));
  MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
  ExpectOptimizer(*c, 3);
  // Step 5 depends on the state step 4 left, so it checks that too.
  TrainStep(*c, 4);
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot restored4, Observe(*c));
  EXPECT_TRUE(restored4 == step4);
  TrainStep(*c, 5);
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot restored5, Observe(*c));
  EXPECT_TRUE(restored5 == step5);
  ExpectOptimizer(*c, 5);
}

TEST(CheckpointTest, SkipOptimizerStateSavesNone) {
  StateDir state;
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start({state.Flag()}));
  MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
  CreateTrainedLayers(*c);
  TrainStep(*c, 1);
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot saved, Observe(*c));
  MHC_ASSERT_OK(Save(*c, "with"));
  MHC_ASSERT_OK(Save(*c, "without", {}, false, /*optimizer=*/false));
  // adamw keeps two slots, sgd one, each the size of the parameters.
  EXPECT_EQ(OptimizerTensors(state.File("with")).size(),
            2 * saved.parameters["adam"].size() +
                saved.parameters["momentum"].size());
  EXPECT_TRUE(OptimizerTensors(state.File("without")).empty());
  MHC_ASSERT_OK_AND_ASSIGN(CheckpointFile without,
                           ParseCheckpoint(state.File("without")));
  for (const v1::CheckpointLayer& record : without.header.manifest.layers()) {
    EXPECT_FALSE(record.has_optimizer()) << record.name();
  }

  MHC_ASSERT_OK_AND_ASSIGN(auto second, Daemon::Start({state.Flag()}));
  MHC_ASSERT_OK_AND_ASSIGN(auto c2, second->Connect());
  MHC_ASSERT_OK(Load(*c2, "without"));
  for (const TrainedLayer& t : kTrained) {
    MHC_ASSERT_OK_AND_ASSIGN(v1::LayerInfo info, c2->GetLayer(t.name));
    EXPECT_FALSE(info.has_optimizer()) << t.name;
  }
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot loaded, Observe(*c2));
  EXPECT_EQ(loaded.parameters, saved.parameters);
  // Training starts over: fresh state, step 1.
  TrainStep(*c2, 2);
  ExpectOptimizer(*c2, 1);
}

// Optimizer state that does not fit its algorithm, or whose tensors are
// missing or of the wrong size, is refused with a message that says so,
// and the daemon keeps its layers and their state.
TEST(CheckpointTest, InconsistentOptimizerStateChangesNothing) {
  StateDir state;
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start({state.Flag()}));
  MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
  CreateTrainedLayers(*c);
  for (int step = 1; step <= 3; ++step) TrainStep(*c, step);
  MHC_ASSERT_OK(Save(*c, "good"));
  // The daemon moves on, so any load that got through would show.
  TrainStep(*c, 4);
  MHC_ASSERT_OK_AND_ASSIGN(Snapshot before, Observe(*c));
  MHC_ASSERT_OK(Save(*c, "before"));
  const auto state_before = OptimizerTensors(state.File("before"));
  MHC_ASSERT_OK_AND_ASSIGN(const CheckpointFile good,
                           ParseCheckpoint(state.File("good")));
  // The good file loads (then the daemon goes back to `before`).
  MHC_ASSERT_OK(Load(*c, "good", /*replace=*/true));
  MHC_ASSERT_OK(Load(*c, "before", /*replace=*/true));
  MHC_ASSERT_OK_AND_ASSIGN(before, Observe(*c));

  auto record = [](CheckpointFile& file, const std::string& name) {
    for (v1::CheckpointLayer& r : *file.header.manifest.mutable_layers()) {
      if (r.name() == name) return &r;
    }
    ADD_FAILURE() << "no layer " << name;
    return file.header.manifest.mutable_layers(0);
  };
  auto rename = [](CheckpointFile& file, const std::string& from,
                   const std::string& to) {
    auto node = file.header.tensors.extract(from);
    ASSERT_FALSE(node.empty()) << from;
    node.key() = to;
    file.header.tensors.insert(std::move(node));
  };
  const std::string first = good.header.manifest.layers(0).parameters(0);
  ASSERT_EQ(good.header.manifest.layers(0).name(), "adam");
  const std::string exp_avg_sq =
      server::CheckpointTensorName("adam", "optim/exp_avg_sq", first);

  const struct {
    const char* name;
    std::function<void(CheckpointFile&)> forge;
    absl::StatusCode code;
    const char* message;
  } cases[] = {
      {"wrong_slot",
       [&](CheckpointFile& f) {
         record(f, "adam")->mutable_optimizer()->set_slots(1,
                                                           "momentum_buffer");
         for (const std::string& p : record(f, "adam")->parameters()) {
           rename(f,
                  server::CheckpointTensorName("adam", "optim/exp_avg_sq", p),
                  server::CheckpointTensorName("adam", "optim/momentum_buffer",
                                               p));
         }
       },
       absl::StatusCode::kDataLoss,
       "slots (exp_avg, momentum_buffer) but adamw keeps (exp_avg, "
       "exp_avg_sq)"},
      {"missing_slot",
       [&](CheckpointFile& f) {
         record(f, "adam")->mutable_optimizer()->mutable_slots()->RemoveLast();
       },
       absl::StatusCode::kDataLoss, "slots (exp_avg) but adamw keeps"},
      {"twice",
       [&](CheckpointFile& f) {
         record(f, "momentum")
             ->mutable_optimizer()
             ->add_slots("momentum_buffer");
       },
       absl::StatusCode::kDataLoss,
       "slots (momentum_buffer, momentum_buffer) but sgd keeps"},
      {"other_algorithm",
       [&](CheckpointFile& f) {
         record(f, "momentum")->mutable_optimizer()->set_algorithm("adamw");
       },
       absl::StatusCode::kDataLoss, "adamw keeps (exp_avg, exp_avg_sq)"},
      {"unknown_algorithm",
       [&](CheckpointFile& f) {
         record(f, "adam")->mutable_optimizer()->set_algorithm("lion");
       },
       absl::StatusCode::kFailedPrecondition, "algorithm 'lion'"},
      {"negative_step",
       [&](CheckpointFile& f) {
         record(f, "adam")->mutable_optimizer()->set_step(-1);
       },
       absl::StatusCode::kDataLoss, "step -1"},
      {"missing_tensor",
       [&](CheckpointFile& f) { rename(f, exp_avg_sq, exp_avg_sq + "_"); },
       absl::StatusCode::kDataLoss, "lacks tensor 'adam/optim/exp_avg_sq/"},
      {"short_tensor",
       [&](CheckpointFile& f) {
         server::CheckpointTensor& t = f.header.tensors[exp_avg_sq];
         int64_t elements = 1;
         for (int64_t d : t.shape) elements *= d;
         t.shape = {elements - 1};
         t.end -= 4;
         t.crc32c = server::Crc32c(0, f.data.data() + t.begin, t.end - t.begin);
       },
       absl::StatusCode::kDataLoss, "its spec needs"},
  };
  for (const auto& bad : cases) {
    CheckpointFile forged = good;
    bad.forge(forged);
    WriteCheckpoint(state.File(bad.name), forged);
    absl::Status status = Load(*c, bad.name, /*replace=*/true);
    EXPECT_EQ(status.code(), bad.code) << bad.name << ": " << status;
    EXPECT_TRUE(absl::StrContains(status.message(), bad.message))
        << bad.name << ": " << status;
    MHC_ASSERT_OK_AND_ASSIGN(Snapshot after, Observe(*c));
    EXPECT_TRUE(after == before) << bad.name << " changed the daemon";
  }
  MHC_ASSERT_OK(Save(*c, "after"));
  EXPECT_EQ(OptimizerTensors(state.File("after")), state_before);
}

// --max_parameter_bytes holds the optimizer state a load brings, and the
// store counts only parameters and gradients once the layers are in (as
// for OptimizerStep's state), so that deleting them gives everything back.
TEST(CheckpointTest, LoadCountsOptimizerStateAgainstTheBudget) {
  StateDir state;
  uint64_t block = 0;  // bytes of one copy of the parameters
  {
    MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start({state.Flag()}));
    MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
    CreateTrainedLayers(*c);
    TrainStep(*c, 1);
    MHC_ASSERT_OK(Save(*c, "with", {"adam"}));
    MHC_ASSERT_OK(Save(*c, "without", {"adam"}, false, /*optimizer=*/false));
    MHC_ASSERT_OK_AND_ASSIGN(v1::LayerInfo info, c->GetLayer("adam"));
    block = static_cast<uint64_t>(info.parameter_count()) * sizeof(float);
  }
  // Parameters and gradients take about 2 blocks, adamw's state 2 more.
  MHC_ASSERT_OK_AND_ASSIGN(
      auto tight,
      Daemon::Start(
          {state.Flag(), absl::StrCat("--max_parameter_bytes=", 3 * block)}));
  MHC_ASSERT_OK_AND_ASSIGN(auto ct, tight->Connect());
  absl::Status refused = Load(*ct, "with");
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "optimizer state"))
      << refused;
  MHC_ASSERT_OK_AND_ASSIGN(auto none, ct->ListLayers());
  EXPECT_EQ(none.layers_size(), 0);
  MHC_ASSERT_OK(Load(*ct, "without"));

  MHC_ASSERT_OK_AND_ASSIGN(
      auto roomy,
      Daemon::Start(
          {state.Flag(), absl::StrCat("--max_parameter_bytes=", 5 * block)}));
  MHC_ASSERT_OK_AND_ASSIGN(auto cr, roomy->Connect());
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    MHC_ASSERT_OK(Load(*cr, "with"));
    MHC_ASSERT_OK(cr->DeleteLayer("adam").status());
  }
}

}  // namespace
}  // namespace mhc::testing
