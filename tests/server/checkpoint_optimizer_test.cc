// Checkpoints of training state over a real mhcd: the optimizer's
// algorithm, step and state tensors saved and loaded with the parameters,
// training that continues bit for bit after a load (into a fresh daemon or
// over the layers) or a --restore after a kill, saves without the state,
// and files whose state is inconsistent or over the daemon's parameter
// budget refused without side effects.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "checkpoint_test_util.h"
#include "gtest/gtest.h"
#include "server/checkpoint_format.h"
#include "server/crc32c.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

using client::ToTensorRef;

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
    KillDaemon(*daemon);
  }
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, StartRestored(state, "latest"));
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
    ExpectLoadRefused(*c, bad.name, bad.code, bad.message, before);
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
