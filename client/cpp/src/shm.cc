#include "mhc/client/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "convert/spec_convert.h"
#include "mhc/status.h"

namespace mhc::client {
namespace {

absl::Status ErrnoStatus(absl::string_view what, int error) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(error));
  switch (error) {
    case EEXIST:
      return absl::AlreadyExistsError(message);
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case ENOMEM:
    case ENOSPC:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InvalidArgumentError(message);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedMemoryObject>> SharedMemoryObject::Create(
    const std::string& key, size_t bytes) {
  if (bytes == 0) {
    return absl::InvalidArgumentError("shared memory: size must be >= 1");
  }
  std::unique_ptr<SharedMemoryObject> object(new SharedMemoryObject());
  object->key_ = key;
  const std::string path = absl::StrCat("/", key);
  object->fd_ = shm_open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (object->fd_ < 0) return ErrnoStatus("shm_open", errno);
  object->owned_ = true;
  if (ftruncate(object->fd_, static_cast<off_t>(bytes)) != 0) {
    return ErrnoStatus("ftruncate", errno);
  }
  if (absl::Status mapped = object->Map(bytes); !mapped.ok()) return mapped;
  return object;
}

absl::StatusOr<std::unique_ptr<SharedMemoryObject>> SharedMemoryObject::Open(
    const std::string& key) {
  std::unique_ptr<SharedMemoryObject> object(new SharedMemoryObject());
  object->key_ = key;
  const std::string path = absl::StrCat("/", key);
  object->fd_ = shm_open(path.c_str(), O_RDWR, 0);
  if (object->fd_ < 0) return ErrnoStatus("shm_open", errno);
  struct stat st = {};
  if (fstat(object->fd_, &st) != 0) return ErrnoStatus("fstat", errno);
  if (st.st_size <= 0) {
    return absl::FailedPreconditionError("shared memory: the object is empty");
  }
  if (absl::Status mapped = object->Map(static_cast<size_t>(st.st_size));
      !mapped.ok()) {
    return mapped;
  }
  return object;
}

absl::Status SharedMemoryObject::Map(size_t bytes) {
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (data == MAP_FAILED) return ErrnoStatus("mmap", errno);
  data_ = data;
  size_ = bytes;
  return absl::OkStatus();
}

SharedMemoryObject::~SharedMemoryObject() {
  if (data_ != nullptr) munmap(data_, size_);
  if (fd_ >= 0) close(fd_);
  if (owned_) shm_unlink(absl::StrCat("/", key_).c_str());
}

absl::StatusOr<std::unique_ptr<Session>> Session::Open(Client& client) {
  std::unique_ptr<Session> session(new Session());
  session->client_ = &client;
  // No deadline: the stream is the session and lives until Close.
  session->context_ = std::make_unique<grpc::ClientContext>();
  session->stream_ = client.stub()->OpenSession(session->context_.get());
  v1::SessionEvent event;
  if (!session->stream_->Read(&event)) {
    grpc::Status status = session->stream_->Finish();
    session->stream_.reset();
    if (status.ok()) {
      return absl::UnavailableError("OpenSession: the stream ended at once");
    }
    return FromGrpcStatus(status);
  }
  session->id_ = event.session_id();
  session->max_regions_ = event.max_regions();
  session->max_bytes_ = event.max_bytes();
  client.set_session_id(session->id_);
  return session;
}

absl::Status Session::Close() {
  if (stream_ == nullptr) return absl::OkStatus();
  if (client_->session_id() == id_) client_->set_session_id("");
  stream_->WritesDone();
  v1::SessionEvent ignored;
  while (stream_->Read(&ignored)) {
  }
  grpc::Status status = stream_->Finish();
  stream_.reset();
  return FromGrpcStatus(status);
}

Session::~Session() { Close().IgnoreError(); }

v1::SharedMemoryRef ShmRef(const std::string& region, uint64_t offset,
                           uint64_t byte_size) {
  v1::SharedMemoryRef ref;
  ref.set_region(region);
  ref.set_offset(offset);
  ref.set_byte_size(byte_size);
  return ref;
}

v1::TensorRef ShmTensorRef(DType dtype, const std::vector<int64_t>& shape,
                           const std::string& region, uint64_t offset) {
  v1::TensorRef ref;
  ref.set_dtype(DTypeToProto(dtype));
  uint64_t elements = 1;
  for (int64_t d : shape) {
    ref.add_shape(d);
    elements *= static_cast<uint64_t>(d);
  }
  *ref.mutable_shm() = ShmRef(region, offset, elements * DTypeSize(dtype));
  return ref;
}

}  // namespace mhc::client
