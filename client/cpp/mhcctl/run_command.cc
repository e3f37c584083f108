// mhcctl run: one mHC layer forward and backward through the daemon on random
// data, checked against the float64 reference backend run here.
//
// The sub-layer F between Pre and Post runs in this client: f = tanh(y)
// (--f=tanh, default) or f = y (--f=identity), rounded once to the activation
// dtype; its backward is dy = df * (1 - tanh(y)^2) (or dy = df), rounded once.
// Backward uses PostBackward with skip_dx and hands dx_next to PreBackward, so
// the layer's dx is accumulated in fp32 and rounded once (docs/SPEC.md section
// 4).
//
// Every check feeds the reference exactly the inputs the daemon saw for that
// RPC (the same rounded activations, the daemon's own H values), so an error
// is attributed to the RPC that made it rather than accumulated along the
// chain.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "mhc/backend.h"
#include "mhc/client/compare.h"
#include "mhc/client/shm.h"
#include "mhc/client/spec.h"
#include "mhc/client/tensor.h"
#include "mhc/status.h"
#include "mhcctl/commands.h"
#include "mhcctl/output.h"

namespace mhc::mhcctl {
namespace {

using client::HostLayer;
using client::HostTensor;

struct Check {
  std::string name;
  double error;
  double tolerance;
  bool ok;
};

// Outputs of the last forward/backward pass and the inputs they came from.
struct Pass {
  HostTensor x, dx_next, y, f, x_next, df, dy, dx;
  HostTensor h_pre, h_post, h_res, dh_post, dh_res;
  // A dynamic layer's projection, kept by Pre for PreBackward (inline).
  v1::TensorRef kept_h, kept_mean_square;
  std::vector<float> y_float;  // F's input before rounding, for dF
};

struct Tolerances {
  double act;   // y, x_next, df, dx
  double mix;   // H_pre, H_post, H_res (fp32 always)
  double grad;  // dH_post, dH_res, parameter gradients
};

// docs/SPEC.md section 7: fp32 1e-5 (tf32 matmuls 2e-3), bf16/fp16 1e-2 for
// everything downstream of the projection. Only CUDA backends use tf32.
Tolerances ToleranceFor(DType dtype, const LayerSpec& spec,
                        const std::string& backend) {
  bool tf32 = spec.matmul_precision == MatmulPrecision::kTf32 &&
              backend.find("cuda") != std::string::npos;
  Tolerances t;
  t.act = dtype == DType::kF32 ? (tf32 ? 2e-3 : 1e-5) : 1e-2;
  t.mix = tf32 ? 2e-3 : 1e-5;
  t.grad = tf32 ? 1e-2 : 1e-3;
  return t;
}

class Timings {
 public:
  template <typename Fn>
  auto Time(const std::string& rpc, Fn fn) {
    absl::Time start = absl::Now();
    auto result = fn();
    ms_[rpc].push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
    if (std::find(order_.begin(), order_.end(), rpc) == order_.end()) {
      order_.push_back(rpc);
    }
    return result;
  }
  std::string Json() const {
    JsonObject out;
    for (const std::string& rpc : order_) {
      std::vector<double> v = ms_.at(rpc);
      std::sort(v.begin(), v.end());
      out.AddRaw(rpc, JsonObject()
                          .Add("calls", static_cast<int64_t>(v.size()))
                          .Add("median_ms", v[v.size() / 2])
                          .Add("min_ms", v.front())
                          .Add("max_ms", v.back())
                          .Dump());
    }
    return out.Dump();
  }
  void Print() const {
    std::printf("%-16s %6s %10s %10s\n", "rpc", "calls", "median_ms", "min_ms");
    for (const std::string& rpc : order_) {
      std::vector<double> v = ms_.at(rpc);
      std::sort(v.begin(), v.end());
      std::printf("%-16s %6zu %10.3f %10.3f\n", rpc.c_str(), v.size(),
                  v[v.size() / 2], v.front());
    }
  }

 private:
  std::map<std::string, std::vector<double>> ms_;
  std::vector<std::string> order_;
};

// With --shm: the forward tensors travel through one shared-memory object
// registered as region "run" of a session, packed 64-byte aligned.
class ShmStage {
 public:
  static absl::StatusOr<std::unique_ptr<ShmStage>> Open(client::Client& client,
                                                        uint64_t bytes) {
    auto stage = std::make_unique<ShmStage>();
    MHC_ASSIGN_OR_RETURN(stage->session_, client::Session::Open(client));
    MHC_ASSIGN_OR_RETURN(
        stage->object_,
        client::SharedMemoryObject::Create(
            client::UniqueShmKey("mhcd_mhcctl_", "run"), bytes));
    MHC_RETURN_IF_ERROR(client.RegisterSystemSharedMemory(
        "run", stage->object_->key(), 0, bytes));
    return stage;
  }

  void Reset() { next_ = 0; }
  absl::StatusOr<v1::TensorRef> In(const HostTensor& tensor) {
    MHC_ASSIGN_OR_RETURN(uint64_t offset, Reserve(tensor.bytes.size()));
    std::memcpy(object_->data() + offset, tensor.bytes.data(),
                tensor.bytes.size());
    return client::ShmTensorRef(tensor.dtype, tensor.shape, "run", offset);
  }
  absl::StatusOr<v1::SharedMemoryRef> Out(uint64_t bytes) {
    MHC_ASSIGN_OR_RETURN(uint64_t offset, Reserve(bytes));
    return client::ShmRef("run", offset, bytes);
  }
  // An output the daemon wrote into the region.
  absl::StatusOr<HostTensor> Read(const v1::TensorRef& ref) const {
    v1::TensorRef copy = ref;
    const v1::SharedMemoryRef& shm = ref.shm();
    if (shm.offset() > object_->size() ||
        shm.byte_size() > object_->size() - shm.offset()) {
      return absl::InternalError("shm output outside the object");
    }
    copy.set_inline_data(object_->data() + shm.offset(), shm.byte_size());
    return client::FromTensorRef(copy);
  }

 private:
  absl::StatusOr<uint64_t> Reserve(uint64_t bytes) {
    const uint64_t offset = next_;
    next_ += (bytes + 63) / 64 * 64;
    if (next_ > object_->size()) {
      return absl::InternalError("--shm: staging object too small");
    }
    return offset;
  }

  std::unique_ptr<client::Session> session_;
  std::unique_ptr<client::SharedMemoryObject> object_;
  uint64_t next_ = 0;
};

// The daemon's output: inline bytes, or its region with --shm.
absl::StatusOr<HostTensor> Read(const v1::TensorRef& ref,
                                absl::string_view what,
                                const ShmStage* shm = nullptr) {
  auto tensor = ref.has_shm() && shm != nullptr ? shm->Read(ref)
                                                : client::FromTensorRef(ref);
  if (!tensor.ok()) {
    return absl::InternalError(
        absl::StrCat(what, ": ", tensor.status().message()));
  }
  return tensor;
}

std::map<std::string, std::vector<float>> GradientFloats(
    const v1::GetGradientsResponse& response) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& [name, ref] : response.gradients().tensors()) {
    auto tensor = client::FromTensorRef(ref);
    if (tensor.ok()) out[name] = tensor->ToFloats();
  }
  return out;
}

// One forward and backward pass through the daemon.
absl::Status RunPass(client::Client& client, const std::string& layer,
                     const std::string& f_kind, Timings& timings, Pass& p,
                     const LayerSpec& spec, ShmStage* shm) {
  const int64_t streams = spec.n;
  v1::PreRequest pre;
  pre.set_layer(layer);
  *pre.mutable_x() = client::ToTensorRef(p.x);
  pre.set_keep_projection(spec.dynamic);
  if (shm != nullptr) {
    shm->Reset();
    MHC_ASSIGN_OR_RETURN(*pre.mutable_x(), shm->In(p.x));
    // y is x summed over the streams; the mixing values are f32.
    const uint64_t n = static_cast<uint64_t>(streams);
    const uint64_t tokens = static_cast<uint64_t>(p.x.shape.front());
    const uint64_t sizes[4] = {p.x.bytes.size() / n, tokens * n * 4,
                               tokens * n * 4, tokens * n * n * 4};
    const char* names[4] = {"y", "h_pre", "h_post", "h_res"};
    for (int i = 0; i < 4; ++i) {
      MHC_ASSIGN_OR_RETURN((*pre.mutable_output_regions())[names[i]],
                           shm->Out(sizes[i]));
    }
  }
  MHC_ASSIGN_OR_RETURN(v1::PreResponse pre_out,
                       timings.Time("Pre", [&] { return client.Pre(pre); }));
  MHC_ASSIGN_OR_RETURN(p.y, Read(pre_out.y(), "Pre.y", shm));
  MHC_ASSIGN_OR_RETURN(p.h_pre, Read(pre_out.h_pre(), "Pre.h_pre", shm));
  MHC_ASSIGN_OR_RETURN(p.h_post, Read(pre_out.h_post(), "Pre.h_post", shm));
  MHC_ASSIGN_OR_RETURN(p.h_res, Read(pre_out.h_res(), "Pre.h_res", shm));
  p.kept_h = pre_out.h();
  p.kept_mean_square = pre_out.mean_square();

  // F, locally.
  p.y_float = p.y.ToFloats();
  p.f = client::Zeros(p.y.dtype, p.y.shape);
  for (size_t i = 0; i < p.y_float.size(); ++i) {
    p.f.Set(static_cast<int64_t>(i),
            f_kind == "tanh" ? std::tanh(p.y_float[i]) : p.y_float[i]);
  }

  v1::PostRequest post;
  post.set_layer(layer);
  *post.mutable_f() = client::ToTensorRef(p.f);
  *post.mutable_x() = client::ToTensorRef(p.x);
  *post.mutable_h_post() = client::ToTensorRef(p.h_post);
  *post.mutable_h_res() = client::ToTensorRef(p.h_res);
  if (shm != nullptr) {
    shm->Reset();
    MHC_ASSIGN_OR_RETURN(*post.mutable_f(), shm->In(p.f));
    MHC_ASSIGN_OR_RETURN(*post.mutable_x(), shm->In(p.x));
    MHC_ASSIGN_OR_RETURN(*post.mutable_h_post(), shm->In(p.h_post));
    MHC_ASSIGN_OR_RETURN(*post.mutable_h_res(), shm->In(p.h_res));
    MHC_ASSIGN_OR_RETURN((*post.mutable_output_regions())["x_next"],
                         shm->Out(p.x.bytes.size()));
  }
  MHC_ASSIGN_OR_RETURN(v1::PostResponse post_out,
                       timings.Time("Post", [&] { return client.Post(post); }));
  MHC_ASSIGN_OR_RETURN(p.x_next, Read(post_out.x_next(), "Post.x_next", shm));

  v1::PostBackwardRequest post_bwd;
  post_bwd.set_layer(layer);
  *post_bwd.mutable_dx_next() = client::ToTensorRef(p.dx_next);
  *post_bwd.mutable_f() = client::ToTensorRef(p.f);
  *post_bwd.mutable_x() = client::ToTensorRef(p.x);
  *post_bwd.mutable_h_post() = client::ToTensorRef(p.h_post);
  *post_bwd.mutable_h_res() = client::ToTensorRef(p.h_res);
  post_bwd.set_skip_dx(true);
  MHC_ASSIGN_OR_RETURN(v1::PostBackwardResponse post_bwd_out,
                       timings.Time("PostBackward", [&] {
                         return client.PostBackward(post_bwd);
                       }));
  MHC_ASSIGN_OR_RETURN(p.df, Read(post_bwd_out.df(), "PostBackward.df"));
  MHC_ASSIGN_OR_RETURN(p.dh_post,
                       Read(post_bwd_out.dh_post(), "PostBackward.dh_post"));
  MHC_ASSIGN_OR_RETURN(p.dh_res,
                       Read(post_bwd_out.dh_res(), "PostBackward.dh_res"));

  // F backward, locally.
  p.dy = client::Zeros(p.df.dtype, p.df.shape);
  for (int64_t i = 0; i < p.df.elements(); ++i) {
    float t = std::tanh(p.y_float[i]);
    float grad = f_kind == "tanh" ? p.df.Get(i) * (1.0f - t * t) : p.df.Get(i);
    p.dy.Set(i, grad);
  }

  v1::PreBackwardRequest pre_bwd;
  pre_bwd.set_layer(layer);
  *pre_bwd.mutable_x() = client::ToTensorRef(p.x);
  *pre_bwd.mutable_dy() = client::ToTensorRef(p.dy);
  *pre_bwd.mutable_dh_post() = client::ToTensorRef(p.dh_post);
  *pre_bwd.mutable_dh_res() = client::ToTensorRef(p.dh_res);
  *pre_bwd.mutable_dx_next() = client::ToTensorRef(p.dx_next);
  if (spec.dynamic) {
    *pre_bwd.mutable_h() = p.kept_h;
    *pre_bwd.mutable_mean_square() = p.kept_mean_square;
  }
  MHC_ASSIGN_OR_RETURN(
      v1::PreBackwardResponse pre_bwd_out,
      timings.Time("PreBackward", [&] { return client.PreBackward(pre_bwd); }));
  MHC_ASSIGN_OR_RETURN(p.dx, Read(pre_bwd_out.dx(), "PreBackward.dx"));
  return absl::OkStatus();
}

// Recomputes the pass with the float64 reference and compares.
absl::StatusOr<std::vector<Check>> CheckPass(
    const Pass& p, HostLayer& host, const Tolerances& tol, int64_t tokens,
    int iterations, const std::map<std::string, std::vector<float>>& grads0,
    const std::map<std::string, std::vector<float>>& grads1) {
  std::unique_ptr<Backend> ref = MakeReferenceBackend();
  const LayerSpec& spec = host.spec;
  const DType dtype = p.x.dtype;
  std::vector<Check> checks;
  auto compare = [&](const std::string& name, const HostTensor& got,
                     const HostTensor& want, double tolerance) {
    client::Comparison c = client::Compare(got.ToFloats(), want.ToFloats());
    checks.push_back({name, c.error, tolerance, c.Within(tolerance)});
  };
  auto finite = [&](const std::string& name, const HostTensor& t) {
    bool ok = client::AllFinite(t.ToFloats());
    checks.push_back({name + " finite", ok ? 0.0 : NAN, 0.0, ok});
  };

  HostTensor y = client::Zeros(dtype, p.y.shape);
  HostTensor h_pre = client::Zeros(DType::kF32, p.h_pre.shape);
  HostTensor h_post = client::Zeros(DType::kF32, p.h_post.shape);
  HostTensor h_res = client::Zeros(DType::kF32, p.h_res.shape);
  PreForwardParams pre{&spec,       tokens,         dtype,
                       p.x.data(),  host.Weights(), y.data(),
                       h_pre.f32(), h_post.f32(),   h_res.f32()};
  MHC_RETURN_IF_ERROR(ref->PreForward(pre, {}));
  compare("y", p.y, y, tol.act);
  compare("h_pre", p.h_pre, h_pre, tol.mix);
  compare("h_post", p.h_post, h_post, tol.mix);
  compare("h_res", p.h_res, h_res, tol.mix);
  double colsum = client::MaxColumnSumError(p.h_res.ToFloats(), spec.n);
  checks.push_back({"h_res column sums", colsum, 1e-5, colsum <= 1e-5});

  HostTensor x_next = client::Zeros(dtype, p.x.shape);
  PostForwardParams post{&spec,         tokens,         dtype,
                         p.f.data(),    p.x.data(),     p.h_post.f32(),
                         p.h_res.f32(), host.Weights(), x_next.data()};
  MHC_RETURN_IF_ERROR(ref->PostForward(post, {}));
  compare("x_next", p.x_next, x_next, tol.act);

  HostTensor df = client::Zeros(dtype, p.f.shape);
  HostTensor dh_post = client::Zeros(DType::kF32, p.h_post.shape);
  HostTensor dh_res = client::Zeros(DType::kF32, p.h_res.shape);
  PostBackwardParams post_bwd;
  post_bwd.spec = &spec;
  post_bwd.tokens = tokens;
  post_bwd.act_dtype = dtype;
  post_bwd.dx_next = p.dx_next.data();
  post_bwd.f = p.f.data();
  post_bwd.x = p.x.data();
  post_bwd.h_post = p.h_post.f32();
  post_bwd.h_res = p.h_res.f32();
  post_bwd.weights = host.Weights();
  post_bwd.df = df.data();
  post_bwd.dh_post = dh_post.f32();
  post_bwd.dh_res = dh_res.f32();
  post_bwd.grads = host.Grads();
  MHC_RETURN_IF_ERROR(ref->PostBackward(post_bwd, {}));
  compare("df", p.df, df, tol.act);
  compare("dh_post", p.dh_post, dh_post, tol.grad);
  compare("dh_res", p.dh_res, dh_res, tol.grad);

  HostTensor dx = client::Zeros(dtype, p.x.shape);
  PreBackwardParams pre_bwd;
  pre_bwd.spec = &spec;
  pre_bwd.tokens = tokens;
  pre_bwd.act_dtype = dtype;
  pre_bwd.x = p.x.data();
  pre_bwd.weights = host.Weights();
  pre_bwd.dy = p.dy.data();
  pre_bwd.dh_post = p.dh_post.f32();
  pre_bwd.dh_res = p.dh_res.f32();
  pre_bwd.dx_next = p.dx_next.data();
  pre_bwd.dx = dx.data();
  pre_bwd.grads = host.Grads();
  MHC_RETURN_IF_ERROR(ref->PreBackward(pre_bwd, {}));
  compare("dx", p.dx, dx, tol.act);

  finite("y", p.y);
  finite("x_next", p.x_next);
  finite("df", p.df);
  finite("dx", p.dx);

  // Gradients accumulate over the passes; every pass used the same data.
  for (const auto& [name, want_one] : host.gradients) {
    auto after = grads1.find(name);
    if (after == grads1.end()) {
      checks.push_back({"grad " + name + " present", NAN, 0.0, false});
      continue;
    }
    auto before = grads0.find(name);
    std::vector<float> got = after->second;
    std::vector<float> want = want_one;
    for (size_t i = 0; i < got.size(); ++i) {
      if (before != grads0.end() && i < before->second.size()) {
        got[i] -= before->second[i];
      }
    }
    for (float& w : want) w *= static_cast<float>(iterations);
    client::Comparison c = client::Compare(got, want);
    checks.push_back({"grad " + name, c.error, tol.grad, c.Within(tol.grad)});
  }
  return checks;
}

std::string UniqueLayerName() {
  return absl::StrCat("mhcctl-run-", getpid(), "-",
                      absl::ToUnixMicros(absl::Now()));
}

}  // namespace

int RunRun(client::Client& client) {
  const bool json = absl::GetFlag(FLAGS_json);
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  const int iterations = absl::GetFlag(FLAGS_iterations);
  const std::string f_kind = absl::GetFlag(FLAGS_f);
  auto dtype = client::ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok() || tokens < 1 || iterations < 1 ||
      (f_kind != "tanh" && f_kind != "identity")) {
    ReportError("run",
                dtype.ok() ? absl::InvalidArgumentError(
                                 "--tokens and --iterations must be >= 1, "
                                 "--f tanh or identity")
                           : dtype.status(),
                json);
    return kExitUsage;
  }
  auto server = client.GetServerInfo();
  if (!server.ok()) return ReportError("run", server.status(), json);

  std::string layer = absl::GetFlag(FLAGS_layer);
  const bool create = layer.empty();
  v1::LayerInfo info;
  if (create) {
    layer = UniqueLayerName();
    auto request = CreateRequestFromFlags(layer, 256);
    if (!request.ok()) {
      ReportError("run", request.status(), json);
      return kExitUsage;
    }
    auto created = client.CreateLayer(*request);
    if (!created.ok()) return ReportError("run", created.status(), json);
    info = *created;
  } else {
    auto existing = client.GetLayer(layer);
    if (!existing.ok()) return ReportError("run", existing.status(), json);
    info = *existing;
  }

  // Everything after creation funnels through here so the layer is deleted.
  absl::Status status;
  Pass pass;
  Timings timings;
  std::vector<Check> checks;
  HostLayer host;
  std::map<std::string, std::vector<float>> grads0, grads1;
  [&] {
    if (info.spec().kind() != v1::LAYER_KIND_MHC) {
      status = absl::FailedPreconditionError(
          absl::StrCat("layer ", layer, " is not an MHC layer"));
      return;
    }
    auto params = client.GetParameters(layer);
    if (!params.ok()) return void(status = params.status());
    auto host_or = client::MakeHostLayer(info.spec(), *params);
    if (!host_or.ok()) return void(status = host_or.status());
    host = *std::move(host_or);
    auto before = client.GetGradients(layer);
    if (!before.ok()) return void(status = before.status());
    grads0 = GradientFloats(*before);

    std::vector<int64_t> x_shape = {tokens};
    for (int64_t d : client::StreamDims(host.spec)) x_shape.push_back(d);
    const uint64_t seed = absl::GetFlag(FLAGS_data_seed);
    pass.x = client::RandomTensor(*dtype, x_shape, seed);
    pass.dx_next = client::RandomTensor(*dtype, x_shape, seed + 1);
    std::unique_ptr<ShmStage> shm;
    if (absl::GetFlag(FLAGS_shm)) {
      // Post's inputs and output: f, x, h_post, h_res, x_next.
      auto opened =
          ShmStage::Open(client, 4 * pass.x.bytes.size() + (uint64_t{1} << 20));
      if (!opened.ok()) return void(status = opened.status());
      shm = *std::move(opened);
    }
    for (int i = 0; i < iterations && status.ok(); ++i) {
      status =
          RunPass(client, layer, f_kind, timings, pass, host.spec, shm.get());
    }
    if (!status.ok()) return;
    auto after = timings.Time("GetGradients",
                              [&] { return client.GetGradients(layer); });
    if (!after.ok()) return void(status = after.status());
    grads1 = GradientFloats(*after);
    auto checked = CheckPass(pass, host,
                             ToleranceFor(*dtype, host.spec, server->backend()),
                             tokens, iterations, grads0, grads1);
    if (!checked.ok()) return void(status = checked.status());
    checks = *std::move(checked);
    const std::string optimizer = absl::GetFlag(FLAGS_optimizer);
    if (optimizer.empty()) return;
    v1::OptimizerStepRequest step;
    step.add_layers(layer);
    step.set_learning_rate(absl::GetFlag(FLAGS_learning_rate));
    step.set_max_grad_norm(1.0f);
    step.set_zero_gradients(true);
    if (optimizer == "sgd") {
      step.mutable_sgd()->set_momentum(0.9f);
    } else if (optimizer == "adamw") {
      step.mutable_adamw();
    } else {
      status = absl::InvalidArgumentError(absl::StrCat(
          "--optimizer: expected sgd or adamw, got '", optimizer, "'"));
      return;
    }
    status =
        timings
            .Time("OptimizerStep", [&] { return client.OptimizerStep(step); })
            .status();
  }();
  if (create) {
    absl::Status deleted = client.DeleteLayer(layer).status();
    if (status.ok()) status = deleted;
  }
  if (!status.ok()) return ReportError("run", status, json);

  int failed = 0;
  for (const Check& c : checks) failed += c.ok ? 0 : 1;
  const LayerSpec& spec = host.spec;
  if (json) {
    std::string check_list = "[";
    for (size_t i = 0; i < checks.size(); ++i) {
      if (i > 0) check_list += ",";
      check_list += JsonObject()
                        .Add("name", checks[i].name)
                        .Add("error", checks[i].error)
                        .Add("tolerance", checks[i].tolerance)
                        .Add("ok", checks[i].ok)
                        .Dump();
    }
    check_list += "]";
    JsonObject shapes;
    shapes.AddRaw("x", JsonIntArray(pass.x.shape))
        .AddRaw("y", JsonIntArray(pass.y.shape))
        .AddRaw("h_pre", JsonIntArray(pass.h_pre.shape))
        .AddRaw("h_post", JsonIntArray(pass.h_post.shape))
        .AddRaw("h_res", JsonIntArray(pass.h_res.shape))
        .AddRaw("x_next", JsonIntArray(pass.x_next.shape))
        .AddRaw("dx", JsonIntArray(pass.dx.shape));
    std::printf("%s\n", JsonObject()
                            .Add("ok", failed == 0)
                            .Add("layer", layer)
                            .Add("created", create)
                            .Add("preset", info.preset())
                            .Add("backend", server->backend())
                            .Add("device", info.device())
                            .Add("dtype", DTypeName(*dtype))
                            .Add("tokens", tokens)
                            .Add("n", spec.n)
                            .Add("hidden", spec.hidden)
                            .Add("layout", LayoutName(spec.layout))
                            .Add("f", f_kind)
                            .Add("iterations", iterations)
                            .AddRaw("shapes", shapes.Dump())
                            .AddRaw("timings_ms", timings.Json())
                            .AddRaw("checks", check_list)
                            .Add("failed_checks", failed)
                            .Dump()
                            .c_str());
  } else {
    std::printf(
        "layer %s (%s, n=%d, C=%lld, %s) on %s [%s]%s\n", layer.c_str(),
        info.preset().c_str(), spec.n, static_cast<long long>(spec.hidden),
        std::string(LayoutName(spec.layout)).c_str(), info.device().c_str(),
        server->backend().c_str(), create ? ", created and deleted" : "");
    std::printf("x %s, y %s, H_res %s, F = %s, %d iteration(s)\n\n",
                client::DescribeTensor(client::ToTensorRef(pass.x)).c_str(),
                client::DescribeTensor(client::ToTensorRef(pass.y)).c_str(),
                client::DescribeTensor(client::ToTensorRef(pass.h_res)).c_str(),
                f_kind.c_str(), iterations);
    timings.Print();
    std::printf("\n%-22s %12s %12s\n", "check vs fp64", "error", "tolerance");
    for (const Check& c : checks) {
      std::printf("%-22s %12.3g %12.3g  %s\n", c.name.c_str(), c.error,
                  c.tolerance, c.ok ? "ok" : "FAILED");
    }
    std::printf("\n%s: %d of %zu checks failed\n", failed ? "FAIL" : "PASS",
                failed, checks.size());
  }
  return failed == 0 ? kExitOk : kExitFailure;
}

}  // namespace mhc::mhcctl
