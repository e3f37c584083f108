// A table of malformed requests, each with the exact gRPC code it must get.
// Afterwards the daemon still serves and the layer's parameters and gradients
// are byte-for-byte what they were.
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

using client::HostTensor;
using client::ToTensorRef;
using client::Zeros;

constexpr int kN = 4;
constexpr int64_t kC = 8;

struct BadRequest {
  std::string name;
  absl::StatusCode code;
  std::function<absl::Status(client::Client&)> call;
};

v1::TensorRef X(int64_t m, DType dtype = DType::kBF16) {
  return ToTensorRef(client::RandomTensor(dtype, {m, kN, kC}, FreshSeed()));
}

v1::PreRequest PreOf(const std::string& layer, v1::TensorRef x) {
  v1::PreRequest r;
  r.set_layer(layer);
  *r.mutable_x() = std::move(x);
  return r;
}

absl::Status Pre(client::Client& c, const v1::PreRequest& r) {
  return c.Pre(r).status();
}

v1::CreateLayerRequest Create(const std::string& name,
                              std::function<void(v1::LayerSpec&)> edit = {}) {
  v1::CreateLayerRequest r = LayerRequest(name, kN, kC);
  if (edit) edit(*r.mutable_spec());
  return r;
}

v1::PostRequest ValidPost(int64_t m) {
  v1::PostRequest r;
  r.set_layer("base");
  *r.mutable_f() = ToTensorRef(client::RandomTensor(DType::kBF16, {m, kC}, 1));
  *r.mutable_x() = X(m);
  *r.mutable_h_post() = ToTensorRef(RandomF32({m, kN}));
  *r.mutable_h_res() = ToTensorRef(RandomF32({m, kN, kN}));
  return r;
}

v1::Op ExpandOp(const std::string& id, v1::TensorRef e) {
  v1::Op op;
  op.set_id(id);
  op.mutable_expand()->set_layer("base");
  *op.mutable_expand()->mutable_e() = std::move(e);
  return op;
}

v1::TensorRef E(int64_t m) {
  return ToTensorRef(client::RandomTensor(DType::kBF16, {m, kC}, FreshSeed()));
}

std::vector<BadRequest> Table() {
  using Code = absl::StatusCode;
  std::vector<BadRequest> t;
  auto create = [](v1::CreateLayerRequest r) {
    return [r](client::Client& c) { return c.CreateLayer(r).status(); };
  };
  // Layers.
  t.push_back({"GetLayer unknown", Code::kNotFound,
               [](client::Client& c) { return c.GetLayer("nope").status(); }});
  t.push_back({"DeleteLayer unknown", Code::kNotFound, [](client::Client& c) {
                 return c.DeleteLayer("nope").status();
               }});
  t.push_back({"duplicate name", Code::kAlreadyExists, create(Create("base"))});
  t.push_back(
      {"bad name chars", Code::kInvalidArgument, create(Create("a b/c"))});
  t.push_back({"empty name", Code::kInvalidArgument, create(Create(""))});
  for (const char* name : {".", "..", ".hidden", "-flag", "_x"}) {
    t.push_back({absl::StrCat("name '", name, "'"), Code::kInvalidArgument,
                 create(Create(name))});
  }
  t.push_back({"name of 129 chars", Code::kInvalidArgument,
               create(Create(std::string(129, 'a')))});
  t.push_back({"n = 17", Code::kInvalidArgument,
               create(Create("n17", [](v1::LayerSpec& s) { s.set_n(17); }))});
  t.push_back({"n = -1", Code::kInvalidArgument,
               create(Create("nneg", [](v1::LayerSpec& s) { s.set_n(-1); }))});
  t.push_back(
      {"hidden 0", Code::kInvalidArgument,
       create(Create("h0", [](v1::LayerSpec& s) { s.set_hidden(0); }))});
  t.push_back({"T = 0", Code::kInvalidArgument,
               create(Create("t0", [](v1::LayerSpec& s) {
                 s.set_sinkhorn_iterations(0);
               }))});
  t.push_back({"T = 1001", Code::kInvalidArgument,
               create(Create("t1001", [](v1::LayerSpec& s) {
                 s.set_sinkhorn_iterations(1001);
               }))});
  t.push_back(
      {"negative eps_rms", Code::kInvalidArgument,
       create(Create("eps", [](v1::LayerSpec& s) { s.set_eps_rms(-1e-6f); }))});
  t.push_back({"unknown enum value", Code::kInvalidArgument,
               create(Create("enum", [](v1::LayerSpec& s) {
                 s.set_layout(static_cast<v1::Layout>(7));
               }))});
  {
    v1::CreateLayerRequest r = Create("preset");
    r.set_preset("gpt5");
    t.push_back({"unknown preset", Code::kInvalidArgument, create(r)});
  }
  {
    v1::CreateLayerRequest r = Create("badinit");
    (*r.mutable_parameters()->mutable_tensors())["phi"] =
        ToTensorRef(RandomF32({3, 3}));
    t.push_back({"CreateLayer with wrong parameter shapes",
                 Code::kInvalidArgument, create(r)});
  }
  // Tensors.
  t.push_back({"unknown layer in Pre", Code::kNotFound,
               [](client::Client& c) { return Pre(c, PreOf("nope", X(2))); }});
  {
    v1::TensorRef x = X(2);
    x.set_dtype(v1::DTYPE_UNSPECIFIED);
    t.push_back(
        {"dtype unspecified", Code::kInvalidArgument,
         [r = PreOf("base", x)](client::Client& c) { return Pre(c, r); }});
  }
  {
    v1::TensorRef x = X(2);
    x.clear_shape();
    x.add_shape(2 * kN * kC);
    t.push_back(
        {"rank wrong", Code::kInvalidArgument,
         [r = PreOf("base", x)](client::Client& c) { return Pre(c, r); }});
  }
  {
    v1::TensorRef x = X(2);
    x.set_shape(2, kC + 1);
    x.mutable_inline_data()->resize(2 * kN * (kC + 1) * 2);
    t.push_back(
        {"shape does not match the spec", Code::kInvalidArgument,
         [r = PreOf("base", x)](client::Client& c) { return Pre(c, r); }});
  }
  {
    v1::TensorRef x = X(2);
    x.mutable_inline_data()->push_back('\0');
    t.push_back(
        {"byte length off by one", Code::kInvalidArgument,
         [r = PreOf("base", x)](client::Client& c) { return Pre(c, r); }});
  }
  {
    v1::TensorRef x = X(2);
    x.set_shape(0, -2);
    t.push_back(
        {"negative dim", Code::kInvalidArgument,
         [r = PreOf("base", x)](client::Client& c) { return Pre(c, r); }});
  }
  {
    v1::TensorRef x = X(2);
    x.clear_shape();
    for (int64_t d : {int64_t{1} << 31, int64_t{1} << 31, int64_t{1} << 31,
                      int64_t{kN}, kC}) {
      x.add_shape(d);
    }
    t.push_back(
        {"dimension product overflows", Code::kInvalidArgument,
         [r = PreOf("base", x)](client::Client& c) { return Pre(c, r); }});
  }
  {
    v1::PostRequest r = ValidPost(3);
    *r.mutable_f() =
        ToTensorRef(client::RandomTensor(DType::kBF16, {2, kC}, 1));
    t.push_back({"leading dims differ between tensors", Code::kInvalidArgument,
                 [r](client::Client& c) { return c.Post(r).status(); }});
  }
  {
    v1::PostRequest r = ValidPost(3);
    *r.mutable_f() = ToTensorRef(client::RandomTensor(DType::kF32, {3, kC}, 1));
    t.push_back({"activation dtypes differ", Code::kInvalidArgument,
                 [r](client::Client& c) { return c.Post(r).status(); }});
  }
  {
    v1::PostRequest r = ValidPost(3);
    *r.mutable_h_post() =
        ToTensorRef(client::RandomTensor(DType::kBF16, {3, kN}, 1));
    t.push_back({"mixing values not f32", Code::kInvalidArgument,
                 [r](client::Client& c) { return c.Post(r).status(); }});
  }
  // --max_tensor_bytes=65536: 2100 tokens of 32 bf16 values is 134400 B.
  t.push_back(
      {"tensor over --max_tensor_bytes", Code::kResourceExhausted,
       [](client::Client& c) { return Pre(c, PreOf("base", X(2100))); }});
  {
    // --max_request_bytes=131072: five tensors, each under the tensor limit.
    v1::PostBackwardRequest r;
    r.set_layer("base");
    const int64_t m = 500;  // x and dx_next: 32000 B each; f 8000 B
    *r.mutable_dx_next() = X(m, DType::kF32);
    *r.mutable_x() = X(m, DType::kF32);
    *r.mutable_f() = ToTensorRef(client::RandomTensor(DType::kF32, {m, kC}, 1));
    *r.mutable_h_post() = ToTensorRef(RandomF32({m, kN}));
    *r.mutable_h_res() = ToTensorRef(RandomF32({m, kN, kN}));
    t.push_back(
        {"request over --max_request_bytes", Code::kResourceExhausted,
         [r](client::Client& c) { return c.PostBackward(r).status(); }});
  }
  t.push_back({"message over --max_message_bytes", Code::kResourceExhausted,
               [](client::Client& c) {
                 v1::PreRequest r = PreOf("base", X(2));
                 r.mutable_x()->mutable_inline_data()->resize(2 << 20);
                 return Pre(c, r);
               }});
  {
    v1::TensorRef x = X(2);
    x.mutable_shm()->set_region("r0");
    x.mutable_shm()->set_byte_size(2 * kN * kC * 2);
    t.push_back(
        {"shm ref without shm", Code::kFailedPrecondition,
         [r = PreOf("base", x)](client::Client& c) { return Pre(c, r); }});
  }
  {
    v1::TensorRef x = X(2);
    x.set_ref("op.y");
    t.push_back(
        {"ref outside Execute", Code::kInvalidArgument,
         [r = PreOf("base", x)](client::Client& c) { return Pre(c, r); }});
  }
  // Op kinds.
  t.push_back({"Pre on a HEAD layer", Code::kFailedPrecondition,
               [](client::Client& c) { return Pre(c, PreOf("head", X(2))); }});
  t.push_back({"Projection on a static layer", Code::kFailedPrecondition,
               [](client::Client& c) {
                 v1::ProjectionRequest r;
                 r.set_layer("static");
                 *r.mutable_x() = X(2);
                 return c.Projection(r).status();
               }});
  // Execute.
  {
    v1::ExecuteRequest r;
    *r.add_ops() = ExpandOp("a", E(2));
    v1::TensorRef dangling;
    dangling.set_ref("missing.x");
    v1::Op op;
    op.set_id("b");
    op.mutable_expand_backward()->set_layer("base");
    *op.mutable_expand_backward()->mutable_dx() = dangling;
    *r.add_ops() = op;
    t.push_back({"Execute dangling ref", Code::kInvalidArgument,
                 [r](client::Client& c) { return c.Execute(r).status(); }});
  }
  {
    // A ref may restate dtype and shape, but they must match the output.
    v1::ExecuteRequest r;
    *r.add_ops() = ExpandOp("a", E(2));
    v1::Op op;
    op.set_id("b");
    op.mutable_expand_backward()->set_layer("base");
    v1::TensorRef* dx = op.mutable_expand_backward()->mutable_dx();
    dx->set_ref("a.x");
    dx->set_dtype(v1::DTYPE_F32);  // a.x is bf16
    *r.add_ops() = op;
    t.push_back({"Execute ref with a mismatching dtype", Code::kInvalidArgument,
                 [r](client::Client& c) { return c.Execute(r).status(); }});
  }
  {
    v1::ExecuteRequest r;
    *r.add_ops() = ExpandOp("a", E(2));
    *r.add_ops() = ExpandOp("a", E(2));
    t.push_back({"Execute duplicate op id", Code::kInvalidArgument,
                 [r](client::Client& c) { return c.Execute(r).status(); }});
  }
  {
    v1::ExecuteRequest r;
    *r.add_ops() = ExpandOp("a!", E(2));
    t.push_back({"Execute bad op id", Code::kInvalidArgument,
                 [r](client::Client& c) { return c.Execute(r).status(); }});
  }
  {
    v1::ExecuteRequest r;
    *r.add_ops() = ExpandOp("a", E(2));
    r.add_fetch("a.nothing");
    t.push_back({"Execute fetch of an unknown output", Code::kInvalidArgument,
                 [r](client::Client& c) { return c.Execute(r).status(); }});
  }
  {
    v1::ExecuteRequest r;  // --max_batch_ops=8
    for (int i = 0; i < 9; ++i)
      *r.add_ops() = ExpandOp(absl::StrCat("e", i), E(1));
    t.push_back({"Execute with too many ops", Code::kInvalidArgument,
                 [r](client::Client& c) { return c.Execute(r).status(); }});
  }
  {
    v1::ExecuteRequest r;
    r.add_ops()->set_id("empty");
    t.push_back({"Execute op without an operator", Code::kInvalidArgument,
                 [r](client::Client& c) { return c.Execute(r).status(); }});
  }
  // Parameters: one valid tensor plus one of the wrong shape is all or none.
  {
    v1::SetParametersRequest r;
    r.set_layer("base");
    auto& tensors = *r.mutable_parameters()->mutable_tensors();
    tensors["beta"] = ToTensorRef(RandomF32({2 * kN + kN * kN}));
    tensors["phi"] = ToTensorRef(RandomF32({2 * kN + kN * kN, kN * kC + 1}));
    t.push_back(
        {"SetParameters wrong phi shape", Code::kInvalidArgument,
         [r](client::Client& c) { return c.SetParameters(r).status(); }});
  }
  {
    v1::SetParametersRequest r;
    r.set_layer("base");
    (*r.mutable_parameters()->mutable_tensors())["omega"] =
        ToTensorRef(RandomF32({3}));
    t.push_back(
        {"SetParameters unknown name", Code::kInvalidArgument,
         [r](client::Client& c) { return c.SetParameters(r).status(); }});
  }
  t.push_back(
      {"ConvertLayout unspecified", Code::kInvalidArgument,
       [](client::Client& c) {
         return c.ConvertLayout("base", v1::LAYOUT_UNSPECIFIED).status();
       }});
  return t;
}

// Parameter and gradient bytes by name ("param phi", "grad beta", ...);
// a std::map because protobuf map iteration order is unspecified.
std::map<std::string, std::string> Snapshot(client::Client& c) {
  std::map<std::string, std::string> out;
  auto params = c.GetParameters("base");
  auto grads = c.GetGradients("base");
  if (!params.ok() || !grads.ok()) return out;
  for (const auto& [name, ref] : params->tensors()) {
    out["param " + name] = ref.inline_data();
  }
  for (const auto& [name, ref] : grads->gradients().tensors()) {
    out["grad " + name] = ref.inline_data();
  }
  return out;
}

TEST(ServerErrorsTest, MalformedRequestsGetExactCodes) {
  MHC_ASSERT_OK_AND_ASSIGN(
      auto daemon,
      Daemon::Start({"--max_message_bytes=1048576", "--max_tensor_bytes=65536",
                     "--max_request_bytes=131072", "--max_batch_ops=8"}));
  MHC_ASSERT_OK_AND_ASSIGN(auto client, daemon->Connect());
  MHC_ASSERT_OK(client->WaitForReady(absl::Seconds(10)));
  MHC_ASSERT_OK_AND_ASSIGN(
      auto base, CreateRandomLayer(*client, LayerRequest("base", kN, kC)));
  auto head = LayerRequest("head", kN, kC);
  head.mutable_spec()->set_kind(v1::LAYER_KIND_HEAD);
  MHC_ASSERT_OK(client->CreateLayer(head).status());
  auto stat = LayerRequest("static", kN, kC);
  stat.mutable_spec()->set_dynamic(false);
  MHC_ASSERT_OK(client->CreateLayer(stat).status());
  // Non-zero gradients, so "unchanged" is a real statement about them.
  v1::PostBackwardRequest bwd;
  v1::PostRequest post = ValidPost(3);
  bwd.set_layer("base");
  *bwd.mutable_dx_next() = X(3);
  *bwd.mutable_f() = post.f();
  *bwd.mutable_x() = post.x();
  *bwd.mutable_h_post() = post.h_post();
  *bwd.mutable_h_res() = post.h_res();
  MHC_ASSERT_OK(client->PostBackward(bwd).status());
  v1::PreBackwardRequest pre_bwd;
  pre_bwd.set_layer("base");
  *pre_bwd.mutable_x() = post.x();
  *pre_bwd.mutable_dy() = post.f();
  *pre_bwd.mutable_dh_post() = post.h_post();
  *pre_bwd.mutable_dh_res() = post.h_res();
  MHC_ASSERT_OK(client->PreBackward(pre_bwd).status());
  MHC_ASSERT_OK_AND_ASSIGN(auto info, client->GetServerInfo());
  EXPECT_EQ(info.limits().max_batch_ops(), 8);

  const std::map<std::string, std::string> before = Snapshot(*client);
  ASSERT_EQ(before.size(), 6u);  // phi, alpha, beta and their gradients
  const std::string& grad_beta = before.at("grad beta");
  ASSERT_NE(grad_beta, std::string(grad_beta.size(), '\0'));
  std::vector<BadRequest> table = Table();
  EXPECT_GE(table.size(), 25u);
  for (const BadRequest& bad : table) {
    absl::Status status = bad.call(*client);
    // The messages are part of the contract too (they name the field);
    // printing them makes a wrong code easy to diagnose.
    std::printf("%-42s %s\n", bad.name.c_str(), status.ToString().c_str());
    EXPECT_EQ(status.code(), bad.code)
        << bad.name << ": expected " << CodeName(bad.code) << ", got "
        << status;
  }
  EXPECT_EQ(client->Health("").value_or("error"), "SERVING");
  const std::map<std::string, std::string> after = Snapshot(*client);
  ASSERT_EQ(after.size(), before.size());
  for (const auto& [name, bytes] : before) {
    EXPECT_TRUE(after.at(name) == bytes)
        << name << " changed by a rejected request";
  }
  MHC_ASSERT_OK_AND_ASSIGN(auto list, client->ListLayers());
  EXPECT_EQ(list.layers_size(), 3) << "a rejected CreateLayer left a layer";
  (void)base;
}

}  // namespace
}  // namespace mhc::testing
