// GroupTransport over NCCL. The library is loaded at run time (dlopen), so
// that mhcd starts where NCCL is not installed and refuses groups with the
// reason. Communicators are non-blocking: connecting and every wait poll
// with a deadline, and a communicator whose peer is gone is aborted, which
// also ends its kernels, instead of hanging the device.
#ifndef MHC_SERVER_NCCL_TRANSPORT_H_
#define MHC_SERVER_NCCL_TRANSPORT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/group_transport.h"

namespace mhc::server {

// `library`: a file name the dynamic loader finds ("libnccl.so.2") or a
// path. FAILED_PRECONDITION, naming the loader's error, when it cannot be
// loaded or lacks an entry point mhcd uses.
absl::StatusOr<std::unique_ptr<GroupTransport>> LoadNcclTransport(
    const std::string& library);

}  // namespace mhc::server

#endif  // MHC_SERVER_NCCL_TRANSPORT_H_
