// Zero-copy tensors for clients on the daemon's node: POSIX shared-memory
// objects this process creates and maps, and the session that owns the
// regions registered from them (see shm.proto).
//
//   auto session = Session::Open(client);          // client now sends its id
//   auto object = SharedMemoryObject::Create("mhcd_job1_x", bytes);
//   client.RegisterSystemSharedMemory("x", object->key(), 0, bytes);
//   request.x = ShmTensorRef(DType::kBf16, shape, "x", 0, bytes);
//
// Regions die with the session: destroying the Session (or this process
// exiting) releases them in the daemon.
#ifndef MHC_CLIENT_SHM_H_
#define MHC_CLIENT_SHM_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "mhc/client/client.h"
#include "mhc/client/shm_key.h"
#include "mhc/types.h"
#include "mhc/v1/tensor.pb.h"

namespace mhc::client {

// A POSIX shared-memory object mapped read-write into this process.
class SharedMemoryObject {
 public:
  // Creates the object `key` (a shm_open name without the leading '/';
  // it must not exist), sizes it to `bytes` and maps it. The object is
  // unlinked when this is destroyed.
  static absl::StatusOr<std::unique_ptr<SharedMemoryObject>> Create(
      const std::string& key, size_t bytes);
  // Maps an existing object whole; never unlinks it.
  static absl::StatusOr<std::unique_ptr<SharedMemoryObject>> Open(
      const std::string& key);
  ~SharedMemoryObject();

  SharedMemoryObject(const SharedMemoryObject&) = delete;
  SharedMemoryObject& operator=(const SharedMemoryObject&) = delete;

  const std::string& key() const { return key_; }
  char* data() { return static_cast<char*>(data_); }
  const char* data() const { return static_cast<const char*>(data_); }
  size_t size() const { return size_; }

 private:
  SharedMemoryObject() = default;
  // Maps `bytes` of the open object read-write.
  absl::Status Map(size_t bytes);

  std::string key_;
  int fd_ = -1;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool owned_ = false;
};

// An open session: the OpenSession stream, held until Close or
// destruction. While open, `client` sends the session's id with every call.
class Session {
 public:
  static absl::StatusOr<std::unique_ptr<Session>> Open(Client& client);
  ~Session();

  const std::string& id() const { return id_; }
  int max_regions() const { return max_regions_; }
  uint64_t max_bytes() const { return max_bytes_; }
  // Ends the session; the daemon releases its regions. Idempotent.
  absl::Status Close();

 private:
  Session() = default;
  Client* client_ = nullptr;
  std::string id_;
  int max_regions_ = 0;
  uint64_t max_bytes_ = 0;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::OpenSessionRequest, v1::SessionEvent>>
      stream_;
};

v1::SharedMemoryRef ShmRef(const std::string& region, uint64_t offset,
                           uint64_t byte_size);
// A TensorRef whose bytes are in `region` at `offset`; byte_size is the
// tensor's size.
v1::TensorRef ShmTensorRef(DType dtype, const std::vector<int64_t>& shape,
                           const std::string& region, uint64_t offset);

}  // namespace mhc::client

#endif  // MHC_CLIENT_SHM_H_
