// Every RPC of mhc.v1.Mhc (plus health and reflection) against a real mhcd,
// with compute results checked against the float64 reference backend.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "reflection.grpc.pb.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

using client::HostLayer;
using client::HostTensor;
using client::ToTensorRef;
using client::Zeros;

// fp32 activations: docs/SPEC.md section 7 (the CPU backend computes IEEE
// fp32).
constexpr double kTol = 1e-5;
// Sums of many fp32 products (gradients) and Sinkhorn's reverse mode.
constexpr double kGradTol = 1e-4;

class ServerApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MHC_ASSERT_OK_AND_ASSIGN(daemon_, Daemon::Start());
    MHC_ASSERT_OK_AND_ASSIGN(client_, daemon_->Connect());
    MHC_ASSERT_OK(client_->WaitForReady(absl::Seconds(10)));
    ref_ = MakeReferenceBackend();
  }

  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<Backend> ref_;
};

TEST_F(ServerApiTest, HealthAndReflection) {
  EXPECT_EQ(client_->Health("").value_or("error"), "SERVING");
  EXPECT_EQ(client_->Health("mhc.v1.Mhc").value_or("error"), "SERVING");

  auto stub =
      grpc::reflection::v1alpha::ServerReflection::NewStub(client_->channel());
  grpc::ClientContext context;
  auto stream = stub->ServerReflectionInfo(&context);
  grpc::reflection::v1alpha::ServerReflectionRequest request;
  request.set_list_services("");
  ASSERT_TRUE(stream->Write(request));
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  ASSERT_TRUE(stream->Read(&response));
  stream->WritesDone();
  std::vector<std::string> services;
  for (const auto& s : response.list_services_response().service()) {
    services.push_back(s.name());
  }
  EXPECT_NE(std::find(services.begin(), services.end(), "mhc.v1.Mhc"),
            services.end());
  EXPECT_NE(
      std::find(services.begin(), services.end(), "grpc.health.v1.Health"),
      services.end());
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(ServerApiTest, ServerInfo) {
  MHC_ASSERT_OK_AND_ASSIGN(auto info, client_->GetServerInfo());
  EXPECT_FALSE(info.version().empty());
  EXPECT_EQ(info.backend(), "cpu");
  ASSERT_GE(info.devices_size(), 1);
  EXPECT_FALSE(info.draining());
  for (const std::string& preset : PresetNames()) {
    EXPECT_NE(std::find(info.presets().begin(), info.presets().end(), preset),
              info.presets().end())
        << preset;
  }
  EXPECT_EQ(info.dtypes_size(), 3);
  EXPECT_EQ(info.limits().max_inflight(), 64);
  EXPECT_EQ(info.limits().max_batch_ops(), 256);
  EXPECT_EQ(info.limits().max_streams(), 16);
  EXPECT_EQ(info.limits().max_sinkhorn_iterations(), 1000);
  EXPECT_EQ(info.limits().max_message_bytes(), uint64_t{1} << 30);
}

TEST_F(ServerApiTest, LayerManagement) {
  MHC_ASSERT_OK_AND_ASSIGN(auto b, client_->CreateLayer(LayerRequest(
                                       "b-layer", 4, 8, "tilekernels")));
  EXPECT_EQ(b.preset(), "tilekernels");
  EXPECT_EQ(b.spec().sinkhorn_iterations(), 10);
  EXPECT_FLOAT_EQ(b.spec().post_mult(), 1.0f);
  EXPECT_EQ(b.parameter_count(), 24 * 32 + 3 + 24);
  // n = 0 means the default of 4 (layer.proto).
  MHC_ASSERT_OK_AND_ASSIGN(
      auto a, client_->CreateLayer(
                  LayerRequest("a.layer_1", 0, 5, "transformer_engine")));
  EXPECT_EQ(a.spec().n(), 4);
  EXPECT_EQ(a.spec().layout(), v1::LAYOUT_STREAM_MINOR);
  EXPECT_EQ(a.spec().sinkhorn_mode(), v1::SINKHORN_MODE_LOG);

  MHC_ASSERT_OK_AND_ASSIGN(auto list, client_->ListLayers());
  ASSERT_EQ(list.layers_size(), 2);
  EXPECT_EQ(list.layers(0).name(), "a.layer_1");  // sorted by name
  EXPECT_EQ(list.layers(1).name(), "b-layer");
  MHC_ASSERT_OK_AND_ASSIGN(auto got, client_->GetLayer("b-layer"));
  EXPECT_EQ(got.spec().SerializeAsString(), b.spec().SerializeAsString());

  // Parameters: docs/SPEC.md section 5 initialisation, then a round trip.
  MHC_ASSERT_OK_AND_ASSIGN(auto params, client_->GetParameters("b-layer"));
  MHC_ASSERT_OK_AND_ASSIGN(HostLayer host,
                           client::MakeHostLayer(b.spec(), params));
  for (float alpha : host.parameters["alpha"]) EXPECT_FLOAT_EQ(alpha, 0.01f);
  HostTensor beta = RandomF32({24});
  v1::SetParametersRequest set;
  set.set_layer("b-layer");
  (*set.mutable_parameters()->mutable_tensors())["beta"] = ToTensorRef(beta);
  MHC_ASSERT_OK_AND_ASSIGN(auto after, client_->SetParameters(set));
  EXPECT_GT(after.parameters_version(), b.parameters_version());
  MHC_ASSERT_OK_AND_ASSIGN(auto only_beta,
                           client_->GetParameters("b-layer", {"beta"}));
  ASSERT_EQ(only_beta.tensors_size(), 1);
  EXPECT_EQ(only_beta.tensors().at("beta").inline_data(), beta.bytes);

  MHC_ASSERT_OK(client_->DeleteLayer("b-layer").status());
  EXPECT_EQ(client_->GetLayer("b-layer").status().code(),
            absl::StatusCode::kNotFound);
  MHC_ASSERT_OK_AND_ASSIGN(list, client_->ListLayers());
  EXPECT_EQ(list.layers_size(), 1);
}

TEST_F(ServerApiTest, ConvertLayoutPermutesPhiAndGamma) {
  auto request = LayerRequest("conv", 3, 5);
  request.mutable_spec()->set_has_gamma(true);
  MHC_ASSERT_OK_AND_ASSIGN(HostLayer major,
                           CreateRandomLayer(*client_, request));
  MHC_ASSERT_OK_AND_ASSIGN(
      auto info, client_->ConvertLayout("conv", v1::LAYOUT_STREAM_MINOR));
  EXPECT_EQ(info.spec().layout(), v1::LAYOUT_STREAM_MINOR);
  MHC_ASSERT_OK_AND_ASSIGN(auto params, client_->GetParameters("conv"));
  MHC_ASSERT_OK_AND_ASSIGN(HostLayer minor,
                           client::MakeHostLayer(info.spec(), params));
  const int n = 3, c_dim = 5, k = 15;
  for (int g = 0; g < 15; ++g) {
    for (int i = 0; i < n; ++i) {
      for (int c = 0; c < c_dim; ++c) {
        ASSERT_EQ(minor.parameters["phi"][g * k + c * n + i],
                  major.parameters["phi"][g * k + i * c_dim + c]);
      }
    }
  }
  for (int i = 0; i < n; ++i) {
    for (int c = 0; c < c_dim; ++c) {
      ASSERT_EQ(minor.parameters["gamma"][c * n + i],
                major.parameters["gamma"][i * c_dim + c]);
    }
  }
  EXPECT_EQ(minor.parameters["beta"], major.parameters["beta"]);
}

// Projection, Scale, Sinkhorn, Aggregate, ExpandCombine and Expand, forward
// and backward, each on the same inputs as the reference.
TEST_F(ServerApiTest, SingleOpsMatchReference) {
  const int n = 4;
  const int64_t c_dim = 40, m = 14;
  const std::vector<int64_t> lead = {2, 7};
  auto request = LayerRequest("ops", n, c_dim);
  request.mutable_spec()->set_has_gamma(true);
  request.mutable_spec()->set_has_post_bias(true);
  request.mutable_spec()->set_matmul_precision(v1::MATMUL_PRECISION_IEEE);
  MHC_ASSERT_OK_AND_ASSIGN(HostLayer host,
                           CreateRandomLayer(*client_, request));
  const LayerSpec& spec = host.spec;
  const int64_t nl = spec.NumLogits();
  HostTensor x =
      client::RandomTensor(DType::kF32, {2, 7, n, c_dim}, FreshSeed());

  // Projection.
  v1::ProjectionRequest proj;
  proj.set_layer("ops");
  *proj.mutable_x() = ToTensorRef(x);
  MHC_ASSERT_OK_AND_ASSIGN(auto proj_out, client_->Projection(proj));
  HostTensor h = Zeros(DType::kF32, {2, 7, nl});
  HostTensor ms = Zeros(DType::kF32, lead);
  MHC_ASSERT_OK(ref_->ProjectionForward(
      {&spec, m, DType::kF32, x.data(), host.Weights(), h.f32(), ms.f32()},
      {}));
  ExpectMatches(proj_out.h(), h, kTol, "Projection.h");
  ExpectMatches(proj_out.mean_square(), ms, kTol, "Projection.mean_square");

  MHC_ASSERT_OK(client_->ZeroGradients("ops").status());
  v1::ProjectionBackwardRequest proj_bwd;
  proj_bwd.set_layer("ops");
  HostTensor dh = RandomF32({2, 7, nl});
  HostTensor dms = RandomF32(lead);
  *proj_bwd.mutable_x() = ToTensorRef(x);
  *proj_bwd.mutable_dh() = ToTensorRef(dh);
  *proj_bwd.mutable_dmean_square() = ToTensorRef(dms);
  MHC_ASSERT_OK_AND_ASSIGN(auto proj_bwd_out,
                           client_->ProjectionBackward(proj_bwd));
  HostTensor dx = Zeros(DType::kF32, x.shape);
  ProjectionBackwardParams pb;
  pb.spec = &spec;
  pb.tokens = m;
  pb.act_dtype = DType::kF32;
  pb.x = x.data();
  pb.weights = host.Weights();
  pb.dh = dh.f32();
  pb.dmean_square = dms.f32();
  pb.dx = dx.data();
  pb.grads = host.Grads();
  MHC_ASSERT_OK(ref_->ProjectionBackward(pb, {}));
  ExpectMatches(proj_bwd_out.dx(), dx, kTol, "ProjectionBackward.dx");
  ExpectGradients(*client_, "ops", host, kGradTol, "ProjectionBackward");

  // Scale on the daemon's own projection outputs.
  MHC_ASSERT_OK_AND_ASSIGN(HostTensor h_srv,
                           client::FromTensorRef(proj_out.h()));
  MHC_ASSERT_OK_AND_ASSIGN(HostTensor ms_srv,
                           client::FromTensorRef(proj_out.mean_square()));
  v1::ScaleRequest scale;
  scale.set_layer("ops");
  *scale.mutable_h() = proj_out.h();
  *scale.mutable_mean_square() = proj_out.mean_square();
  MHC_ASSERT_OK_AND_ASSIGN(auto scale_out, client_->Scale(scale));
  HostTensor h_pre = Zeros(DType::kF32, {2, 7, n});
  HostTensor h_post = Zeros(DType::kF32, {2, 7, n});
  HostTensor logits = Zeros(DType::kF32, {2, 7, n, n});
  MHC_ASSERT_OK(
      ref_->ScaleForward({&spec, m, h_srv.f32(), ms_srv.f32(), host.Weights(),
                          h_pre.f32(), h_post.f32(), logits.f32()},
                         {}));
  ExpectMatches(scale_out.h_pre(), h_pre, kTol, "Scale.h_pre");
  ExpectMatches(scale_out.h_post(), h_post, kTol, "Scale.h_post");
  ExpectMatches(scale_out.logits(), logits, kTol, "Scale.logits");

  MHC_ASSERT_OK(client_->ZeroGradients("ops").status());
  for (auto& [name, g] : host.gradients) std::fill(g.begin(), g.end(), 0.0f);
  HostTensor dh_pre = RandomF32({2, 7, n}), dh_post = RandomF32({2, 7, n});
  HostTensor dlogits = RandomF32({2, 7, n, n});
  v1::ScaleBackwardRequest scale_bwd;
  scale_bwd.set_layer("ops");
  *scale_bwd.mutable_h() = proj_out.h();
  *scale_bwd.mutable_mean_square() = proj_out.mean_square();
  *scale_bwd.mutable_dh_pre() = ToTensorRef(dh_pre);
  *scale_bwd.mutable_dh_post() = ToTensorRef(dh_post);
  *scale_bwd.mutable_dlogits() = ToTensorRef(dlogits);
  MHC_ASSERT_OK_AND_ASSIGN(auto scale_bwd_out,
                           client_->ScaleBackward(scale_bwd));
  HostTensor dh_ref = Zeros(DType::kF32, {2, 7, nl});
  HostTensor dms_ref = Zeros(DType::kF32, lead);
  MHC_ASSERT_OK(ref_->ScaleBackward(
      {&spec, m, h_srv.f32(), ms_srv.f32(), host.Weights(), dh_pre.f32(),
       dh_post.f32(), dlogits.f32(), dh_ref.f32(), dms_ref.f32(), host.Grads()},
      {}));
  ExpectMatches(scale_bwd_out.dh(), dh_ref, kTol, "ScaleBackward.dh");
  ExpectMatches(scale_bwd_out.dmean_square(), dms_ref, kTol,
                "ScaleBackward.dmean_square");
  ExpectGradients(*client_, "ops", host, kGradTol, "ScaleBackward");
  // A layer's backward counts its tokens once, at the op that owns beta.
  MHC_ASSERT_OK_AND_ASSIGN(auto info, client_->GetLayer("ops"));
  EXPECT_EQ(info.gradient_tokens(), m);

  // Sinkhorn on random logits (far from the identity).
  HostTensor a = RandomF32({2, 7, n, n}, -2, 2);
  v1::SinkhornRequest sk;
  sk.set_layer("ops");
  *sk.mutable_logits() = ToTensorRef(a);
  MHC_ASSERT_OK_AND_ASSIGN(auto sk_out, client_->Sinkhorn(sk));
  HostTensor h_res = Zeros(DType::kF32, a.shape);
  MHC_ASSERT_OK(ref_->SinkhornForward({&spec, m, a.f32(), h_res.f32()}, {}));
  ExpectMatches(sk_out.h_res(), h_res, kTol, "Sinkhorn.h_res");
  MHC_ASSERT_OK_AND_ASSIGN(HostTensor h_res_srv,
                           client::FromTensorRef(sk_out.h_res()));
  EXPECT_LE(client::MaxColumnSumError(h_res_srv.ToFloats(), n), 1e-5);
  HostTensor dh_res = RandomF32(a.shape);
  v1::SinkhornBackwardRequest sk_bwd;
  sk_bwd.set_layer("ops");
  *sk_bwd.mutable_logits() = ToTensorRef(a);
  *sk_bwd.mutable_dh_res() = ToTensorRef(dh_res);
  MHC_ASSERT_OK_AND_ASSIGN(auto sk_bwd_out, client_->SinkhornBackward(sk_bwd));
  HostTensor da = Zeros(DType::kF32, a.shape);
  MHC_ASSERT_OK(
      ref_->SinkhornBackward({&spec, m, a.f32(), dh_res.f32(), da.f32()}, {}));
  ExpectMatches(sk_bwd_out.dlogits(), da, kGradTol, "SinkhornBackward.dlogits");

  // Aggregate.
  HostTensor hp = RandomF32({2, 7, n}, 0, 1);
  v1::AggregateRequest agg;
  agg.set_layer("ops");
  *agg.mutable_x() = ToTensorRef(x);
  *agg.mutable_h_pre() = ToTensorRef(hp);
  MHC_ASSERT_OK_AND_ASSIGN(auto agg_out, client_->Aggregate(agg));
  HostTensor y = Zeros(DType::kF32, {2, 7, c_dim});
  MHC_ASSERT_OK(ref_->AggregateForward(
      {&spec, m, DType::kF32, x.data(), hp.f32(), y.data()}, {}));
  ExpectMatches(agg_out.y(), y, kTol, "Aggregate.y");
  HostTensor dy = client::RandomTensor(DType::kF32, y.shape, FreshSeed());
  v1::AggregateBackwardRequest agg_bwd;
  agg_bwd.set_layer("ops");
  *agg_bwd.mutable_x() = ToTensorRef(x);
  *agg_bwd.mutable_h_pre() = ToTensorRef(hp);
  *agg_bwd.mutable_dy() = ToTensorRef(dy);
  MHC_ASSERT_OK_AND_ASSIGN(auto agg_bwd_out,
                           client_->AggregateBackward(agg_bwd));
  HostTensor agg_dx = Zeros(DType::kF32, x.shape);
  HostTensor dhp = Zeros(DType::kF32, hp.shape);
  MHC_ASSERT_OK(
      ref_->AggregateBackward({&spec, m, DType::kF32, x.data(), hp.f32(),
                               dy.data(), agg_dx.data(), dhp.f32()},
                              {}));
  ExpectMatches(agg_bwd_out.dx(), agg_dx, kTol, "AggregateBackward.dx");
  ExpectMatches(agg_bwd_out.dh_pre(), dhp, kTol, "AggregateBackward.dh_pre");

  // ExpandCombine (= post) with the post bias.
  HostTensor f = client::RandomTensor(DType::kF32, y.shape, FreshSeed());
  HostTensor hpost = RandomF32({2, 7, n}, 0, 2);
  v1::PostRequest ec;
  ec.set_layer("ops");
  *ec.mutable_f() = ToTensorRef(f);
  *ec.mutable_x() = ToTensorRef(x);
  *ec.mutable_h_post() = ToTensorRef(hpost);
  *ec.mutable_h_res() = ToTensorRef(h_res_srv);
  MHC_ASSERT_OK_AND_ASSIGN(auto ec_out, client_->ExpandCombine(ec));
  HostTensor x_next = Zeros(DType::kF32, x.shape);
  MHC_ASSERT_OK(
      ref_->PostForward({&spec, m, DType::kF32, f.data(), x.data(), hpost.f32(),
                         h_res_srv.f32(), host.Weights(), x_next.data()},
                        {}));
  ExpectMatches(ec_out.x_next(), x_next, kTol, "ExpandCombine.x_next");

  MHC_ASSERT_OK(client_->ZeroGradients("ops").status());
  for (auto& [name, g] : host.gradients) std::fill(g.begin(), g.end(), 0.0f);
  HostTensor dx_next = client::RandomTensor(DType::kF32, x.shape, FreshSeed());
  v1::PostBackwardRequest ec_bwd;
  ec_bwd.set_layer("ops");
  *ec_bwd.mutable_dx_next() = ToTensorRef(dx_next);
  *ec_bwd.mutable_f() = ToTensorRef(f);
  *ec_bwd.mutable_x() = ToTensorRef(x);
  *ec_bwd.mutable_h_post() = ToTensorRef(hpost);
  *ec_bwd.mutable_h_res() = ToTensorRef(h_res_srv);
  MHC_ASSERT_OK_AND_ASSIGN(auto ec_bwd_out,
                           client_->ExpandCombineBackward(ec_bwd));
  HostTensor df = Zeros(DType::kF32, f.shape),
             pdx = Zeros(DType::kF32, x.shape);
  HostTensor dhpost = Zeros(DType::kF32, hpost.shape);
  HostTensor dhres = Zeros(DType::kF32, h_res.shape);
  PostBackwardParams post_b;
  post_b.spec = &spec;
  post_b.tokens = m;
  post_b.act_dtype = DType::kF32;
  post_b.dx_next = dx_next.data();
  post_b.f = f.data();
  post_b.x = x.data();
  post_b.h_post = hpost.f32();
  post_b.h_res = h_res_srv.f32();
  post_b.weights = host.Weights();
  post_b.df = df.data();
  post_b.dx = pdx.data();
  post_b.dh_post = dhpost.f32();
  post_b.dh_res = dhres.f32();
  post_b.grads = host.Grads();
  MHC_ASSERT_OK(ref_->PostBackward(post_b, {}));
  ExpectMatches(ec_bwd_out.df(), df, kTol, "ExpandCombineBackward.df");
  ExpectMatches(ec_bwd_out.dx(), pdx, kTol, "ExpandCombineBackward.dx");
  ExpectMatches(ec_bwd_out.dh_post(), dhpost, kTol,
                "ExpandCombineBackward.dh_post");
  ExpectMatches(ec_bwd_out.dh_res(), dhres, kTol,
                "ExpandCombineBackward.dh_res");
  ExpectGradients(*client_, "ops", host, kGradTol, "ExpandCombineBackward");

  // Expand.
  HostTensor e = client::RandomTensor(DType::kF32, {2, 7, c_dim}, FreshSeed());
  v1::ExpandRequest ex;
  ex.set_layer("ops");
  *ex.mutable_e() = ToTensorRef(e);
  MHC_ASSERT_OK_AND_ASSIGN(auto ex_out, client_->Expand(ex));
  HostTensor ex_x = Zeros(DType::kF32, x.shape);
  MHC_ASSERT_OK(
      ref_->ExpandForward({&spec, m, DType::kF32, e.data(), ex_x.data()}, {}));
  ExpectMatches(ex_out.x(), ex_x, 0.0, "Expand.x");
  v1::ExpandBackwardRequest ex_bwd;
  ex_bwd.set_layer("ops");
  *ex_bwd.mutable_dx() = ToTensorRef(dx_next);
  MHC_ASSERT_OK_AND_ASSIGN(auto ex_bwd_out, client_->ExpandBackward(ex_bwd));
  HostTensor de = Zeros(DType::kF32, e.shape);
  MHC_ASSERT_OK(ref_->ExpandBackward(
      {&spec, m, DType::kF32, dx_next.data(), de.data()}, {}));
  ExpectMatches(ex_bwd_out.de(), de, kTol, "ExpandBackward.de");

  // ZeroGradients really zeroes.
  MHC_ASSERT_OK(client_->ZeroGradients("ops").status());
  MHC_ASSERT_OK_AND_ASSIGN(auto zero, client_->GetGradients("ops"));
  EXPECT_EQ(zero.gradient_tokens(), 0);
  for (const auto& [name, ref] : zero.gradients().tensors()) {
    MHC_ASSERT_OK_AND_ASSIGN(HostTensor t, client::FromTensorRef(ref));
    for (float v : t.ToFloats()) ASSERT_EQ(v, 0.0f) << name;
  }
}

// The fused layer in bf16, as a training step drives it.
TEST_F(ServerApiTest, FusedLayerBf16MatchesReference) {
  const int n = 4;
  const int64_t c_dim = 48, m = 13;
  MHC_ASSERT_OK_AND_ASSIGN(
      HostLayer host,
      CreateRandomLayer(*client_, LayerRequest("fused", n, c_dim)));
  const LayerSpec& spec = host.spec;
  const DType bf16 = DType::kBF16;
  HostTensor x = client::RandomTensor(bf16, {m, n, c_dim}, FreshSeed());
  v1::PreRequest pre;
  pre.set_layer("fused");
  *pre.mutable_x() = ToTensorRef(x);
  MHC_ASSERT_OK_AND_ASSIGN(auto pre_out, client_->Pre(pre));
  EXPECT_FALSE(pre_out.has_h()) << "the projection only when asked for";
  HostTensor y = Zeros(bf16, {m, c_dim});
  HostTensor h_pre = Zeros(DType::kF32, {m, n}),
             h_post = Zeros(DType::kF32, {m, n});
  HostTensor h_res = Zeros(DType::kF32, {m, n, n});
  MHC_ASSERT_OK(
      ref_->PreForward({&spec, m, bf16, x.data(), host.Weights(), y.data(),
                        h_pre.f32(), h_post.f32(), h_res.f32()},
                       {}));
  ExpectMatches(pre_out.y(), y, 1e-2, "Pre.y");
  ExpectMatches(pre_out.h_pre(), h_pre, kTol, "Pre.h_pre");
  ExpectMatches(pre_out.h_post(), h_post, kTol, "Pre.h_post");
  ExpectMatches(pre_out.h_res(), h_res, kTol, "Pre.h_res");

  HostTensor f = client::RandomTensor(bf16, {m, c_dim}, FreshSeed());
  v1::PostRequest post;
  post.set_layer("fused");
  *post.mutable_f() = ToTensorRef(f);
  *post.mutable_x() = ToTensorRef(x);
  *post.mutable_h_post() = pre_out.h_post();
  *post.mutable_h_res() = pre_out.h_res();
  MHC_ASSERT_OK_AND_ASSIGN(auto post_out, client_->Post(post));
  MHC_ASSERT_OK_AND_ASSIGN(HostTensor hpost_srv,
                           client::FromTensorRef(pre_out.h_post()));
  MHC_ASSERT_OK_AND_ASSIGN(HostTensor hres_srv,
                           client::FromTensorRef(pre_out.h_res()));
  HostTensor x_next = Zeros(bf16, x.shape);
  MHC_ASSERT_OK(
      ref_->PostForward({&spec, m, bf16, f.data(), x.data(), hpost_srv.f32(),
                         hres_srv.f32(), host.Weights(), x_next.data()},
                        {}));
  ExpectMatches(post_out.x_next(), x_next, 1e-2, "Post.x_next");

  MHC_ASSERT_OK(client_->ZeroGradients("fused").status());
  HostTensor dx_next = client::RandomTensor(bf16, x.shape, FreshSeed());
  v1::PostBackwardRequest post_bwd;
  post_bwd.set_layer("fused");
  *post_bwd.mutable_dx_next() = ToTensorRef(dx_next);
  *post_bwd.mutable_f() = ToTensorRef(f);
  *post_bwd.mutable_x() = ToTensorRef(x);
  *post_bwd.mutable_h_post() = pre_out.h_post();
  *post_bwd.mutable_h_res() = pre_out.h_res();
  post_bwd.set_skip_dx(true);
  MHC_ASSERT_OK_AND_ASSIGN(auto post_bwd_out, client_->PostBackward(post_bwd));
  EXPECT_FALSE(post_bwd_out.has_dx()) << "skip_dx";
  HostTensor df = Zeros(bf16, f.shape);
  HostTensor dh_post = Zeros(DType::kF32, {m, n}),
             dh_res = Zeros(DType::kF32, {m, n, n});
  PostBackwardParams pb;
  pb.spec = &spec;
  pb.tokens = m;
  pb.act_dtype = bf16;
  pb.dx_next = dx_next.data();
  pb.f = f.data();
  pb.x = x.data();
  pb.h_post = hpost_srv.f32();
  pb.h_res = hres_srv.f32();
  pb.weights = host.Weights();
  pb.df = df.data();
  pb.dh_post = dh_post.f32();
  pb.dh_res = dh_res.f32();
  pb.grads = host.Grads();
  MHC_ASSERT_OK(ref_->PostBackward(pb, {}));
  ExpectMatches(post_bwd_out.df(), df, 1e-2, "PostBackward.df");
  ExpectMatches(post_bwd_out.dh_post(), dh_post, kGradTol,
                "PostBackward.dh_post");
  ExpectMatches(post_bwd_out.dh_res(), dh_res, kGradTol, "PostBackward.dh_res");

  MHC_ASSERT_OK_AND_ASSIGN(HostTensor dhp_srv,
                           client::FromTensorRef(post_bwd_out.dh_post()));
  MHC_ASSERT_OK_AND_ASSIGN(HostTensor dhr_srv,
                           client::FromTensorRef(post_bwd_out.dh_res()));
  HostTensor dy = client::RandomTensor(bf16, {m, c_dim}, FreshSeed());
  v1::PreBackwardRequest pre_bwd;
  pre_bwd.set_layer("fused");
  *pre_bwd.mutable_x() = ToTensorRef(x);
  *pre_bwd.mutable_dy() = ToTensorRef(dy);
  *pre_bwd.mutable_dh_post() = post_bwd_out.dh_post();
  *pre_bwd.mutable_dh_res() = post_bwd_out.dh_res();
  *pre_bwd.mutable_dx_next() = ToTensorRef(dx_next);
  MHC_ASSERT_OK_AND_ASSIGN(auto pre_bwd_out, client_->PreBackward(pre_bwd));
  HostTensor dx = Zeros(bf16, x.shape);
  PreBackwardParams qb;
  qb.spec = &spec;
  qb.tokens = m;
  qb.act_dtype = bf16;
  qb.x = x.data();
  qb.weights = host.Weights();
  qb.dy = dy.data();
  qb.dh_post = dhp_srv.f32();
  qb.dh_res = dhr_srv.f32();
  qb.dx_next = dx_next.data();
  qb.dx = dx.data();
  qb.grads = host.Grads();
  MHC_ASSERT_OK(ref_->PreBackward(qb, {}));
  ExpectMatches(pre_bwd_out.dx(), dx, 1e-2, "PreBackward.dx");
  ExpectGradients(*client_, "fused", host, 1e-3, "Pre/PostBackward");
  MHC_ASSERT_OK_AND_ASSIGN(auto info, client_->GetLayer("fused"));
  EXPECT_EQ(info.gradient_tokens(), m) << "one layer backward counts M once";

  // The projection Pre keeps is the one PreBackward recomputes: the same dx,
  // bit for bit.
  pre.set_keep_projection(true);
  MHC_ASSERT_OK_AND_ASSIGN(auto kept_out, client_->Pre(pre));
  EXPECT_EQ(kept_out.y().SerializeAsString(), pre_out.y().SerializeAsString());
  ASSERT_EQ(kept_out.h().shape_size(), 2);
  EXPECT_EQ(kept_out.h().shape(1), spec.NumLogits());
  ASSERT_EQ(kept_out.mean_square().shape_size(), 1);
  *pre_bwd.mutable_h() = kept_out.h();
  *pre_bwd.mutable_mean_square() = kept_out.mean_square();
  pre_bwd.set_skip_parameter_gradients(true);
  MHC_ASSERT_OK_AND_ASSIGN(auto kept_bwd, client_->PreBackward(pre_bwd));
  EXPECT_EQ(kept_bwd.dx().SerializeAsString(),
            pre_bwd_out.dx().SerializeAsString());
  pre_bwd.clear_mean_square();
  EXPECT_EQ(client_->PreBackward(pre_bwd).status().code(),
            absl::StatusCode::kInvalidArgument)
      << "h without mean_square";
}

TEST_F(ServerApiTest, HeadMatchesReference) {
  const int n = 4;
  const int64_t c_dim = 24, m = 9;
  auto request = LayerRequest("head", n, c_dim);
  request.mutable_spec()->set_kind(v1::LAYER_KIND_HEAD);
  MHC_ASSERT_OK_AND_ASSIGN(HostLayer host,
                           CreateRandomLayer(*client_, request));
  HostTensor x = client::RandomTensor(DType::kF32, {m, n, c_dim}, FreshSeed());
  v1::HeadRequest head;
  head.set_layer("head");
  *head.mutable_x() = ToTensorRef(x);
  MHC_ASSERT_OK_AND_ASSIGN(auto out, client_->Head(head));
  HostTensor y = Zeros(DType::kF32, {m, c_dim}),
             mix = Zeros(DType::kF32, {m, n});
  MHC_ASSERT_OK(ref_->HeadForward({&host.spec, m, DType::kF32, x.data(),
                                   host.Weights(), y.data(), mix.f32()},
                                  {}));
  ExpectMatches(out.y(), y, kTol, "Head.y");
  ExpectMatches(out.mix(), mix, kTol, "Head.mix");

  HostTensor dy = client::RandomTensor(DType::kF32, y.shape, FreshSeed());
  v1::HeadBackwardRequest bwd;
  bwd.set_layer("head");
  *bwd.mutable_x() = ToTensorRef(x);
  *bwd.mutable_dy() = ToTensorRef(dy);
  MHC_ASSERT_OK_AND_ASSIGN(auto bwd_out, client_->HeadBackward(bwd));
  HostTensor dx = Zeros(DType::kF32, x.shape);
  MHC_ASSERT_OK(
      ref_->HeadBackward({&host.spec, m, DType::kF32, x.data(), host.Weights(),
                          dy.data(), dx.data(), host.Grads()},
                         {}));
  ExpectMatches(bwd_out.dx(), dx, kTol, "HeadBackward.dx");
  ExpectGradients(*client_, "head", host, kGradTol, "HeadBackward");
}

// Execute chains ops through refs; ExecuteStream answers batches in order;
// both agree bit for bit with the unary RPCs (the daemon is deterministic).
TEST_F(ServerApiTest, ExecuteAndExecuteStream) {
  const int n = 4;
  const int64_t c_dim = 16, m = 5;
  MHC_ASSERT_OK_AND_ASSIGN(
      HostLayer host,
      CreateRandomLayer(*client_, LayerRequest("exe", n, c_dim)));
  HostTensor x = client::RandomTensor(DType::kBF16, {m, n, c_dim}, FreshSeed());
  HostTensor f = client::RandomTensor(DType::kBF16, {m, c_dim}, FreshSeed());
  v1::ExecuteRequest batch;
  v1::Op* pre = batch.add_ops();
  pre->set_id("pre1");
  pre->mutable_pre()->set_layer("exe");
  *pre->mutable_pre()->mutable_x() = ToTensorRef(x);
  v1::Op* post = batch.add_ops();
  post->set_id("post1");
  v1::PostRequest* p = post->mutable_post();
  p->set_layer("exe");
  *p->mutable_f() = ToTensorRef(f);
  *p->mutable_x() = ToTensorRef(x);
  p->mutable_h_post()->set_ref("pre1.h_post");
  p->mutable_h_res()->set_ref("pre1.h_res");
  batch.add_fetch("post1.x_next");
  batch.add_fetch("pre1.y");
  MHC_ASSERT_OK_AND_ASSIGN(auto out, client_->Execute(batch));
  ASSERT_EQ(out.outputs_size(), 2);
  ASSERT_TRUE(out.outputs().contains("post1.x_next"));
  ASSERT_TRUE(out.outputs().contains("pre1.y"));

  v1::PreRequest unary_pre = pre->pre();
  MHC_ASSERT_OK_AND_ASSIGN(auto pre_out, client_->Pre(unary_pre));
  v1::PostRequest unary_post = *p;
  *unary_post.mutable_h_post() = pre_out.h_post();
  *unary_post.mutable_h_res() = pre_out.h_res();
  MHC_ASSERT_OK_AND_ASSIGN(auto post_out, client_->Post(unary_post));
  EXPECT_EQ(out.outputs().at("pre1.y").inline_data(),
            pre_out.y().inline_data());
  EXPECT_EQ(out.outputs().at("post1.x_next").inline_data(),
            post_out.x_next().inline_data());
  EXPECT_EQ(
      std::vector<int64_t>(out.outputs().at("post1.x_next").shape().begin(),
                           out.outputs().at("post1.x_next").shape().end()),
      x.shape);

  // Empty fetch returns every output of every op.
  v1::ExecuteRequest all = batch;
  all.clear_fetch();
  MHC_ASSERT_OK_AND_ASSIGN(auto every, client_->Execute(all));
  EXPECT_TRUE(every.outputs().contains("pre1.h_pre"));
  EXPECT_TRUE(every.outputs().contains("post1.x_next"));

  MHC_ASSERT_OK_AND_ASSIGN(auto answers,
                           client_->ExecuteStream({batch, all, batch}));
  ASSERT_EQ(answers.size(), 3u);
  EXPECT_EQ(answers[0].outputs().at("post1.x_next").inline_data(),
            post_out.x_next().inline_data());
  EXPECT_EQ(answers[1].outputs_size(), every.outputs_size());
  EXPECT_EQ(answers[2].outputs().at("pre1.y").inline_data(),
            pre_out.y().inline_data());

  // A bad batch ends the stream with its code.
  v1::ExecuteRequest bad = batch;
  bad.add_fetch("nope.y");
  EXPECT_EQ(client_->ExecuteStream({batch, bad}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A static layer (z = beta) created from explicit parameters: Scale takes
// only the token shape, and Pre matches the reference on those parameters.
TEST_F(ServerApiTest, StaticLayerFromExplicitParameters) {
  const int n = 3;
  const int64_t c_dim = 10, m = 6;
  v1::CreateLayerRequest request = LayerRequest("static", n, c_dim);
  request.mutable_spec()->set_dynamic(false);
  request.mutable_spec()->set_has_post_bias(true);
  HostTensor beta = RandomF32({2 * n + n * n});
  HostTensor bias = RandomF32({c_dim});
  auto& tensors = *request.mutable_parameters()->mutable_tensors();
  tensors["beta"] = ToTensorRef(beta);
  tensors["bias"] = ToTensorRef(bias);
  MHC_ASSERT_OK_AND_ASSIGN(auto info, client_->CreateLayer(request));
  EXPECT_FALSE(info.spec().dynamic());
  EXPECT_EQ(info.parameter_count(), 2 * n + n * n + c_dim);
  MHC_ASSERT_OK_AND_ASSIGN(auto params, client_->GetParameters("static"));
  EXPECT_EQ(params.tensors().at("beta").inline_data(), beta.bytes);
  EXPECT_EQ(params.tensors().count("phi"), 0u);
  MHC_ASSERT_OK_AND_ASSIGN(HostLayer host,
                           client::MakeHostLayer(info.spec(), params));

  v1::ScaleRequest scale;
  scale.set_layer("static");
  scale.add_lead_shape(2);
  scale.add_lead_shape(3);
  MHC_ASSERT_OK_AND_ASSIGN(auto scale_out, client_->Scale(scale));
  HostTensor h_pre = Zeros(DType::kF32, {2, 3, n});
  HostTensor h_post = Zeros(DType::kF32, {2, 3, n});
  HostTensor logits = Zeros(DType::kF32, {2, 3, n, n});
  MHC_ASSERT_OK(
      ref_->ScaleForward({&host.spec, m, nullptr, nullptr, host.Weights(),
                          h_pre.f32(), h_post.f32(), logits.f32()},
                         {}));
  ExpectMatches(scale_out.h_pre(), h_pre, kTol, "static Scale.h_pre");
  ExpectMatches(scale_out.logits(), logits, kTol, "static Scale.logits");

  HostTensor x = client::RandomTensor(DType::kF16, {m, n, c_dim}, FreshSeed());
  v1::PreRequest pre;
  pre.set_layer("static");
  *pre.mutable_x() = ToTensorRef(x);
  MHC_ASSERT_OK_AND_ASSIGN(auto pre_out, client_->Pre(pre));
  HostTensor y = Zeros(DType::kF16, {m, c_dim});
  HostTensor hp = Zeros(DType::kF32, {m, n}), hq = Zeros(DType::kF32, {m, n});
  HostTensor hr = Zeros(DType::kF32, {m, n, n});
  MHC_ASSERT_OK(
      ref_->PreForward({&host.spec, m, DType::kF16, x.data(), host.Weights(),
                        y.data(), hp.f32(), hq.f32(), hr.f32()},
                       {}));
  ExpectMatches(pre_out.y(), y, 1e-2, "static Pre.y (fp16)");
  ExpectMatches(pre_out.h_res(), hr, kTol, "static Pre.h_res");
  pre.set_keep_projection(true);
  EXPECT_EQ(client_->Pre(pre).status().code(),
            absl::StatusCode::kInvalidArgument)
      << "a static layer has no projection to keep";
}

TEST_F(ServerApiTest, ZeroTokensIsANoOp) {
  MHC_ASSERT_OK_AND_ASSIGN(
      HostLayer host, CreateRandomLayer(*client_, LayerRequest("empty", 4, 8)));
  v1::PreRequest pre;
  pre.set_layer("empty");
  *pre.mutable_x() = ToTensorRef(Zeros(DType::kBF16, {0, 4, 8}));
  MHC_ASSERT_OK_AND_ASSIGN(auto out, client_->Pre(pre));
  EXPECT_EQ(out.y().shape_size(), 2);
  EXPECT_EQ(out.y().shape(0), 0);
  EXPECT_EQ(out.y().shape(1), 8);
  EXPECT_TRUE(out.y().inline_data().empty());
}

}  // namespace
}  // namespace mhc::testing
