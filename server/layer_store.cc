#include "server/layer_store.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "convert/spec_convert.h"
#include "mhc/status.h"

namespace mhc::server {

namespace {

constexpr size_t kMaxLayerName = 128;

bool NameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
         (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-';
}

// Standard normal deviates from a seeded 64-bit Mersenne Twister through
// Box-Muller, written out because std::normal_distribution differs between
// standard libraries and the same seed must give the same layer everywhere.
class NormalGenerator {
 public:
  explicit NormalGenerator(uint64_t seed) : engine_(seed) {}
  double Next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    // Uniforms in (0, 1]: log never sees 0.
    double u1 = (static_cast<double>(engine_() >> 11) + 1.0) * 0x1.0p-53;
    double u2 = (static_cast<double>(engine_() >> 11) + 1.0) * 0x1.0p-53;
    double radius = std::sqrt(-2.0 * std::log(u1));
    double angle = 2.0 * M_PI * u2;
    spare_ = radius * std::sin(angle);
    has_spare_ = true;
    return radius * std::cos(angle);
  }

 private:
  std::mt19937_64 engine_;
  bool has_spare_ = false;
  double spare_ = 0.0;
};

// Moves the K columns of `rows` rows from one layout's order to the other's.
void PermuteColumns(const LayerSpec& from, const LayerSpec& to,
                    const float* src, float* dst, int64_t rows) {
  const int64_t k = from.K();
  for (int64_t row = 0; row < rows; ++row) {
    for (int i = 0; i < from.n; ++i) {
      for (int64_t c = 0; c < from.hidden; ++c) {
        dst[row * k + to.XIndex(i, c)] = src[row * k + from.XIndex(i, c)];
      }
    }
  }
}

}  // namespace

absl::Status ValidateLayerName(absl::string_view name,
                               absl::string_view field) {
  if (name.empty() || name.size() > kMaxLayerName) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected 1..", kMaxLayerName,
                     " characters of [A-Za-z0-9_.-], got ", name.size()));
  }
  for (char c : name) {
    if (!NameChar(c)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": expected characters of [A-Za-z0-9_.-], got '",
                       absl::CEscape(name), "'"));
    }
  }
  // Names become file names (checkpoints): ".", ".." and hidden names are
  // out.
  if (!absl::ascii_isalnum(static_cast<unsigned char>(name.front()))) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": must start with a letter or digit, got '",
                     absl::CEscape(name), "'"));
  }
  return absl::OkStatus();
}

Layer::Layer(std::string name, std::string preset, const LayerSpec& spec,
             Executor* executor)
    : name_(std::move(name)),
      preset_(std::move(preset)),
      spec_(spec),
      executor_(executor),
      params_(ParameterLayout(spec)),
      total_elements_(ParameterCount(spec)) {}

Layer::~Layer() {
  if (values_ == nullptr && grads_ == nullptr && optimizer_ == nullptr) return;
  executor_
      ->WithDevice([&](Backend& backend) {
        // One allocation holds both blocks (see Allocate).
        if (values_ != nullptr) backend.Free(values_);
        FreeOptimizerState(backend);
        return absl::OkStatus();
      })
      .IgnoreError();
}

const Layer::Param* Layer::FindParam(absl::string_view name) const {
  for (const Param& p : params_) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

std::string Layer::Describe() const {
  return absl::StrCat("layer '", name_, "' (",
                      spec_.kind == LayerKind::kHead ? "HEAD, " : "",
                      LayoutLabel(spec_.layout), ")");
}

uint64_t Layer::gradients_offset() const {
  // Where the gradient block starts: aligned as an allocation would be, so
  // kernels use their widest accesses on both blocks.
  constexpr uint64_t kAlignment = 256;
  const uint64_t bytes = static_cast<uint64_t>(total_elements_) * sizeof(float);
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

absl::Status Layer::Allocate(Backend& backend) {
  // One allocation for parameters and gradients, so that a local client
  // maps the whole layer with one handle (MapLayerMemory).
  static std::atomic<uint64_t> generations{0};
  const size_t bytes = static_cast<size_t>(total_elements_) * sizeof(float);
  MHC_ASSIGN_OR_RETURN(void* block,
                       backend.Allocate(gradients_offset() + bytes));
  values_ = static_cast<float*>(block);
  grads_ =
      reinterpret_cast<float*>(static_cast<char*>(block) + gradients_offset());
  generation_ = ++generations;
  return backend.Memset(grads_, 0, bytes);
}

absl::Status Layer::CheckCurrent() const {
  if (!retired()) return absl::OkStatus();
  return absl::AbortedError(absl::StrCat(
      "layer '", name_,
      "' was replaced (ConvertLayout) while this request waited; retry"));
}

LayerWeights Layer::Weights() const { return WeightsInBlock(spec_, values_); }

LayerGrads Layer::Grads() const { return GradsInBlock(spec_, grads_); }

LayerStore::LayerStore(std::vector<Executor*> executors, RequestLimits limits)
    : executors_(std::move(executors)), limits_(limits) {}

absl::StatusOr<Executor*> LayerStore::DeviceFor(
    absl::string_view device) const {
  if (device.empty()) return executors_.front();
  std::vector<std::string> names;
  for (Executor* executor : executors_) {
    if (executor->device() == device) return executor;
    names.push_back(executor->device());
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "device: expected '' or one of ", absl::StrJoin(names, ", "),
      " (the devices of this daemon), got '", absl::CEscape(device), "'"));
}

std::vector<float> LayerStore::InitialValues(const Layer& layer,
                                             uint64_t seed) const {
  const LayerSpec& spec = layer.spec();
  std::vector<float> values(layer.parameter_count(), 0.0f);
  NormalGenerator normal(seed);
  for (const Layer::Param& p : layer.params()) {
    float* out = values.data() + p.offset;
    if (p.name == "phi") {
      for (int64_t i = 0; i < p.elements; ++i) {
        out[i] = static_cast<float>(0.02 * normal.Next());
      }
    } else if (p.name == "alpha") {
      // HEAD: the scalar s = 1, so the mix starts as sigmoid(u + b).
      const float alpha = spec.kind == LayerKind::kHead ? 1.0f : 0.01f;
      for (int64_t i = 0; i < p.elements; ++i) out[i] = alpha;
    } else if (p.name == "beta" && spec.kind == LayerKind::kMhc) {
      // Res logits: diagonal 0, off-diagonal -8, so H_res starts near I.
      const int n = spec.n;
      for (int i = 0; i < n; ++i) {
        for (int j = 0; j < n; ++j) {
          out[2 * n + i * n + j] = i == j ? 0.0f : -8.0f;
        }
      }
    } else if (p.name == "gamma") {
      for (int64_t i = 0; i < p.elements; ++i) out[i] = 1.0f;
    }
  }
  return values;
}

absl::StatusOr<std::vector<float>> LayerStore::ValuesFromRequest(
    const Layer& layer, const v1::Parameters& parameters) const {
  std::vector<std::string> expected;
  for (const Layer::Param& p : layer.params()) expected.push_back(p.name);
  for (const auto& [name, tensor] : parameters.tensors()) {
    if (layer.FindParam(name) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameters.tensors: unknown parameter '", absl::CEscape(name),
          "' for this spec; expected ", absl::StrJoin(expected, ", ")));
    }
  }
  std::vector<float> values(layer.parameter_count());
  ByteBudget budget(limits_);
  for (const Layer::Param& p : layer.params()) {
    auto it = parameters.tensors().find(p.name);
    if (it == parameters.tensors().end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameters.tensors: missing '", p.name, "' ", ShapeString(p.shape),
          "; expected every one of ", absl::StrJoin(expected, ", ")));
    }
    MHC_ASSIGN_OR_RETURN(
        absl::string_view bytes,
        ResolveParameter(it->second,
                         absl::StrCat("parameters.tensors['", p.name, "']"),
                         p.shape, &budget));
    if (!bytes.empty()) {
      std::memcpy(values.data() + p.offset, bytes.data(), bytes.size());
    }
  }
  return values;
}

absl::StatusOr<std::shared_ptr<Layer>> LayerStore::Create(
    const v1::CreateLayerRequest& request) {
  MHC_RETURN_IF_ERROR(ValidateLayerName(request.name(), "name"));
  MHC_ASSIGN_OR_RETURN(Executor * executor, DeviceFor(request.device()));
  MHC_ASSIGN_OR_RETURN(LayerSpec spec,
                       ResolveSpec(request.preset(), request.spec()));
  auto layer = std::make_shared<Layer>(
      request.name(),
      request.preset().empty() ? "deepseek_v4" : request.preset(), spec,
      executor);
  const uint64_t bytes = layer->allocation_bytes();
  {
    absl::MutexLock lock(&mu_);
    if (layers_.count(request.name()) > 0) {
      return absl::AlreadyExistsError(
          absl::StrCat("name: layer '", request.name(), "' already exists"));
    }
    MHC_RETURN_IF_ERROR(ReserveLayerBytes(
        bytes, absl::StrCat("the parameters and gradients of layer '",
                            request.name(), "'")));
  }
  absl::Status created = [&]() -> absl::Status {
    std::vector<float> values;
    if (request.init_case() == v1::CreateLayerRequest::kParameters) {
      MHC_ASSIGN_OR_RETURN(values,
                           ValuesFromRequest(*layer, request.parameters()));
    } else {
      values = InitialValues(*layer, request.seed());
    }
    return executor->WithDevice([&](Backend& backend) {
      MHC_RETURN_IF_ERROR(layer->Allocate(backend));
      return backend.CopyToDevice(layer->values(), values.data(),
                                  values.size() * sizeof(float));
    });
  }();
  absl::MutexLock lock(&mu_);
  // A concurrent Create of the same name may have won; `layer` is then
  // freed after the lock is released (its destructor needs the device).
  if (created.ok() && !layers_.emplace(request.name(), layer).second) {
    created = absl::AlreadyExistsError(
        absl::StrCat("name: layer '", request.name(), "' already exists"));
  }
  if (!created.ok()) {
    layer_bytes_ -= bytes;
    return created;
  }
  return layer;
}

absl::Status LayerStore::ReserveLayerBytes(uint64_t bytes,
                                           absl::string_view what) {
  const uint64_t limit = limits_.max_parameter_bytes;
  if (limit != 0 && (bytes > limit || layer_bytes_ > limit - bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, " need ", bytes, " bytes of device memory; with the ",
        layer_bytes_,
        " bytes the daemon's layers hold, that exceeds --max_parameter_bytes=",
        limit));
  }
  layer_bytes_ += bytes;
  return absl::OkStatus();
}

LayerStore::Reservation::~Reservation() {
  if (store_ == nullptr) return;
  absl::MutexLock lock(&store_->mu_);
  store_->layer_bytes_ -= bytes_;
}

absl::StatusOr<LayerStore::Reservation> LayerStore::Reserve(
    uint64_t bytes, absl::string_view what) {
  absl::MutexLock lock(&mu_);
  MHC_RETURN_IF_ERROR(ReserveLayerBytes(bytes, what));
  return Reservation(this, bytes);
}

absl::Status LayerStore::Install(
    const std::vector<std::shared_ptr<Layer>>& layers, bool replace,
    Reservation reservation) {
  std::vector<std::shared_ptr<Layer>> replaced;  // freed after the lock
  absl::MutexLock lock(&mu_);
  for (const auto& layer : layers) {
    if (!replace && layers_.count(layer->name()) > 0) {
      return absl::AlreadyExistsError(
          absl::StrCat("layer '", layer->name(),
                       "' already exists; load with replace to overwrite it"));
    }
  }
  for (const auto& layer : layers) {
    auto [it, inserted] = layers_.emplace(layer->name(), layer);
    if (inserted) continue;
    const std::shared_ptr<Layer>& old = it->second;
    layer->set_version(std::max(layer->version(), old->version() + 1));
    layer_bytes_ -= old->allocation_bytes();
    old->Retire();
    replaced.push_back(std::move(it->second));
    it->second = layer;
  }
  // The layers' allocations are now theirs (Delete gives them back). The
  // rest of the reservation (optimizer state a load brought, which the
  // budget checks when it arrives but does not track afterwards, as for
  // OptimizerStep) goes back now, or Delete would leave it counted.
  uint64_t kept = 0;
  for (const auto& layer : layers) kept += layer->allocation_bytes();
  layer_bytes_ -= reservation.bytes_ - std::min(kept, reservation.bytes_);
  reservation.store_ = nullptr;
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Layer>> LayerStore::Find(
    absl::string_view name, absl::string_view field) const {
  if (name.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": required (a layer name)"));
  }
  absl::MutexLock lock(&mu_);
  auto it = layers_.find(name);
  if (it == layers_.end()) {
    return absl::NotFoundError(
        absl::StrCat(field, ": no layer named '", absl::CEscape(name), "'"));
  }
  return it->second;
}

absl::Status LayerStore::Delete(absl::string_view name) {
  std::shared_ptr<Layer> doomed;  // released after the lock (see Create)
  {
    absl::MutexLock lock(&mu_);
    auto it = layers_.find(name);
    if (it == layers_.end()) {
      return absl::NotFoundError(
          absl::StrCat("name: no layer named '", absl::CEscape(name), "'"));
    }
    doomed = std::move(it->second);
    layers_.erase(it);
    layer_bytes_ -= doomed->allocation_bytes();
  }
  return absl::OkStatus();
}

std::vector<std::shared_ptr<Layer>> LayerStore::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Layer>> out;
  out.reserve(layers_.size());
  for (const auto& [name, layer] : layers_) out.push_back(layer);
  return out;
}

size_t LayerStore::size() const {
  absl::MutexLock lock(&mu_);
  return layers_.size();
}

void LayerStore::FillInfo(const Layer& layer, v1::LayerInfo* info) const {
  info->set_name(layer.name());
  info->set_preset(layer.preset());
  SpecToProto(layer.spec(), info->mutable_spec());
  info->set_device(layer.executor()->device());
  info->set_parameter_count(layer.parameter_count());
  info->set_gradient_tokens(layer.gradient_tokens());
  info->set_parameters_version(layer.version());
  auto [algorithm, step] = layer.optimizer_summary();
  if (!algorithm.empty()) {
    info->mutable_optimizer()->set_algorithm(algorithm);
    info->mutable_optimizer()->set_step(step);
  }
}

absl::StatusOr<int64_t> LayerStore::Read(
    const Layer& layer,
    const google::protobuf::RepeatedPtrField<std::string>& names,
    bool gradients, v1::Parameters* out) const {
  std::vector<const Layer::Param*> wanted;
  if (names.empty()) {
    for (const Layer::Param& p : layer.params()) wanted.push_back(&p);
  }
  for (int i = 0; i < names.size(); ++i) {
    const Layer::Param* p = layer.FindParam(names[i]);
    if (p == nullptr) {
      std::vector<std::string> known;
      for (const Layer::Param& q : layer.params()) known.push_back(q.name);
      return absl::InvalidArgumentError(
          absl::StrCat("names[", i, "]: ", layer.Describe(),
                       " has no parameter '", absl::CEscape(names[i]),
                       "'; expected one of ", absl::StrJoin(known, ", ")));
    }
    wanted.push_back(p);
  }
  // Output strings are sized before the device is taken; the copies land
  // in them directly.
  std::vector<std::pair<const Layer::Param*, std::string*>> targets;
  for (const Layer::Param* p : wanted) {
    v1::TensorRef& ref = (*out->mutable_tensors())[p->name];
    ref.set_dtype(v1::DTYPE_F32);
    ref.clear_shape();
    for (int64_t d : p->shape) ref.add_shape(d);
    std::string* bytes = ref.mutable_inline_data();
    bytes->resize(static_cast<size_t>(p->elements) * sizeof(float));
    targets.emplace_back(p, bytes);
  }
  int64_t tokens = 0;
  MHC_RETURN_IF_ERROR(layer.executor()->WithDevice([&](Backend& backend) {
    const float* base = gradients ? layer.grads() : layer.values();
    for (auto& [p, bytes] : targets) {
      MHC_RETURN_IF_ERROR(
          backend.CopyToHost(bytes->data(), base + p->offset, bytes->size()));
    }
    tokens = layer.gradient_tokens();
    return absl::OkStatus();
  }));
  return tokens;
}

absl::Status LayerStore::Write(Layer& layer,
                               const v1::Parameters& parameters) const {
  std::vector<ParameterUpdate> updates;
  ByteBudget budget(limits_);
  for (const auto& [name, tensor] : parameters.tensors()) {
    const Layer::Param* p = layer.FindParam(name);
    if (p == nullptr) {
      std::vector<std::string> known;
      for (const Layer::Param& q : layer.params()) known.push_back(q.name);
      return absl::InvalidArgumentError(
          absl::StrCat("parameters.tensors: ", layer.Describe(),
                       " has no parameter '", absl::CEscape(name),
                       "'; expected any of ", absl::StrJoin(known, ", ")));
    }
    MHC_ASSIGN_OR_RETURN(
        absl::string_view bytes,
        ResolveParameter(tensor,
                         absl::StrCat("parameters.tensors['", name, "']"),
                         p->shape, &budget));
    updates.push_back(ParameterUpdate{p, bytes});
  }
  return WriteChecked(layer, updates);
}

absl::Status LayerStore::WriteChecked(
    Layer& layer, const std::vector<ParameterUpdate>& updates) const {
  if (updates.empty()) return absl::OkStatus();
  return layer.executor()->WithDevice([&](Backend& backend) {
    MHC_RETURN_IF_ERROR(layer.CheckCurrent());
    for (const ParameterUpdate& update : updates) {
      if (update.bytes.empty()) continue;
      MHC_RETURN_IF_ERROR(
          backend.CopyToDevice(layer.values() + update.param->offset,
                               update.bytes.data(), update.bytes.size()));
    }
    layer.set_version(layer.version() + 1);
    return absl::OkStatus();
  });
}

absl::Status LayerStore::Export(const Layer& layer,
                                v1::LayerMemory* out) const {
  Executor* executor = layer.executor();
  if (executor->cuda_ordinal() < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "MapLayerMemory: ", layer.Describe(), " is on ", executor->device(),
        ", which has no memory to share; use Get/SetParameters"));
  }
  absl::StatusOr<Backend::ExportedMemory> exported;
  MHC_RETURN_IF_ERROR(executor->WithDevice([&](Backend& backend) {
    exported = backend.ExportMemory(layer.values());
    return exported.status();
  }));
  out->set_raw_handle(std::move(exported->handle));
  out->set_device_id(executor->cuda_ordinal());
  out->set_byte_size(exported->bytes);
  out->set_generation(layer.generation());
  for (const Layer::Param& param : layer.params()) {
    // Offsets count from the start of the allocation the handle opens,
    // where the layer's block need not begin.
    const uint64_t offset =
        exported->offset + static_cast<uint64_t>(param.offset) * sizeof(float);
    for (auto [map, base] :
         {std::pair{out->mutable_parameters(), uint64_t{0}},
          std::pair{out->mutable_gradients(), layer.gradients_offset()}}) {
      v1::TensorSlice& slice = (*map)[param.name];
      slice.set_offset(base + offset);
      for (int64_t d : param.shape) slice.add_shape(d);
    }
  }
  return absl::OkStatus();
}

absl::Status LayerStore::ZeroGradients(Layer& layer) const {
  return layer.executor()->WithDevice([&](Backend& backend) {
    MHC_RETURN_IF_ERROR(layer.CheckCurrent());
    MHC_RETURN_IF_ERROR(backend.Memset(
        layer.grads(), 0,
        static_cast<size_t>(layer.parameter_count()) * sizeof(float)));
    layer.set_gradient_tokens(0);
    return absl::OkStatus();
  });
}

absl::StatusOr<std::shared_ptr<Layer>> LayerStore::ConvertLayout(
    absl::string_view name, int layout_value) {
  MHC_ASSIGN_OR_RETURN(Layout layout, LayoutFromProto(layout_value, "layout"));
  MHC_ASSIGN_OR_RETURN(std::shared_ptr<Layer> old, Find(name, "layer"));
  if (old->spec().layout == layout) return old;
  LayerSpec spec = old->spec();
  spec.layout = layout;
  Executor* executor = old->executor();
  auto fresh =
      std::make_shared<Layer>(old->name(), old->preset(), spec, executor);
  const size_t count = static_cast<size_t>(old->parameter_count());
  std::vector<float> host(count);
  std::vector<float> permuted(count);
  absl::Status status = executor->WithDevice([&](Backend& backend) {
    MHC_RETURN_IF_ERROR(old->CheckCurrent());
    MHC_RETURN_IF_ERROR(fresh->Allocate(backend));
    for (bool grads : {false, true}) {
      MHC_RETURN_IF_ERROR(
          backend.CopyToHost(host.data(), grads ? old->grads() : old->values(),
                             count * sizeof(float)));
      permuted = host;
      for (const Layer::Param& p : old->params()) {
        if (p.name != "phi" && p.name != "gamma") continue;
        PermuteColumns(old->spec(), spec, host.data() + p.offset,
                       permuted.data() + p.offset, p.elements / spec.K());
      }
      MHC_RETURN_IF_ERROR(
          backend.CopyToDevice(grads ? fresh->grads() : fresh->values(),
                               permuted.data(), count * sizeof(float)));
    }
    if (const OptimizerState* state = old->optimizer_state()) {
      // Each slot follows its parameter's columns.
      std::vector<float> slots(state->slot_names.size() * count);
      MHC_RETURN_IF_ERROR(backend.CopyToHost(slots.data(), state->slots,
                                             slots.size() * sizeof(float)));
      std::vector<float> permuted_slots = slots;
      for (size_t s = 0; s < state->slot_names.size(); ++s) {
        for (const Layer::Param& p : old->params()) {
          if (p.name != "phi" && p.name != "gamma") continue;
          PermuteColumns(old->spec(), spec, slots.data() + s * count + p.offset,
                         permuted_slots.data() + s * count + p.offset,
                         p.elements / spec.K());
        }
      }
      MHC_RETURN_IF_ERROR(fresh->RestoreOptimizerState(
          backend, state->algorithm, state->step, permuted_slots));
    }
    fresh->set_version(old->version() + 1);
    fresh->set_gradient_tokens(old->gradient_tokens());
    // Swapped while holding the device so no op runs on either copy in
    // between; lock order is always device, then store.
    absl::MutexLock lock(&mu_);
    auto it = layers_.find(name);
    if (it == layers_.end() || it->second != old) {
      return absl::AbortedError(absl::StrCat(
          "layer '", old->name(), "' was deleted or replaced concurrently"));
    }
    it->second = fresh;
    old->Retire();
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return fresh;
}

}  // namespace mhc::server
