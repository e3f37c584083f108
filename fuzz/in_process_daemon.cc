#include "fuzz/in_process_daemon.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/server_context.h"
#include "mhc/backend.h"

namespace mhc::fuzz {
namespace {

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "in_process_daemon: %s\n", message.c_str());
  std::abort();
}

// Small enough that the largest tensor, request or layer set any input can
// ask for costs a few MiB and milliseconds on the reference backend.
server::ServiceOptions SmallLimits() {
  server::ServiceOptions options;
  options.limits.max_tensor_bytes = uint64_t{1} << 20;
  options.limits.max_request_bytes = uint64_t{4} << 20;
  options.limits.max_batch_ops = 16;
  options.limits.max_parameter_bytes = uint64_t{4} << 20;
  options.max_message_bytes = uint64_t{4} << 20;
  options.max_inflight = 4;
  return options;
}

std::string MakeStateDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = absl::StrCat(
      tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/mhc-fuzz-XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) Die("mkdtemp " + pattern + " failed");
  return pattern;
}

}  // namespace

std::vector<v1::CreateLayerRequest> FixtureLayers() {
  std::vector<v1::CreateLayerRequest> layers;
  // Dynamic mHC, stream-major: every op of the API applies.
  v1::CreateLayerRequest& mhc = layers.emplace_back();
  mhc.set_name("l0");
  mhc.mutable_spec()->set_n(4);
  mhc.mutable_spec()->set_hidden(8);
  mhc.set_seed(1);
  // Static mHC, stream-minor, with gamma and post bias.
  v1::CreateLayerRequest& minor = layers.emplace_back();
  minor.set_name("l1");
  minor.mutable_spec()->set_n(2);
  minor.mutable_spec()->set_hidden(4);
  minor.mutable_spec()->set_layout(v1::LAYOUT_STREAM_MINOR);
  minor.mutable_spec()->set_dynamic(false);
  minor.mutable_spec()->set_has_post_bias(true);
  minor.set_seed(2);
  // The last layer's head.
  v1::CreateLayerRequest& head = layers.emplace_back();
  head.set_name("head");
  head.mutable_spec()->set_kind(v1::LAYER_KIND_HEAD);
  head.mutable_spec()->set_n(4);
  head.mutable_spec()->set_hidden(8);
  head.set_seed(3);
  return layers;
}

InProcessDaemon& InProcessDaemon::Get() {
  // Never destroyed: harnesses exit without tearing the daemon down.
  static InProcessDaemon* daemon = new InProcessDaemon();
  return *daemon;
}

InProcessDaemon::InProcessDaemon() : state_dir_(MakeStateDir()) {
  // Protobuf logs every string field of invalid UTF-8 it refuses to parse:
  // noise at thousands of inputs a second.
  google::protobuf::SetLogHandler(nullptr);
  const server::ServiceOptions options = SmallLimits();
  metrics_ = std::make_unique<server::Metrics>(
      server::BuildInfo{"fuzz", "unknown", "reference", "none"});
  executor_ = std::make_unique<server::Executor>(MakeReferenceBackend(), "cpu");
  executor_->SetMetrics(metrics_.get());
  std::vector<server::Executor*> executors = {executor_.get()};
  store_ = std::make_unique<server::LayerStore>(executors, options.limits);
  server::CheckpointOptions checkpoint_options;
  checkpoint_options.state_dir = state_dir_;
  checkpoints_ = std::make_unique<server::CheckpointStore>(
      checkpoint_options, store_.get(), metrics_.get());
  if (absl::Status init = checkpoints_->Init(); !init.ok()) {
    Die(init.ToString());
  }
  groups_ = std::make_unique<server::GroupRegistry>(
      store_.get(), executors, /*transport=*/nullptr,
      "the fuzz daemon has no collective transport", absl::Seconds(1),
      metrics_.get());
  admission_ = std::make_unique<server::Admission>(options.max_inflight);
  // Shared memory stays disabled (the default): no input may map another
  // process's memory; the shm RPCs are still validated up to that refusal.
  shm_ = std::make_unique<server::ShmRegistry>(options.shm, nullptr, nullptr);
  authorizer_ = std::make_unique<server::Authorizer>(nullptr, nullptr);
  service_ = std::make_unique<server::MhcService>(
      options, executors, store_.get(), checkpoints_.get(), admission_.get(),
      metrics_.get(), shm_.get(), groups_.get(), authorizer_.get());
  std::atexit([] {
    std::error_code error;
    std::filesystem::remove_all(Get().state_dir_, error);
  });
}

void InProcessDaemon::Reset() {
  for (const auto& layer : store_->List()) {
    if (absl::Status deleted = store_->Delete(layer->name()); !deleted.ok()) {
      Die(deleted.ToString());
    }
  }
  std::error_code error;
  for (const auto& entry :
       std::filesystem::directory_iterator(state_dir_, error)) {
    std::filesystem::remove_all(entry.path(), error);
  }
  if (error) Die(absl::StrCat("clearing ", state_dir_, ": ", error.message()));
  for (const v1::CreateLayerRequest& request : FixtureLayers()) {
    grpc::ServerContext context;
    v1::LayerInfo info;
    grpc::Status created = service_->CreateLayer(&context, &request, &info);
    if (!created.ok()) {
      Die(absl::StrCat("creating fixture layer ", request.name(), ": ",
                       created.error_message()));
    }
  }
}

}  // namespace mhc::fuzz
