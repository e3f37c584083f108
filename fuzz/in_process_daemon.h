// mhcd's service without its gRPC transport, for the fuzz harnesses: the
// MhcService handlers are called directly, with a ServerContext of no call
// (no metadata, no peer), on the reference backend. Limits are small so
// that no input can make the daemon allocate more than a few MiB, and
// Reset() brings back the same layers and an empty checkpoint directory
// before every input, so that one input alone reproduces a finding.
#ifndef MHC_FUZZ_IN_PROCESS_DAEMON_H_
#define MHC_FUZZ_IN_PROCESS_DAEMON_H_

#include <memory>
#include <string>
#include <vector>

#include "server/admission.h"
#include "server/authorizer.h"
#include "server/checkpoint_store.h"
#include "server/executor.h"
#include "server/groups.h"
#include "server/layer_store.h"
#include "server/metrics.h"
#include "server/service.h"
#include "server/shm/shm_registry.h"

namespace mhc::fuzz {

// The layers every input starts with (CreateLayerRequests).
std::vector<v1::CreateLayerRequest> FixtureLayers();

class InProcessDaemon {
 public:
  // One daemon per process, created on first use in a fresh temp directory.
  static InProcessDaemon& Get();

  server::MhcService& service() { return *service_; }
  // The checkpoint directory (--state_dir).
  const std::string& state_dir() const { return state_dir_; }

  // Deletes every layer and checkpoint file, then creates FixtureLayers().
  // Aborts when that fails: the harness would test nothing.
  void Reset();

 private:
  InProcessDaemon();

  std::string state_dir_;
  std::unique_ptr<server::Metrics> metrics_;
  std::unique_ptr<server::Executor> executor_;
  std::unique_ptr<server::LayerStore> store_;
  std::unique_ptr<server::CheckpointStore> checkpoints_;
  std::unique_ptr<server::GroupRegistry> groups_;
  std::unique_ptr<server::Admission> admission_;
  std::unique_ptr<server::ShmRegistry> shm_;
  // Authentication off, as a daemon started without --auth_tokens.
  std::unique_ptr<server::Authorizer> authorizer_;
  std::unique_ptr<server::MhcService> service_;
};

}  // namespace mhc::fuzz

#endif  // MHC_FUZZ_IN_PROCESS_DAEMON_H_
