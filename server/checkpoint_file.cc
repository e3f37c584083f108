#include "server/checkpoint_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "mhc/status.h"
#include "server/crc32c.h"

namespace mhc::server {

namespace {

// Throttling and progress happen per chunk.
constexpr uint64_t kWriteChunk = uint64_t{4} << 20;

absl::Status Errno(absl::string_view what, const std::string& path) {
  const int error = errno;
  std::string message = absl::StrCat(what, " ", path, ": ", strerror(error));
  if (error == ENOSPC || error == EDQUOT) {
    return absl::ResourceExhaustedError(message);
  }
  if (error == EACCES || error == EPERM || error == EROFS) {
    return absl::PermissionDeniedError(message);
  }
  return absl::InternalError(message);
}

absl::Status FsyncPath(const std::string& path, int flags) {
  const int fd = open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) return Errno("open", path);
  const int result = fsync(fd);
  close(fd);
  if (result != 0) return Errno("fsync", path);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<AtomicFileWriter>> AtomicFileWriter::Create(
    const std::string& dir, const std::string& file_name,
    uint64_t bytes_per_second) {
  static std::atomic<uint64_t> counter{0};
  std::string temp = absl::StrCat(dir, "/", kCheckpointTempPrefix, file_name,
                                  "-", getpid(), "-", counter++);
  const int fd =
      open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0640);
  if (fd < 0) return Errno("create", temp);
  return std::unique_ptr<AtomicFileWriter>(
      new AtomicFileWriter(dir, absl::StrCat(dir, "/", file_name),
                           std::move(temp), fd, bytes_per_second));
}

AtomicFileWriter::AtomicFileWriter(std::string dir, std::string target,
                                   std::string temp, int fd,
                                   uint64_t bytes_per_second)
    : dir_(std::move(dir)),
      target_(std::move(target)),
      temp_(std::move(temp)),
      fd_(fd),
      bytes_per_second_(bytes_per_second),
      start_(absl::Now()) {}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) close(fd_);
  if (!committed_) unlink(temp_.c_str());
}

void AtomicFileWriter::Throttle(uint64_t bytes) {
  written_ += bytes;
  if (bytes_per_second_ == 0) return;
  const absl::Time due =
      start_ + absl::Seconds(static_cast<double>(written_) /
                             static_cast<double>(bytes_per_second_));
  const absl::Time now = absl::Now();
  if (due > now) absl::SleepFor(due - now);
}

absl::Status AtomicFileWriter::WriteAt(uint64_t offset,
                                       absl::string_view bytes) {
  while (!bytes.empty()) {
    const size_t chunk = std::min<uint64_t>(bytes.size(), kWriteChunk);
    const ssize_t wrote =
        pwrite(fd_, bytes.data(), chunk, static_cast<off_t>(offset));
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) return Errno("write", temp_);
    Throttle(static_cast<uint64_t>(wrote));
    bytes.remove_prefix(static_cast<size_t>(wrote));
    offset += static_cast<uint64_t>(wrote);
  }
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::Commit() {
  // The data must be on disk before the name points at it, and the rename
  // must be on disk before the save is reported done.
  if (fsync(fd_) != 0) return Errno("fsync", temp_);
  if (close(fd_) != 0) {
    fd_ = -1;
    return Errno("close", temp_);
  }
  fd_ = -1;
  if (rename(temp_.c_str(), target_.c_str()) != 0) {
    return Errno("rename to " + target_ + " from", temp_);
  }
  committed_ = true;
  return FsyncPath(dir_, O_RDONLY | O_DIRECTORY);
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(
    const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(absl::StrCat("no checkpoint file ", path));
    }
    return Errno("open", path);
  }
  std::unique_ptr<CheckpointReader> reader(new CheckpointReader(fd, path));
  struct stat info {};
  if (fstat(fd, &info) != 0) return Errno("stat", path);
  const uint64_t size = static_cast<uint64_t>(info.st_size);
  unsigned char prefix[8] = {};
  if (size < 8 || pread(fd, prefix, 8, 0) != 8) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint is truncated: ", path, " holds ", size,
        " bytes, less than the 8-byte header size of a safetensors file"));
  }
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = header_bytes << 8 | prefix[i];
  if (header_bytes > kMaxCheckpointHeaderBytes) {
    return absl::DataLossError(
        absl::StrCat("checkpoint header of ", path, " claims ", header_bytes,
                     " bytes (at most ", kMaxCheckpointHeaderBytes,
                     "): not a safetensors file, or corrupt"));
  }
  if (header_bytes > size - 8) {
    return absl::DataLossError(
        absl::StrCat("checkpoint is truncated: ", path, " holds ", size,
                     " bytes but its header alone needs ", 8 + header_bytes));
  }
  std::string json(header_bytes, '\0');
  if (pread(fd, json.data(), json.size(), 8) !=
      static_cast<ssize_t>(json.size())) {
    return Errno("read", path);
  }
  reader->data_start_ = 8 + header_bytes;
  MHC_ASSIGN_OR_RETURN(reader->header_,
                       DecodeCheckpointHeader(json, size - 8 - header_bytes));
  return reader;
}

CheckpointReader::~CheckpointReader() { close(fd_); }

absl::Status CheckpointReader::ReadTensor(const std::string& name,
                                          void* out) const {
  auto it = header_.tensors.find(name);
  if (it == header_.tensors.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint ", path_, " has no tensor '", name, "'"));
  }
  const CheckpointTensor& tensor = it->second;
  auto* dst = static_cast<char*>(out);
  uint64_t offset = data_start_ + tensor.begin;
  uint64_t left = tensor.end - tensor.begin;
  while (left > 0) {
    const ssize_t got = pread(fd_, dst, left, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return Errno("read", path_);
    if (got == 0) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint is truncated: ", path_, " ended inside '", name, "'"));
    }
    dst += got;
    offset += static_cast<uint64_t>(got);
    left -= static_cast<uint64_t>(got);
  }
  const uint32_t crc = Crc32c(0, out, tensor.end - tensor.begin);
  if (crc != tensor.crc32c) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", path_, " is corrupt: tensor '", name,
                     "' does not match its checksum (crc32c ",
                     absl::Hex(crc, absl::kZeroPad8), ", the header says ",
                     absl::Hex(tensor.crc32c, absl::kZeroPad8), ")"));
  }
  return absl::OkStatus();
}

}  // namespace mhc::server
