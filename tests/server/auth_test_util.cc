#include "auth_test_util.h"

#include <fcntl.h>
#include <grp.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "mhc/client/client.h"
#include "mhc/v1/service.pb.h"

namespace mhc::testing {

TempDir::TempDir() {
  char dir[] = "/tmp/mhcd-auth-XXXXXX";
  if (mkdtemp(dir) != nullptr) path_ = dir;
}

TempDir::~TempDir() {
  std::error_code ignored;
  if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
}

std::string TempDir::Write(const std::string& name, const std::string& text,
                           mode_t mode) const {
  const std::string path = absl::StrCat(path_, "/", name);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
  chmod(path.c_str(), mode);
  return path;
}

std::string WriteTokensFile(const TempDir& dir) {
  return dir.Write("tokens", absl::StrCat("# role tokens of the tests\n",
                                          kReadToken, " read reader\n",
                                          kComputeToken, " compute trainer\n",
                                          kAdminToken, " admin operator\n"));
}

const google::protobuf::ServiceDescriptor& MhcService() {
  // Through a message of the file, so that its descriptor is linked in.
  return *v1::GetServerInfoRequest::descriptor()->file()->FindServiceByName(
      "Mhc");
}

absl::Status CallEmpty(const std::shared_ptr<grpc::Channel>& channel,
                       const google::protobuf::MethodDescriptor& method,
                       const std::string& token) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(30));
  if (!token.empty()) {
    context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
  }
  const std::string name =
      absl::StrCat("/", method.service()->full_name(), "/", method.name());
  grpc::Slice empty(std::string(""));
  grpc::ByteBuffer request(&empty, 1);
  grpc::CompletionQueue queue;
  grpc::Status status;
  void* tag = nullptr;
  bool ok = false;
  if (!method.client_streaming() && !method.server_streaming()) {
    grpc::ByteBuffer response;
    auto call = stub.PrepareUnaryCall(&context, name, request, &queue);
    call->StartCall();
    call->Finish(&response, &status, reinterpret_cast<void*>(1));
    queue.Next(&tag, &ok);
    return client::FromGrpcStatus(status);
  }
  // Each step waits for its own completion before the next starts.
  auto call = stub.PrepareCall(&context, name, &queue);
  call->StartCall(reinterpret_cast<void*>(1));
  queue.Next(&tag, &ok);
  call->Write(request, reinterpret_cast<void*>(2));
  queue.Next(&tag, &ok);
  call->WritesDone(reinterpret_cast<void*>(3));
  queue.Next(&tag, &ok);
  grpc::ByteBuffer response;
  do {
    call->Read(&response, reinterpret_cast<void*>(4));
    queue.Next(&tag, &ok);
  } while (ok);
  call->Finish(&status, reinterpret_cast<void*>(5));
  queue.Next(&tag, &ok);
  return client::FromGrpcStatus(status);
}

absl::StatusOr<std::string> RunAs(uid_t uid, gid_t gid,
                                  const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const std::string& arg : argv) {
    args.push_back(const_cast<char*>(arg.c_str()));
  }
  args.push_back(nullptr);
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) return absl::InternalError("pipe");
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork");
  if (pid == 0) {
    dup2(out[1], STDOUT_FILENO);
    if (setgroups(0, nullptr) != 0 || setgid(gid) != 0 || setuid(uid) != 0) {
      _exit(126);
    }
    execv(args[0], args.data());
    _exit(127);
  }
  close(out[1]);
  std::string text;
  char buffer[4096];
  ssize_t got;
  while ((got = read(out[0], buffer, sizeof(buffer))) > 0 ||
         (got < 0 && errno == EINTR)) {
    if (got > 0) text.append(buffer, static_cast<size_t>(got));
  }
  close(out[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(absl::StrCat(
        argv[0], " as uid ", uid, " failed (status ", status, "): ", text));
  }
  return text;
}

}  // namespace mhc::testing
