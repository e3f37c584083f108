// OptimizerStep against a real mhcd: several steps over layers of several
// presets checked against the float64 reference, the optimizer state's
// lifecycle (step counter, algorithm lock, reset, layout conversion),
// determinism, validation and metrics.
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cpu/reference/reference_math.h"
#include "gtest/gtest.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

using client::HostTensor;
using client::ToTensorRef;

constexpr int64_t kTokens = 5;

// Accumulates gradients into `layer` through its backward op on random
// inputs drawn from `seed`.
void Backward(client::Client& client, const std::string& layer,
              const LayerSpec& spec, uint64_t seed) {
  const int64_t n = spec.n, c = spec.hidden;
  const std::vector<int64_t> x_shape =
      spec.layout == Layout::kStreamMinor ? std::vector<int64_t>{kTokens, c, n}
                                          : std::vector<int64_t>{kTokens, n, c};
  HostTensor x = client::RandomTensor(DType::kF32, x_shape, seed);
  HostTensor dy = client::RandomTensor(DType::kF32, {kTokens, c}, seed + 1);
  if (spec.kind == LayerKind::kHead) {
    v1::HeadBackwardRequest r;
    r.set_layer(layer);
    *r.mutable_x() = ToTensorRef(x);
    *r.mutable_dy() = ToTensorRef(dy);
    ASSERT_TRUE(client.HeadBackward(r).ok());
    return;
  }
  v1::PreBackwardRequest r;
  r.set_layer(layer);
  *r.mutable_x() = ToTensorRef(x);
  *r.mutable_dy() = ToTensorRef(dy);
  *r.mutable_dh_post() =
      ToTensorRef(client::RandomTensor(DType::kF32, {kTokens, n}, seed + 2));
  *r.mutable_dh_res() =
      ToTensorRef(client::RandomTensor(DType::kF32, {kTokens, n, n}, seed + 3));
  auto done = client.PreBackward(r);
  ASSERT_TRUE(done.ok()) << done.status();
}

// The layer's parameters (or gradients) as one block in ParameterLayout
// order.
std::vector<float> Block(client::Client& client, const std::string& layer,
                         const LayerSpec& spec, bool gradients) {
  v1::Parameters params;
  if (gradients) {
    auto grads = client.GetGradients(layer);
    EXPECT_TRUE(grads.ok()) << grads.status();
    if (grads.ok()) params = grads->gradients();
  } else {
    auto values = client.GetParameters(layer);
    EXPECT_TRUE(values.ok()) << values.status();
    if (values.ok()) params = *values;
  }
  std::vector<float> block(ParameterCount(spec));
  for (const ParameterSlot& slot : ParameterLayout(spec)) {
    auto it = params.tensors().find(slot.name);
    if (it == params.tensors().end()) {
      ADD_FAILURE() << layer << ": no " << slot.name;
      continue;
    }
    auto tensor = client::FromTensorRef(it->second);
    EXPECT_TRUE(tensor.ok()) << tensor.status();
    if (!tensor.ok()) continue;
    const std::vector<float> floats = tensor->ToFloats();
    std::copy(floats.begin(), floats.end(), block.begin() + slot.offset);
  }
  return block;
}

// One layer as the reference sees it.
struct RefLayer {
  std::string name;
  LayerSpec spec;
  std::vector<double> values;
  std::vector<double> slots;
};

class OptimizerServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MHC_ASSERT_OK_AND_ASSIGN(daemon_, Daemon::Start());
    MHC_ASSERT_OK_AND_ASSIGN(client_, daemon_->Connect());
    MHC_ASSERT_OK(client_->WaitForReady(absl::Seconds(10)));
  }

  // Layers of several presets and kinds, odd widths, random parameters.
  std::vector<RefLayer> CreateLayers(const std::string& prefix) {
    std::vector<RefLayer> layers;
    const std::vector<std::string>& presets = PresetNames();
    const struct {
      int n;
      int64_t hidden;
      bool head;
    } shapes[] = {{4, 37, false}, {3, 20, false}, {4, 9, true}};
    for (size_t i = 0; i < 3; ++i) {
      v1::CreateLayerRequest request =
          LayerRequest(absl::StrCat(prefix, i), shapes[i].n, shapes[i].hidden,
                       presets[i % presets.size()]);
      if (shapes[i].head) {
        request.mutable_spec()->set_kind(v1::LAYER_KIND_HEAD);
        request.mutable_spec()->set_dynamic(true);
      }
      auto host = CreateRandomLayer(*client_, request);
      EXPECT_TRUE(host.ok()) << host.status();
      auto info = client_->GetLayer(request.name());
      EXPECT_TRUE(info.ok());
      RefLayer layer;
      layer.name = request.name();
      layer.spec = *client::SpecFromProto(info->spec());
      const std::vector<float> values =
          Block(*client_, layer.name, layer.spec, false);
      layer.values.assign(values.begin(), values.end());
      layers.push_back(std::move(layer));
    }
    return layers;
  }

  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<client::Client> client_;
};

v1::OptimizerStepRequest StepRequest(const std::vector<RefLayer>& layers) {
  v1::OptimizerStepRequest r;
  for (const RefLayer& layer : layers) r.add_layers(layer.name);
  return r;
}

// Runs three steps of `request` over `layers`, each after a backward pass,
// and checks the daemon against the reference run on the same gradients.
void RunAgainstReference(client::Client& client, std::vector<RefLayer> layers,
                         const v1::OptimizerStepRequest& request) {
  OptimizerHyperparameters hyper;
  if (request.has_sgd()) {
    hyper.algorithm = OptimizerAlgorithm::kSgd;
    hyper.momentum = request.sgd().momentum();
    hyper.nesterov = request.sgd().nesterov();
    hyper.weight_decay = request.sgd().weight_decay();
  } else {
    hyper.algorithm = OptimizerAlgorithm::kAdamW;
    hyper.weight_decay = request.adamw().has_weight_decay()
                             ? request.adamw().weight_decay()
                             : 0.01f;
  }
  hyper.learning_rate = request.learning_rate();
  hyper.max_grad_norm = request.max_grad_norm();
  const int slots = OptimizerSlotCount(hyper.algorithm);
  for (RefLayer& layer : layers) {
    layer.slots.assign(slots * layer.values.size(), 0.0);
  }
  for (int step = 1; step <= 3; ++step) {
    std::vector<std::vector<double>> grads;
    double sum = 0.0;
    for (const RefLayer& layer : layers) {
      Backward(client, layer.name, layer.spec, FreshSeed());
      const std::vector<float> g =
          Block(client, layer.name, layer.spec, /*gradients=*/true);
      grads.emplace_back(g.begin(), g.end());
      sum += reference::SquaredNorm(grads.back().data(), g.size());
    }
    const double norm = std::sqrt(sum);
    const double scale = reference::ClipScale(norm, hyper.max_grad_norm);
    MHC_ASSERT_OK_AND_ASSIGN(v1::OptimizerStepResponse response,
                             client.OptimizerStep(request));
    if (hyper.max_grad_norm > 0.0f || request.compute_grad_norm()) {
      EXPECT_NEAR(response.grad_norm(), norm, 1e-12 * norm);
      EXPECT_NEAR(response.clip_coefficient(), scale, 1e-6 * scale);
    }
    ASSERT_EQ(response.layers_size(), static_cast<int>(layers.size()));
    for (size_t i = 0; i < layers.size(); ++i) {
      RefLayer& layer = layers[i];
      reference::OptimizerUpdate(hyper, step, scale, layer.values.size(),
                                 grads[i].data(), layer.values.data(),
                                 layer.slots.data());
      const v1::LayerInfo& info = response.layers(i);
      EXPECT_EQ(info.name(), layer.name);
      EXPECT_EQ(info.optimizer().step(), step);
      EXPECT_EQ(info.optimizer().algorithm(),
                OptimizerAlgorithmName(hyper.algorithm));
      EXPECT_EQ(info.gradient_tokens(), 0);
      const std::vector<float> got =
          Block(client, layer.name, layer.spec, /*gradients=*/false);
      for (size_t e = 0; e < got.size(); ++e) {
        const double want = layer.values[e];
        ASSERT_NEAR(got[e], want, 2e-6 * std::max(1.0, std::fabs(want)))
            << layer.name << " element " << e << " after step " << step;
      }
      const std::vector<float> zero =
          Block(client, layer.name, layer.spec, /*gradients=*/true);
      EXPECT_EQ(zero, std::vector<float>(zero.size(), 0.0f));
    }
  }
}

TEST_F(OptimizerServerTest, SgdNesterovWithClippingMatchesReference) {
  std::vector<RefLayer> layers = CreateLayers("sgd");
  v1::OptimizerStepRequest request = StepRequest(layers);
  request.set_learning_rate(0.05f);
  request.mutable_sgd()->set_momentum(0.9f);
  request.mutable_sgd()->set_nesterov(true);
  request.mutable_sgd()->set_weight_decay(0.01f);
  request.set_max_grad_norm(0.5f);
  request.set_zero_gradients(true);
  RunAgainstReference(*client_, layers, request);
}

TEST_F(OptimizerServerTest, AdamWMatchesReferenceWithAndWithoutClipping) {
  for (float clip : {0.0f, 0.25f}) {
    std::vector<RefLayer> layers =
        CreateLayers(clip > 0.0f ? "clipped" : "adamw");
    v1::OptimizerStepRequest request = StepRequest(layers);
    request.set_learning_rate(1e-2f);
    request.mutable_adamw()->set_weight_decay(0.1f);
    request.set_max_grad_norm(clip);
    request.set_compute_grad_norm(true);
    request.set_zero_gradients(true);
    RunAgainstReference(*client_, layers, request);
  }
}

TEST_F(OptimizerServerTest, StateLifecycle) {
  auto request = LayerRequest("life", 4, 16);
  MHC_ASSERT_OK_AND_ASSIGN(v1::LayerInfo created,
                           client_->CreateLayer(request));
  EXPECT_FALSE(created.has_optimizer());
  const LayerSpec spec = *client::SpecFromProto(created.spec());
  Backward(*client_, "life", spec, FreshSeed());

  v1::OptimizerStepRequest sgd;
  sgd.add_layers("life");
  sgd.set_learning_rate(0.1f);
  sgd.mutable_sgd()->set_momentum(0.5f);
  for (int step = 1; step <= 2; ++step) {
    MHC_ASSERT_OK_AND_ASSIGN(auto response, client_->OptimizerStep(sgd));
    EXPECT_EQ(response.layers(0).optimizer().algorithm(), "sgd");
    EXPECT_EQ(response.layers(0).optimizer().step(), step);
    EXPECT_EQ(response.layers(0).parameters_version(),
              created.parameters_version() + step);
    EXPECT_EQ(response.grad_norm(), 0.0) << "not asked for";
  }
  // Gradients stay without zero_gradients.
  MHC_ASSERT_OK_AND_ASSIGN(v1::LayerInfo info, client_->GetLayer("life"));
  EXPECT_EQ(info.gradient_tokens(), kTokens);
  EXPECT_EQ(info.optimizer().step(), 2);

  // Another algorithm: refused, and nothing changes.
  const std::vector<float> before = Block(*client_, "life", spec, false);
  v1::OptimizerStepRequest adamw;
  adamw.add_layers("life");
  adamw.set_learning_rate(0.1f);
  adamw.mutable_adamw();
  auto refused = client_->OptimizerStep(adamw);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("reset_state"), std::string::npos)
      << refused.status();
  EXPECT_EQ(Block(*client_, "life", spec, false), before);
  MHC_ASSERT_OK_AND_ASSIGN(info, client_->GetLayer("life"));
  EXPECT_EQ(info.parameters_version(), created.parameters_version() + 2);

  // reset_state starts the new algorithm at step 1.
  adamw.set_reset_state(true);
  MHC_ASSERT_OK_AND_ASSIGN(auto reset, client_->OptimizerStep(adamw));
  EXPECT_EQ(reset.layers(0).optimizer().algorithm(), "adamw");
  EXPECT_EQ(reset.layers(0).optimizer().step(), 1);
  EXPECT_NE(Block(*client_, "life", spec, false), before);

  // The state goes with the layer.
  MHC_ASSERT_OK(client_->DeleteLayer("life").status());
  MHC_ASSERT_OK_AND_ASSIGN(created, client_->CreateLayer(request));
  EXPECT_FALSE(created.has_optimizer());
}

// Two identical layers stepped with identical gradients end bitwise equal,
// also when one went to the other layout and back between steps (the
// state follows the columns).
TEST_F(OptimizerServerTest, DeterministicAndKeptThroughConvertLayout) {
  for (const char* name : {"twin_a", "twin_b"}) {
    MHC_ASSERT_OK(client_->CreateLayer(LayerRequest(name, 4, 24)).status());
  }
  MHC_ASSERT_OK_AND_ASSIGN(v1::LayerInfo info, client_->GetLayer("twin_a"));
  const LayerSpec spec = *client::SpecFromProto(info.spec());
  for (int step = 1; step <= 3; ++step) {
    const uint64_t seed = FreshSeed();
    for (const char* name : {"twin_a", "twin_b"}) {
      Backward(*client_, name, spec, seed);
      v1::OptimizerStepRequest r;
      r.add_layers(name);
      r.set_learning_rate(1e-2f);
      r.mutable_adamw();
      r.set_max_grad_norm(0.1f);
      r.set_zero_gradients(true);
      MHC_ASSERT_OK_AND_ASSIGN(auto response, client_->OptimizerStep(r));
      EXPECT_GT(response.grad_norm(), 0.0);
    }
    EXPECT_EQ(Block(*client_, "twin_a", spec, false),
              Block(*client_, "twin_b", spec, false))
        << "step " << step;
    if (step == 1) {
      MHC_ASSERT_OK(
          client_->ConvertLayout("twin_b", v1::LAYOUT_STREAM_MINOR).status());
      MHC_ASSERT_OK_AND_ASSIGN(
          info, client_->ConvertLayout("twin_b", v1::LAYOUT_STREAM_MAJOR));
      EXPECT_EQ(info.optimizer().step(), 1);
      EXPECT_EQ(info.optimizer().algorithm(), "adamw");
    }
  }
}

TEST_F(OptimizerServerTest, ValidationNamesTheField) {
  MHC_ASSERT_OK(client_->CreateLayer(LayerRequest("v", 4, 8)).status());
  auto expect = [&](const v1::OptimizerStepRequest& r, absl::StatusCode code,
                    const std::string& field) {
    auto status = client_->OptimizerStep(r).status();
    EXPECT_EQ(status.code(), code) << field << ": " << status;
    EXPECT_NE(status.message().find(field), std::string::npos) << status;
  };
  v1::OptimizerStepRequest good;
  good.add_layers("v");
  good.set_learning_rate(0.1f);
  good.mutable_sgd();
  MHC_ASSERT_OK(client_->OptimizerStep(good).status());

  const auto invalid = absl::StatusCode::kInvalidArgument;
  v1::OptimizerStepRequest r = good;
  r.clear_layers();
  expect(r, invalid, "layers");
  r = good;
  r.add_layers("v");
  expect(r, invalid, "layers[1]");
  r = good;
  r.add_layers("missing");
  expect(r, absl::StatusCode::kNotFound, "layers[1]");
  r = good;
  r.clear_sgd();
  expect(r, invalid, "algorithm");
  r = good;
  r.set_learning_rate(-1.0f);
  expect(r, invalid, "learning_rate");
  r = good;
  r.set_learning_rate(NAN);
  expect(r, invalid, "learning_rate");
  r = good;
  r.set_max_grad_norm(INFINITY);
  expect(r, invalid, "max_grad_norm");
  r = good;
  r.mutable_sgd()->set_momentum(1.5f);
  expect(r, invalid, "sgd.momentum");
  r = good;
  r.mutable_sgd()->set_nesterov(true);
  expect(r, invalid, "sgd.nesterov");
  r = good;
  r.mutable_sgd()->set_weight_decay(-0.5f);
  expect(r, invalid, "sgd.weight_decay");
  r = good;
  r.set_reset_state(true);
  r.mutable_adamw()->set_beta1(1.0f);
  expect(r, invalid, "adamw.beta1");
  r.mutable_adamw()->set_beta1(0.9f);
  r.mutable_adamw()->set_beta2(-0.1f);
  expect(r, invalid, "adamw.beta2");
  r.mutable_adamw()->set_beta2(0.99f);
  r.mutable_adamw()->set_epsilon(0.0f);
  expect(r, invalid, "adamw.epsilon");
  // Nothing above took a step.
  MHC_ASSERT_OK_AND_ASSIGN(v1::LayerInfo info, client_->GetLayer("v"));
  EXPECT_EQ(info.optimizer().algorithm(), "sgd");
  EXPECT_EQ(info.optimizer().step(), 1);
}

TEST_F(OptimizerServerTest, Metrics) {
  MHC_ASSERT_OK(client_->CreateLayer(LayerRequest("m", 4, 8)).status());
  MHC_ASSERT_OK_AND_ASSIGN(
      std::string before,
      HttpGet(daemon_->metrics_host(), daemon_->metrics_port(), "/metrics"));
  EXPECT_EQ(MetricSample(before, "mhcd_optimizer_steps_total",
                         {"algorithm=\"adamw\"", "device=\"cpu\""}),
            0);
  v1::OptimizerStepRequest r;
  r.add_layers("m");
  r.set_learning_rate(1e-3f);
  r.mutable_adamw();
  for (int i = 0; i < 2; ++i) MHC_ASSERT_OK(client_->OptimizerStep(r).status());
  MHC_ASSERT_OK_AND_ASSIGN(
      std::string after,
      HttpGet(daemon_->metrics_host(), daemon_->metrics_port(), "/metrics"));
  EXPECT_EQ(MetricSample(after, "mhcd_optimizer_steps_total",
                         {"algorithm=\"adamw\"", "device=\"cpu\""}),
            2);
  EXPECT_EQ(MetricSample(after, "mhcd_optimizer_step_duration_seconds_count",
                         {"algorithm=\"adamw\""}),
            2);
  MHC_ASSERT_OK_AND_ASSIGN(v1::LayerInfo info, client_->GetLayer("m"));
  EXPECT_EQ(
      MetricSample(after, "mhcd_optimizer_state_bytes", {"device=\"cpu\""}),
      2.0 * info.parameter_count() * sizeof(float));
}

}  // namespace
}  // namespace mhc::testing
