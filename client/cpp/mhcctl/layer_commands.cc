// info, health and layer create|list|show|delete.
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "mhc/client/spec.h"
#include "mhc/client/tensor.h"
#include "mhcctl/commands.h"
#include "mhcctl/output.h"

namespace mhc::mhcctl {
namespace {

using client::ParseEpsPlacement;
using client::ParseLayerKind;
using client::ParseLayout;
using client::ParseMatmulPrecision;
using client::ParseOrientation;
using client::ParseSinkhornMode;

absl::Status BadFlag(absl::string_view flag, absl::string_view value) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, ": cannot parse '", value, "'"));
}

// Applies one string override flag: empty keeps the preset's value.
template <typename Parse, typename Set>
absl::Status ApplyEnum(absl::string_view flag, const std::string& value,
                       Parse parse, Set set) {
  if (value.empty()) return absl::OkStatus();
  auto parsed = parse(value);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": ", parsed.status().message()));
  }
  set(*parsed);
  return absl::OkStatus();
}

absl::Status ApplyFloat(absl::string_view flag, const std::string& value,
                        void (v1::LayerSpec::*set)(float),
                        v1::LayerSpec& spec) {
  if (value.empty()) return absl::OkStatus();
  float parsed;
  if (!absl::SimpleAtof(value, &parsed)) return BadFlag(flag, value);
  (spec.*set)(parsed);
  return absl::OkStatus();
}

std::string LayerLine(const v1::LayerInfo& info) {
  const v1::LayerSpec& s = info.spec();
  return absl::StrCat(
      info.name(), "  preset=", info.preset(),
      " kind=", v1::LayerKind_Name(s.kind()), " n=", s.n(), " C=", s.hidden(),
      " layout=", v1::Layout_Name(s.layout()), " T=", s.sinkhorn_iterations(),
      " dynamic=", s.dynamic() ? "true" : "false", " device=", info.device(),
      " params=", info.parameter_count(),
      " grad_tokens=", info.gradient_tokens(),
      " version=", info.parameters_version());
}

}  // namespace

absl::StatusOr<v1::CreateLayerRequest> CreateRequestFromFlags(
    const std::string& name, int64_t default_hidden) {
  v1::CreateLayerRequest request;
  request.set_name(name);
  request.set_preset(absl::GetFlag(FLAGS_preset));
  request.set_seed(absl::GetFlag(FLAGS_seed));
  request.set_device(absl::GetFlag(FLAGS_device));
  v1::LayerSpec& spec = *request.mutable_spec();
  spec.set_n(absl::GetFlag(FLAGS_n));
  int64_t hidden = absl::GetFlag(FLAGS_hidden);
  spec.set_hidden(hidden != 0 ? hidden : default_hidden);
  absl::Status status =
      ApplyEnum("kind", absl::GetFlag(FLAGS_kind), ParseLayerKind,
                [&](v1::LayerKind v) { spec.set_kind(v); });
  if (status.ok()) {
    status = ApplyEnum("layout", absl::GetFlag(FLAGS_layout), ParseLayout,
                       [&](v1::Layout v) { spec.set_layout(v); });
  }
  if (status.ok()) {
    status = ApplyEnum("orientation", absl::GetFlag(FLAGS_orientation),
                       ParseOrientation,
                       [&](v1::Orientation v) { spec.set_orientation(v); });
  }
  if (status.ok()) {
    status = ApplyEnum("sinkhorn_mode", absl::GetFlag(FLAGS_sinkhorn_mode),
                       ParseSinkhornMode,
                       [&](v1::SinkhornMode v) { spec.set_sinkhorn_mode(v); });
  }
  if (status.ok()) {
    status = ApplyEnum("eps_placement", absl::GetFlag(FLAGS_eps_placement),
                       ParseEpsPlacement,
                       [&](v1::EpsPlacement v) { spec.set_eps_placement(v); });
  }
  if (status.ok()) {
    status =
        ApplyEnum("matmul_precision", absl::GetFlag(FLAGS_matmul_precision),
                  ParseMatmulPrecision,
                  [&](v1::MatmulPrecision v) { spec.set_matmul_precision(v); });
  }
  if (!status.ok()) return status;
  const std::string iterations = absl::GetFlag(FLAGS_sinkhorn_iterations);
  if (!iterations.empty()) {
    int32_t t;
    if (!absl::SimpleAtoi(iterations, &t)) {
      return BadFlag("sinkhorn_iterations", iterations);
    }
    spec.set_sinkhorn_iterations(t);
  }
  for (const auto& [flag, value, setter] :
       std::vector<std::tuple<const char*, std::string,
                              void (v1::LayerSpec::*)(float)>>{
           {"eps_sk", absl::GetFlag(FLAGS_eps_sk), &v1::LayerSpec::set_eps_sk},
           {"eps_rms", absl::GetFlag(FLAGS_eps_rms),
            &v1::LayerSpec::set_eps_rms},
           {"eps_pre", absl::GetFlag(FLAGS_eps_pre),
            &v1::LayerSpec::set_eps_pre},
           {"post_mult", absl::GetFlag(FLAGS_post_mult),
            &v1::LayerSpec::set_post_mult}}) {
    absl::Status applied = ApplyFloat(flag, value, setter, spec);
    if (!applied.ok()) return applied;
  }
  const std::string dynamic = absl::GetFlag(FLAGS_dynamic);
  if (!dynamic.empty()) {
    bool parsed;
    if (!absl::SimpleAtob(dynamic, &parsed)) return BadFlag("dynamic", dynamic);
    spec.set_dynamic(parsed);
  }
  spec.set_has_gamma(absl::GetFlag(FLAGS_has_gamma));
  spec.set_has_post_bias(absl::GetFlag(FLAGS_has_post_bias));
  return request;
}

int RunInfo(client::Client& client) {
  const bool json = absl::GetFlag(FLAGS_json);
  auto info = client.GetServerInfo();
  if (!info.ok()) return ReportError("info", info.status(), json);
  if (json) {
    std::printf("%s\n", ProtoJson(*info).c_str());
    return kExitOk;
  }
  std::printf("version   %s\nbackend   %s\ndraining  %s\n",
              info->version().c_str(), info->backend().c_str(),
              info->draining() ? "yes" : "no");
  for (const v1::Device& device : info->devices()) {
    std::printf("device    %s (%s): %s\n", device.name().c_str(),
                device.backend().c_str(), device.description().c_str());
  }
  std::printf("presets   %s\n", absl::StrJoin(info->presets(), ", ").c_str());
  std::vector<std::string> dtypes;
  for (int dtype : info->dtypes()) {
    dtypes.push_back(v1::DType_Name(static_cast<v1::DType>(dtype)));
  }
  std::printf("dtypes    %s\n", absl::StrJoin(dtypes, ", ").c_str());
  const v1::Limits& l = info->limits();
  std::printf(
      "limits    message %llu B, tensor %llu B, request %llu B, in flight "
      "%d, n <= %d, T <= %d, batch ops %d\n",
      static_cast<unsigned long long>(l.max_message_bytes()),
      static_cast<unsigned long long>(l.max_tensor_bytes()),
      static_cast<unsigned long long>(l.max_request_bytes()), l.max_inflight(),
      l.max_streams(), l.max_sinkhorn_iterations(), l.max_batch_ops());
  return kExitOk;
}

int RunHealth(client::Client& client) {
  const bool json = absl::GetFlag(FLAGS_json);
  auto status = client.Health("");
  if (!status.ok()) return ReportError("health", status.status(), json);
  if (json) {
    std::printf("%s\n", JsonObject()
                            .Add("ok", *status == "SERVING")
                            .Add("status", *status)
                            .Dump()
                            .c_str());
  } else {
    std::printf("%s\n", status->c_str());
  }
  return *status == "SERVING" ? kExitOk : kExitFailure;
}

int RunLayer(client::Client& client, const std::vector<std::string>& args) {
  const bool json = absl::GetFlag(FLAGS_json);
  if (args.empty() || args.size() > 2) {
    std::fprintf(stderr, "mhcctl layer: create|list|show|delete [NAME]\n");
    return kExitUsage;
  }
  const std::string& verb = args[0];
  std::string name = args.size() == 2 ? args[1] : absl::GetFlag(FLAGS_name);
  if (verb == "list") {
    auto list = client.ListLayers();
    if (!list.ok()) return ReportError("layer list", list.status(), json);
    if (json) {
      std::printf("%s\n", ProtoJson(*list).c_str());
    } else {
      for (const v1::LayerInfo& info : list->layers()) {
        std::printf("%s\n", LayerLine(info).c_str());
      }
    }
    return kExitOk;
  }
  if (name.empty()) {
    std::fprintf(stderr, "mhcctl layer %s: needs --name\n", verb.c_str());
    return kExitUsage;
  }
  if (verb == "create") {
    auto request = CreateRequestFromFlags(name, 0);
    if (!request.ok()) {
      ReportError("layer create", request.status(), json);
      return kExitUsage;
    }
    auto info = client.CreateLayer(*request);
    if (!info.ok()) return ReportError("layer create", info.status(), json);
    std::printf("%s\n",
                json ? ProtoJson(*info).c_str() : LayerLine(*info).c_str());
    return kExitOk;
  }
  if (verb == "show") {
    auto info = client.GetLayer(name);
    if (!info.ok()) return ReportError("layer show", info.status(), json);
    std::printf("%s\n",
                json ? ProtoJson(*info).c_str() : LayerLine(*info).c_str());
    return kExitOk;
  }
  if (verb == "delete") {
    absl::Status status = client.DeleteLayer(name).status();
    if (!status.ok()) return ReportError("layer delete", status, json);
    if (json) {
      std::printf(
          "%s\n",
          JsonObject().Add("ok", true).Add("deleted", name).Dump().c_str());
    } else {
      std::printf("deleted %s\n", name.c_str());
    }
    return kExitOk;
  }
  std::fprintf(stderr, "mhcctl layer: unknown verb '%s'\n", verb.c_str());
  return kExitUsage;
}

}  // namespace mhc::mhcctl
