// Files of the checkpoint directory: a writer that replaces a file
// atomically (temp file in the same directory, fsync, rename, fsync of the
// directory), so that a crash at any point leaves the previous file whole,
// and a reader of a checkpoint's header and tensors.
#ifndef MHC_SERVER_CHECKPOINT_FILE_H_
#define MHC_SERVER_CHECKPOINT_FILE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/checkpoint_format.h"

namespace mhc::server {

// Temp files start with this (hidden, never a valid checkpoint name), so a
// crashed write's leftover is recognised and removed at the next start.
inline constexpr char kCheckpointTempPrefix[] = ".tmp-";

class AtomicFileWriter {
 public:
  // Creates a temp file in `dir` that Commit renames to `dir`/`file_name`.
  // `bytes_per_second` > 0 throttles the writes (so that a checkpoint does
  // not starve other users of the disk).
  static absl::StatusOr<std::unique_ptr<AtomicFileWriter>> Create(
      const std::string& dir, const std::string& file_name,
      uint64_t bytes_per_second);
  // Removes the temp file unless committed.
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  absl::Status WriteAt(uint64_t offset, absl::string_view bytes);
  // fsync the file, rename it over the target, fsync the directory.
  absl::Status Commit();

 private:
  AtomicFileWriter(std::string dir, std::string target, std::string temp,
                   int fd, uint64_t bytes_per_second);
  void Throttle(uint64_t bytes);

  const std::string dir_;
  const std::string target_;
  const std::string temp_;
  int fd_;
  const uint64_t bytes_per_second_;
  const absl::Time start_;
  uint64_t written_ = 0;
  bool committed_ = false;
};

// An open checkpoint: its header decoded and checked against the file's
// size; tensors are read on demand.
class CheckpointReader {
 public:
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(
      const std::string& path);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const CheckpointHeader& header() const { return header_; }
  // Reads tensor `name` into `out` (end - begin bytes) and checks its
  // checksum (DATA_LOSS on a mismatch).
  absl::Status ReadTensor(const std::string& name, void* out) const;

 private:
  CheckpointReader(int fd, std::string path) : fd_(fd), path_(path) {}

  int fd_;
  const std::string path_;
  uint64_t data_start_ = 0;
  CheckpointHeader header_;
};

}  // namespace mhc::server

#endif  // MHC_SERVER_CHECKPOINT_FILE_H_
