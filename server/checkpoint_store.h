// Named checkpoints of the daemon's layers in --state_dir: SaveCheckpoint,
// LoadCheckpoint, ListCheckpoints and --restore. A save reads one layer at
// a time through its device's executor (ordered with queued work) and
// streams it to a temp file that replaces the checkpoint atomically. A load
// checks the whole file and builds every layer before any becomes visible.
#ifndef MHC_SERVER_CHECKPOINT_STORE_H_
#define MHC_SERVER_CHECKPOINT_STORE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "mhc/v1/checkpoint.pb.h"
#include "server/layer_store.h"
#include "server/metrics.h"

namespace mhc::server {

struct CheckpointOptions {
  std::string state_dir;  // empty: checkpoints disabled
  bool restore = false;   // load the newest checkpoint at start
  uint64_t max_write_bytes_per_second = 0;  // 0: unthrottled
};

class CheckpointStore {
 public:
  // `metrics` may be null.
  CheckpointStore(CheckpointOptions options, LayerStore* layers,
                  Metrics* metrics);

  // Creates the state directory when missing and removes temp files that
  // a crashed save left behind. No-op without a state_dir.
  absl::Status Init();

  absl::StatusOr<v1::SaveCheckpointResponse> Save(
      const v1::SaveCheckpointRequest& request);
  absl::StatusOr<v1::LoadCheckpointResponse> Load(
      const v1::LoadCheckpointRequest& request);
  absl::StatusOr<v1::ListCheckpointsResponse> List() const;
  // Loads the newest checkpoint (--restore); returns its name, or "" when
  // the directory holds none.
  absl::StatusOr<std::string> RestoreNewest();

 private:
  // FAILED_PRECONDITION without --state_dir; else the file of `name`,
  // which must be a valid name (never a path).
  absl::StatusOr<std::string> PathOf(absl::string_view rpc,
                                     absl::string_view name) const;

  const CheckpointOptions options_;
  LayerStore* const layers_;
  Metrics* const metrics_;
  // One save at a time: bounds the host memory saves take, and keeps two
  // saves of one name from racing for the rename.
  absl::Mutex save_mu_;
};

}  // namespace mhc::server

#endif  // MHC_SERVER_CHECKPOINT_STORE_H_
