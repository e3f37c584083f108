// A client process for the authentication tests that the test starts under
// another user, so that the daemon sees a different unix peer:
//
//   auth_peer call ADDRESS METHOD
//     Calls mhc.v1.Mhc/METHOD with an empty request.
//   auth_peer register ADDRESS KEY BYTES
//     Opens a session and registers the system shared-memory object KEY
//     (BYTES long) as region "r".
//   auth_peer status ADDRESS SESSION_ID
//     Calls SharedMemoryStatus in session SESSION_ID (empty: a session of
//     its own).
//
// Prints "code NAME: MESSAGE" with the gRPC status of the last call and
// exits 0 (2 for bad usage).
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/generic/generic_stub.h"
#include "mhc/client/client.h"
#include "mhc/client/shm.h"

namespace {

const char* CodeName(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return "OK";
    case absl::StatusCode::kUnauthenticated:
      return "UNAUTHENTICATED";
    case absl::StatusCode::kPermissionDenied:
      return "PERMISSION_DENIED";
    default:
      return "OTHER";
  }
}

int Report(const absl::Status& status) {
  std::cout << "code " << CodeName(status.code()) << ": " << status.message()
            << std::endl;
  return 0;
}

absl::Status CallEmpty(mhc::client::Client& client, const std::string& method) {
  grpc::GenericStub stub(client.channel());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(30));
  grpc::Slice empty(std::string(""));
  grpc::ByteBuffer request(&empty, 1);
  grpc::ByteBuffer response;
  grpc::CompletionQueue queue;
  auto call = stub.PrepareUnaryCall(
      &context, absl::StrCat("/mhc.v1.Mhc/", method), request, &queue);
  call->StartCall();
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  queue.Next(&tag, &ok);
  return mhc::client::FromGrpcStatus(status);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: auth_peer call|register|status ADDRESS ...\n");
    return 2;
  }
  const std::string command = argv[1];
  auto client = mhc::client::Client::Connect(argv[2]);
  if (!client.ok()) return Report(client.status());
  if (command == "call" && argc == 4) {
    return Report(CallEmpty(**client, argv[3]));
  }
  if (command == "status" && argc == 4) {
    std::unique_ptr<mhc::client::Session> own;
    if (argv[3][0] == '\0') {
      auto session = mhc::client::Session::Open(**client);
      if (!session.ok()) return Report(session.status());
      own = std::move(*session);
    } else {
      (*client)->set_session_id(argv[3]);
    }
    return Report((*client)->SharedMemoryStatus().status());
  }
  uint64_t bytes = 0;
  if (command == "register" && argc == 5 && absl::SimpleAtoi(argv[4], &bytes)) {
    auto session = mhc::client::Session::Open(**client);
    if (!session.ok()) return Report(session.status());
    return Report(
        (*client)->RegisterSystemSharedMemory("r", argv[3], 0, bytes));
  }
  std::fprintf(stderr, "auth_peer: bad arguments\n");
  return 2;
}
