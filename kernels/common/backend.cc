// The validating entry points of Backend: checked once here for every
// backend, so implementations can assume well-formed params. Also the
// synchronous defaults of the overlapped copies.
#include "mhc/backend.h"

#include <initializer_list>
#include <utility>

#include "absl/strings/str_cat.h"
#include "mhc/status.h"

namespace mhc {

absl::string_view OpFamilyName(OpKind op) {
  static constexpr absl::string_view kNames[] = {
      "projection", "scale",  "sinkhorn", "aggregate",
      "post",       "expand", "pre",      "head"};
  return kNames[static_cast<int>(op) / 2];
}

absl::string_view OpDirectionName(OpKind op) {
  return static_cast<int>(op) % 2 == 0 ? "forward" : "backward";
}

absl::StatusOr<CopyTicket> Backend::CopyToDeviceAsync(void* dst,
                                                      const void* host_src,
                                                      size_t bytes) {
  if (bytes == 0) return kNoCopy;
  MHC_RETURN_IF_ERROR(CopyToDevice(dst, host_src, bytes));
  return kNoCopy;  // already complete
}

absl::Status Backend::OpsWaitForCopy(CopyTicket) { return absl::OkStatus(); }

absl::Status Backend::WaitForEvent(DeviceEvent) {
  return absl::FailedPreconditionError(
      absl::StrCat("the ", Name(),
                   " backend runs each op to completion; it has no "
                   "stream to order with other processes' events"));
}

absl::Status Backend::RecordEvent(DeviceEvent event) {
  return WaitForEvent(event);
}

absl::Status Backend::WriteWordAfterWork(void*, uint32_t) {
  return WaitForEvent(nullptr);
}

absl::string_view Backend::KernelVariant(const ProjectionForwardParams&) const {
  return kDefaultVariant;
}

absl::string_view Backend::KernelVariant(
    const ProjectionBackwardParams&) const {
  return kDefaultVariant;
}

absl::string_view Backend::KernelVariant(const ScaleForwardParams&) const {
  return kDefaultVariant;
}

absl::string_view Backend::KernelVariant(const ScaleBackwardParams&) const {
  return kDefaultVariant;
}

absl::string_view Backend::KernelVariant(const SinkhornForwardParams&) const {
  return kDefaultVariant;
}

absl::string_view Backend::KernelVariant(const SinkhornBackwardParams&) const {
  return kDefaultVariant;
}

absl::string_view Backend::KernelVariant(const AggregateForwardParams&) const {
  return kDefaultVariant;
}

absl::string_view Backend::KernelVariant(const AggregateBackwardParams&) const {
  return kDefaultVariant;
}

absl::string_view Backend::KernelVariant(const PostForwardParams&) const {
  return kDefaultVariant;
}

absl::string_view Backend::KernelVariant(const PostBackwardParams&) const {
  return kDefaultVariant;
}

absl::string_view Backend::KernelVariant(const ExpandForwardParams&) const {
  return kDefaultVariant;
}

absl::string_view Backend::KernelVariant(const ExpandBackwardParams&) const {
  return kDefaultVariant;
}

absl::string_view Backend::KernelVariant(const PreForwardParams&) const {
  return kDefaultVariant;
}

absl::string_view Backend::KernelVariant(const PreBackwardParams&) const {
  return kDefaultVariant;
}

absl::string_view Backend::KernelVariant(const HeadForwardParams&) const {
  return kDefaultVariant;
}

absl::string_view Backend::KernelVariant(const HeadBackwardParams&) const {
  return kDefaultVariant;
}

absl::StatusOr<Backend::ExportedMemory> Backend::ExportMemory(void*) {
  return absl::UnimplementedError(
      absl::StrCat("the ", Name(),
                   " backend's memory cannot be shared with other "
                   "processes"));
}

absl::Status Backend::CopyToHostAsync(void* host_dst, const void* src,
                                      size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return CopyToHost(host_dst, src, bytes);
}

namespace {

using Pointers = std::initializer_list<std::pair<const char*, const void*>>;

enum class KindRule { kAny, kMhc, kDynamic, kHead };

// Checks what every op needs: a valid spec of the right kind and M >= 0.
absl::Status CheckCommon(absl::string_view op, const LayerSpec* spec,
                         int64_t tokens, KindRule rule) {
  if (spec == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": spec is null"));
  }
  absl::Status spec_status = ValidateSpec(*spec);
  if (!spec_status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", spec_status.message()));
  }
  if (tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": tokens must be >= 0, got ", tokens));
  }
  if (rule == KindRule::kMhc && spec->kind != LayerKind::kMhc) {
    return absl::FailedPreconditionError(
        absl::StrCat(op, ": needs an MHC layer, not a HEAD layer"));
  }
  if (rule == KindRule::kDynamic && !spec->dynamic) {
    return absl::FailedPreconditionError(absl::StrCat(
        op, ": needs a dynamic layer (static layers have no phi)"));
  }
  if (rule == KindRule::kHead && spec->kind != LayerKind::kHead) {
    return absl::FailedPreconditionError(
        absl::StrCat(op, ": needs a HEAD layer"));
  }
  return absl::OkStatus();
}

// Pointers are only dereferenced when there is at least one token.
absl::Status CheckPointers(absl::string_view op, int64_t tokens,
                           Pointers pointers) {
  if (tokens == 0) return absl::OkStatus();
  for (const auto& [name, pointer] : pointers) {
    if (pointer == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": ", name, " is required but null"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckDType(absl::string_view op, DType dtype) {
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": act_dtype must be f32, f16 or bf16"));
  }
  return absl::OkStatus();
}

// phi/alpha (dynamic), beta, and gamma when the spec has it.
absl::Status CheckLogitWeights(absl::string_view op, const LayerSpec& spec,
                               int64_t tokens, const LayerWeights& w) {
  MHC_RETURN_IF_ERROR(CheckPointers(op, tokens, {{"weights.beta", w.beta}}));
  if (spec.dynamic) {
    MHC_RETURN_IF_ERROR(CheckPointers(
        op, tokens, {{"weights.phi", w.phi}, {"weights.alpha", w.alpha}}));
  }
  if (spec.has_gamma) {
    MHC_RETURN_IF_ERROR(
        CheckPointers(op, tokens, {{"weights.gamma", w.gamma}}));
  }
  return absl::OkStatus();
}

// The pre ops' kept projection: h and mean_square both or neither, and only
// for dynamic layers (a static layer has no projection to keep).
absl::Status CheckKeptProjection(absl::string_view op, const LayerSpec& spec,
                                 const void* h, const void* mean_square) {
  if ((h == nullptr) != (mean_square == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": h and mean_square go together (",
                     h == nullptr ? "h" : "mean_square", " is null)"));
  }
  if (h != nullptr && !spec.dynamic) {
    return absl::InvalidArgumentError(absl::StrCat(
        op,
        ": h / mean_square given for a static layer (it has no projection)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Backend::ProjectionForward(const ProjectionForwardParams& p,
                                        Workspace ws) {
  constexpr absl::string_view kOp = "projection forward";
  MHC_RETURN_IF_ERROR(CheckCommon(kOp, p.spec, p.tokens, KindRule::kDynamic));
  MHC_RETURN_IF_ERROR(CheckDType(kOp, p.act_dtype));
  MHC_RETURN_IF_ERROR(CheckPointers(kOp, p.tokens,
                                    {{"x", p.x},
                                     {"weights.phi", p.weights.phi},
                                     {"h", p.h},
                                     {"mean_square", p.mean_square}}));
  if (p.spec->has_gamma) {
    MHC_RETURN_IF_ERROR(
        CheckPointers(kOp, p.tokens, {{"weights.gamma", p.weights.gamma}}));
  }
  if (p.tokens == 0) return absl::OkStatus();
  return RunProjectionForward(p, ws);
}

absl::Status Backend::ProjectionBackward(const ProjectionBackwardParams& p,
                                         Workspace ws) {
  constexpr absl::string_view kOp = "projection backward";
  MHC_RETURN_IF_ERROR(CheckCommon(kOp, p.spec, p.tokens, KindRule::kDynamic));
  MHC_RETURN_IF_ERROR(CheckDType(kOp, p.act_dtype));
  MHC_RETURN_IF_ERROR(CheckPointers(kOp, p.tokens,
                                    {{"x", p.x},
                                     {"weights.phi", p.weights.phi},
                                     {"dh", p.dh},
                                     {"dmean_square", p.dmean_square},
                                     {"dx", p.dx}}));
  if (p.spec->has_gamma) {
    MHC_RETURN_IF_ERROR(
        CheckPointers(kOp, p.tokens, {{"weights.gamma", p.weights.gamma}}));
  }
  if (p.tokens == 0) return absl::OkStatus();
  return RunProjectionBackward(p, ws);
}

absl::Status Backend::ScaleForward(const ScaleForwardParams& p, Workspace ws) {
  constexpr absl::string_view kOp = "scale forward";
  MHC_RETURN_IF_ERROR(CheckCommon(kOp, p.spec, p.tokens, KindRule::kAny));
  MHC_RETURN_IF_ERROR(CheckPointers(
      kOp, p.tokens, {{"weights.beta", p.weights.beta}, {"h_pre", p.h_pre}}));
  if (p.spec->dynamic) {
    MHC_RETURN_IF_ERROR(CheckPointers(kOp, p.tokens,
                                      {{"h", p.h},
                                       {"mean_square", p.mean_square},
                                       {"weights.alpha", p.weights.alpha}}));
  }
  if (p.spec->kind == LayerKind::kMhc) {
    MHC_RETURN_IF_ERROR(CheckPointers(
        kOp, p.tokens, {{"h_post", p.h_post}, {"logits", p.logits}}));
  }
  if (p.tokens == 0) return absl::OkStatus();
  return RunScaleForward(p, ws);
}

absl::Status Backend::ScaleBackward(const ScaleBackwardParams& p,
                                    Workspace ws) {
  constexpr absl::string_view kOp = "scale backward";
  MHC_RETURN_IF_ERROR(CheckCommon(kOp, p.spec, p.tokens, KindRule::kAny));
  MHC_RETURN_IF_ERROR(CheckPointers(
      kOp, p.tokens, {{"weights.beta", p.weights.beta}, {"dh_pre", p.dh_pre}}));
  if (p.spec->dynamic) {
    MHC_RETURN_IF_ERROR(CheckPointers(kOp, p.tokens,
                                      {{"h", p.h},
                                       {"mean_square", p.mean_square},
                                       {"weights.alpha", p.weights.alpha},
                                       {"dh", p.dh},
                                       {"dmean_square", p.dmean_square}}));
  }
  if (p.spec->kind == LayerKind::kMhc) {
    MHC_RETURN_IF_ERROR(CheckPointers(
        kOp, p.tokens, {{"dh_post", p.dh_post}, {"dlogits", p.dlogits}}));
  }
  if (p.tokens == 0) return absl::OkStatus();
  return RunScaleBackward(p, ws);
}

absl::Status Backend::SinkhornForward(const SinkhornForwardParams& p,
                                      Workspace ws) {
  constexpr absl::string_view kOp = "sinkhorn forward";
  MHC_RETURN_IF_ERROR(CheckCommon(kOp, p.spec, p.tokens, KindRule::kMhc));
  MHC_RETURN_IF_ERROR(
      CheckPointers(kOp, p.tokens, {{"logits", p.logits}, {"h_res", p.h_res}}));
  if (p.tokens == 0) return absl::OkStatus();
  return RunSinkhornForward(p, ws);
}

absl::Status Backend::SinkhornBackward(const SinkhornBackwardParams& p,
                                       Workspace ws) {
  constexpr absl::string_view kOp = "sinkhorn backward";
  MHC_RETURN_IF_ERROR(CheckCommon(kOp, p.spec, p.tokens, KindRule::kMhc));
  MHC_RETURN_IF_ERROR(CheckPointers(
      kOp, p.tokens,
      {{"logits", p.logits}, {"dh_res", p.dh_res}, {"dlogits", p.dlogits}}));
  if (p.tokens == 0) return absl::OkStatus();
  return RunSinkhornBackward(p, ws);
}

absl::Status Backend::AggregateForward(const AggregateForwardParams& p,
                                       Workspace ws) {
  constexpr absl::string_view kOp = "aggregate forward";
  MHC_RETURN_IF_ERROR(CheckCommon(kOp, p.spec, p.tokens, KindRule::kAny));
  MHC_RETURN_IF_ERROR(CheckDType(kOp, p.act_dtype));
  MHC_RETURN_IF_ERROR(CheckPointers(
      kOp, p.tokens, {{"x", p.x}, {"h_pre", p.h_pre}, {"y", p.y}}));
  if (p.tokens == 0) return absl::OkStatus();
  return RunAggregateForward(p, ws);
}

absl::Status Backend::AggregateBackward(const AggregateBackwardParams& p,
                                        Workspace ws) {
  constexpr absl::string_view kOp = "aggregate backward";
  MHC_RETURN_IF_ERROR(CheckCommon(kOp, p.spec, p.tokens, KindRule::kAny));
  MHC_RETURN_IF_ERROR(CheckDType(kOp, p.act_dtype));
  MHC_RETURN_IF_ERROR(CheckPointers(kOp, p.tokens,
                                    {{"x", p.x},
                                     {"h_pre", p.h_pre},
                                     {"dy", p.dy},
                                     {"dx", p.dx},
                                     {"dh_pre", p.dh_pre}}));
  if (p.tokens == 0) return absl::OkStatus();
  return RunAggregateBackward(p, ws);
}

absl::Status Backend::PostForward(const PostForwardParams& p, Workspace ws) {
  constexpr absl::string_view kOp = "post forward";
  MHC_RETURN_IF_ERROR(CheckCommon(kOp, p.spec, p.tokens, KindRule::kMhc));
  MHC_RETURN_IF_ERROR(CheckDType(kOp, p.act_dtype));
  MHC_RETURN_IF_ERROR(CheckPointers(kOp, p.tokens,
                                    {{"f", p.f},
                                     {"x", p.x},
                                     {"h_post", p.h_post},
                                     {"h_res", p.h_res},
                                     {"x_next", p.x_next}}));
  if (p.spec->has_post_bias) {
    MHC_RETURN_IF_ERROR(
        CheckPointers(kOp, p.tokens, {{"weights.bias", p.weights.bias}}));
  }
  if (p.tokens == 0) return absl::OkStatus();
  return RunPostForward(p, ws);
}

absl::Status Backend::PostBackward(const PostBackwardParams& p, Workspace ws) {
  constexpr absl::string_view kOp = "post backward";
  MHC_RETURN_IF_ERROR(CheckCommon(kOp, p.spec, p.tokens, KindRule::kMhc));
  MHC_RETURN_IF_ERROR(CheckDType(kOp, p.act_dtype));
  MHC_RETURN_IF_ERROR(CheckPointers(kOp, p.tokens,
                                    {{"dx_next", p.dx_next},
                                     {"f", p.f},
                                     {"x", p.x},
                                     {"h_post", p.h_post},
                                     {"h_res", p.h_res},
                                     {"df", p.df},
                                     {"dh_post", p.dh_post},
                                     {"dh_res", p.dh_res}}));
  if (p.spec->has_post_bias) {
    MHC_RETURN_IF_ERROR(
        CheckPointers(kOp, p.tokens, {{"weights.bias", p.weights.bias}}));
  }
  if (p.tokens == 0) return absl::OkStatus();
  return RunPostBackward(p, ws);
}

absl::Status Backend::ExpandForward(const ExpandForwardParams& p,
                                    Workspace ws) {
  constexpr absl::string_view kOp = "expand forward";
  MHC_RETURN_IF_ERROR(CheckCommon(kOp, p.spec, p.tokens, KindRule::kAny));
  MHC_RETURN_IF_ERROR(CheckDType(kOp, p.act_dtype));
  MHC_RETURN_IF_ERROR(CheckPointers(kOp, p.tokens, {{"e", p.e}, {"x", p.x}}));
  if (p.tokens == 0) return absl::OkStatus();
  return RunExpandForward(p, ws);
}

absl::Status Backend::ExpandBackward(const ExpandBackwardParams& p,
                                     Workspace ws) {
  constexpr absl::string_view kOp = "expand backward";
  MHC_RETURN_IF_ERROR(CheckCommon(kOp, p.spec, p.tokens, KindRule::kAny));
  MHC_RETURN_IF_ERROR(CheckDType(kOp, p.act_dtype));
  MHC_RETURN_IF_ERROR(
      CheckPointers(kOp, p.tokens, {{"dx", p.dx}, {"de", p.de}}));
  if (p.tokens == 0) return absl::OkStatus();
  return RunExpandBackward(p, ws);
}

absl::Status Backend::PreForward(const PreForwardParams& p, Workspace ws) {
  constexpr absl::string_view kOp = "pre forward";
  MHC_RETURN_IF_ERROR(CheckCommon(kOp, p.spec, p.tokens, KindRule::kMhc));
  MHC_RETURN_IF_ERROR(CheckDType(kOp, p.act_dtype));
  MHC_RETURN_IF_ERROR(CheckPointers(
      kOp, p.tokens,
      {{"x", p.x}, {"y", p.y}, {"h_post", p.h_post}, {"h_res", p.h_res}}));
  MHC_RETURN_IF_ERROR(CheckLogitWeights(kOp, *p.spec, p.tokens, p.weights));
  MHC_RETURN_IF_ERROR(CheckKeptProjection(kOp, *p.spec, p.h, p.mean_square));
  if (p.tokens == 0) return absl::OkStatus();
  return RunPreForward(p, ws);
}

absl::Status Backend::PreBackward(const PreBackwardParams& p, Workspace ws) {
  constexpr absl::string_view kOp = "pre backward";
  MHC_RETURN_IF_ERROR(CheckCommon(kOp, p.spec, p.tokens, KindRule::kMhc));
  MHC_RETURN_IF_ERROR(CheckDType(kOp, p.act_dtype));
  MHC_RETURN_IF_ERROR(CheckPointers(kOp, p.tokens,
                                    {{"x", p.x},
                                     {"dy", p.dy},
                                     {"dh_post", p.dh_post},
                                     {"dh_res", p.dh_res},
                                     {"dx", p.dx}}));
  MHC_RETURN_IF_ERROR(CheckLogitWeights(kOp, *p.spec, p.tokens, p.weights));
  MHC_RETURN_IF_ERROR(CheckKeptProjection(kOp, *p.spec, p.h, p.mean_square));
  if (p.tokens == 0) return absl::OkStatus();
  return RunPreBackward(p, ws);
}

absl::Status Backend::HeadForward(const HeadForwardParams& p, Workspace ws) {
  constexpr absl::string_view kOp = "head forward";
  MHC_RETURN_IF_ERROR(CheckCommon(kOp, p.spec, p.tokens, KindRule::kHead));
  MHC_RETURN_IF_ERROR(CheckDType(kOp, p.act_dtype));
  MHC_RETURN_IF_ERROR(CheckPointers(kOp, p.tokens, {{"x", p.x}, {"y", p.y}}));
  MHC_RETURN_IF_ERROR(CheckLogitWeights(kOp, *p.spec, p.tokens, p.weights));
  if (p.tokens == 0) return absl::OkStatus();
  return RunHeadForward(p, ws);
}

absl::Status Backend::HeadBackward(const HeadBackwardParams& p, Workspace ws) {
  constexpr absl::string_view kOp = "head backward";
  MHC_RETURN_IF_ERROR(CheckCommon(kOp, p.spec, p.tokens, KindRule::kHead));
  MHC_RETURN_IF_ERROR(CheckDType(kOp, p.act_dtype));
  MHC_RETURN_IF_ERROR(
      CheckPointers(kOp, p.tokens, {{"x", p.x}, {"dy", p.dy}, {"dx", p.dx}}));
  MHC_RETURN_IF_ERROR(CheckLogitWeights(kOp, *p.spec, p.tokens, p.weights));
  if (p.tokens == 0) return absl::OkStatus();
  return RunHeadBackward(p, ws);
}

}  // namespace mhc
