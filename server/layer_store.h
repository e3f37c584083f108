// Layers by name. A layer's parameters and gradient accumulators live in the
// memory of its device's backend; every read or write of them goes through
// the device's Executor, so it is ordered with the ops that use them.
//
// Layers are shared: a request holds its layers for its whole life, so
// DeleteLayer during a request is safe (the memory goes when the last user
// is done). ConvertLayout installs a new Layer under the same name and
// retires the old one; requests that still hold the retired layer are
// refused with ABORTED when they reach the device, rather than accumulating
// gradients where nobody will read them.
#ifndef MHC_SERVER_LAYER_STORE_H_
#define MHC_SERVER_LAYER_STORE_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "mhc/backend.h"
#include "mhc/types.h"
#include "mhc/v1/layer.pb.h"
#include "mhc/v1/tensor.pb.h"
#include "server/executor.h"
#include "server/tensor_resolver.h"

namespace mhc::server {

// A layer's optimizer state (OptimizerStep): fp32 slots in the layer's
// device memory, created by the layer's first step (or a restore) and freed
// with the layer. Its algorithm is fixed while it exists; a step of another
// algorithm must reset it.
struct OptimizerState {
  std::string algorithm;  // "sgd", "adamw" (mhc::OptimizerAlgorithmName)
  int64_t step = 0;       // steps taken; the next step is number step + 1
  // "momentum_buffer" (sgd); "exp_avg", "exp_avg_sq" (adamw).
  std::vector<std::string> slot_names;
  // Device memory: slot_names.size() arrays of parameter_count() floats,
  // back to back, slot s at slots + s * parameter_count(). Each array is in
  // the parameter block's order: parameter p at p.offset, like values().
  float* slots = nullptr;
};

class Layer {
 public:
  // One parameter (and its gradient) inside the layer's two fp32 blocks.
  using Param = ParameterSlot;

  Layer(std::string name, std::string preset, const LayerSpec& spec,
        Executor* executor);
  ~Layer();
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  const std::string& name() const { return name_; }
  const std::string& preset() const { return preset_; }
  const LayerSpec& spec() const { return spec_; }
  Executor* executor() const { return executor_; }
  const std::vector<Param>& params() const { return params_; }
  const Param* FindParam(absl::string_view name) const;
  int64_t parameter_count() const { return total_elements_; }
  // "layer 'l1' (STREAM_MAJOR)" for messages.
  std::string Describe() const;

  // Device pointers; valid while the layer lives. Use under the device.
  LayerWeights Weights() const;
  LayerGrads Grads() const;
  float* values() const { return values_; }
  float* grads() const { return grads_; }
  // The layer's one allocation starts at values(); the gradients start this
  // many bytes into it.
  uint64_t gradients_offset() const;
  uint64_t allocation_bytes() const {
    return gradients_offset() +
           static_cast<uint64_t>(total_elements_) * sizeof(float);
  }
  // Differs for every allocation of a layer in this process.
  uint64_t generation() const { return generation_; }

  uint64_t version() const { return version_.load(); }
  void set_version(uint64_t version) { version_.store(version); }
  int64_t gradient_tokens() const { return gradient_tokens_.load(); }
  void set_gradient_tokens(int64_t tokens) { gradient_tokens_.store(tokens); }
  void AddGradientTokens(int64_t tokens) { gradient_tokens_ += tokens; }
  bool retired() const { return retired_.load(); }
  void Retire() { retired_.store(true); }

  // Allocates both blocks (grads zeroed). Call under the device.
  absl::Status Allocate(Backend& backend);

  // ABORTED when the layer was replaced (ConvertLayout) after the request
  // looked it up.
  absl::Status CheckCurrent() const;

  // Optimizer state. All of these run under the device (inside the
  // executor's WithDevice or Run), which orders them with the steps and ops
  // that use the memory; optimizer_summary() alone is safe anywhere.
  //
  // The state, or null when the layer has none.
  const OptimizerState* optimizer_state() const { return optimizer_.get(); }
  // Replaces any state by zeroed slots for `algorithm` ("sgd", "adamw") at
  // step 0.
  absl::Status AllocateOptimizerState(Backend& backend,
                                      absl::string_view algorithm);
  // Replaces any state by `algorithm` at `step` with `slots` (host memory,
  // every slot back to back as in OptimizerState::slots); for checkpoints.
  absl::Status RestoreOptimizerState(Backend& backend,
                                     absl::string_view algorithm, int64_t step,
                                     const std::vector<float>& slots);
  // The slots in host memory, back to back as in OptimizerState::slots;
  // FAILED_PRECONDITION without state.
  absl::StatusOr<std::vector<float>> ReadOptimizerState(Backend& backend) const;
  void FreeOptimizerState(Backend& backend);
  void set_optimizer_step(int64_t step);
  // Algorithm ("" without state) and step, for LayerInfo.
  std::pair<std::string, int64_t> optimizer_summary() const;
  // Device bytes of the state (0 without).
  uint64_t optimizer_state_bytes() const;

 private:
  const std::string name_;
  const std::string preset_;
  const LayerSpec spec_;
  Executor* const executor_;
  const std::vector<Param> params_;
  const int64_t total_elements_;
  float* values_ = nullptr;
  float* grads_ = nullptr;
  uint64_t generation_ = 0;
  std::atomic<uint64_t> version_{1};
  std::atomic<int64_t> gradient_tokens_{0};
  std::atomic<bool> retired_{false};
  // Written under the device and optimizer_mu_; read under either.
  mutable absl::Mutex optimizer_mu_;
  std::unique_ptr<OptimizerState> optimizer_;
};

// New values of one whole parameter, checked against its shape.
struct ParameterUpdate {
  const Layer::Param* param = nullptr;
  absl::string_view bytes;  // fp32, param->elements of them
};

// 1..128 characters of [A-Za-z0-9_.-], the first a letter or digit.
absl::Status ValidateLayerName(absl::string_view name, absl::string_view field);

class LayerStore {
 public:
  // `executors`: the daemon's devices; layers go to the first unless
  // CreateLayerRequest.device names another.
  LayerStore(std::vector<Executor*> executors, RequestLimits limits);

  absl::StatusOr<std::shared_ptr<Layer>> Create(
      const v1::CreateLayerRequest& request);
  // NOT_FOUND names the layer; `field` is the request field holding it.
  absl::StatusOr<std::shared_ptr<Layer>> Find(absl::string_view name,
                                              absl::string_view field) const;
  absl::Status Delete(absl::string_view name);
  std::vector<std::shared_ptr<Layer>> List() const;  // sorted by name
  size_t size() const;

  void FillInfo(const Layer& layer, v1::LayerInfo* info) const;

  // Parameters (gradients = false) or gradient accumulators, all when
  // `names` is empty. Returns the gradient token count at the same instant.
  absl::StatusOr<int64_t> Read(
      const Layer& layer,
      const google::protobuf::RepeatedPtrField<std::string>& names,
      bool gradients, v1::Parameters* out) const;
  // All tensors are validated before any is written.
  absl::Status Write(Layer& layer, const v1::Parameters& parameters) const;
  // Writes every update under one device lock and bumps the parameters'
  // version once (Write; SetParametersStream, which validated the pieces).
  absl::Status WriteChecked(Layer& layer,
                            const std::vector<ParameterUpdate>& updates) const;
  absl::Status ZeroGradients(Layer& layer) const;
  // The layer's allocation as its device exports it (MapLayerMemory);
  // FAILED_PRECONDITION for host devices.
  absl::Status Export(const Layer& layer, v1::LayerMemory* out) const;
  absl::StatusOr<std::shared_ptr<Layer>> ConvertLayout(absl::string_view name,
                                                       int layout);

  // The executor of a device name ("" is the first device).
  absl::StatusOr<Executor*> DeviceFor(absl::string_view device) const;

  // Device memory held for layers built outside the store (LoadCheckpoint
  // allocates and fills every layer before any becomes visible); given
  // back when destroyed unless Install took it over.
  class Reservation {
   public:
    Reservation(Reservation&& other) noexcept
        : store_(other.store_), bytes_(other.bytes_) {
      other.store_ = nullptr;
    }
    Reservation& operator=(Reservation&&) = delete;
    ~Reservation();

   private:
    friend class LayerStore;
    Reservation(LayerStore* store, uint64_t bytes)
        : store_(store), bytes_(bytes) {}
    LayerStore* store_;
    uint64_t bytes_;
  };
  // RESOURCE_EXHAUSTED beyond --max_parameter_bytes; `what` names the
  // layers in the message.
  absl::StatusOr<Reservation> Reserve(uint64_t bytes, absl::string_view what);
  // Makes `layers` (allocated and filled, their memory reserved) visible
  // together; of the reservation, the store keeps their allocation_bytes()
  // and gives back the rest. Without `replace`, ALREADY_EXISTS when any name is
  // taken, and nothing changes; with it, the layers of those names are retired
  // (as by ConvertLayout) and a replacement's parameters_version becomes larger
  // than the old one's, so versions of a name never go back.
  absl::Status Install(const std::vector<std::shared_ptr<Layer>>& layers,
                       bool replace, Reservation reservation);

 private:
  // Seeded docs/SPEC.md section 5 initialisation, host side, in parameter
  // order.
  std::vector<float> InitialValues(const Layer& layer, uint64_t seed) const;
  absl::StatusOr<std::vector<float>> ValuesFromRequest(
      const Layer& layer, const v1::Parameters& parameters) const;

  // Reserves `bytes` of --max_parameter_bytes for new layers, or
  // RESOURCE_EXHAUSTED naming `what` ("layer 'l1'").
  absl::Status ReserveLayerBytes(uint64_t bytes, absl::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::vector<Executor*> executors_;
  const RequestLimits limits_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Layer>, std::less<>> layers_
      ABSL_GUARDED_BY(mu_);
  // Device memory of the layers in layers_ and of those being created.
  uint64_t layer_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace mhc::server

#endif  // MHC_SERVER_LAYER_STORE_H_
