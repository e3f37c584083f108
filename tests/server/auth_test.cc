// Authentication against a real daemon: every RPC of the service descriptor
// answered for every caller as the role table says, unix peers by their
// user, the start-up refusals and the socket's permissions.
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "auth_test_util.h"
#include "grpcpp/create_channel.h"
#include "mhc/client/shm.h"
#include "server/rpc_roles.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

using server::Role;
using server::RoleName;

constexpr uid_t kNobody = 65534;

std::string SocketPath(const Daemon& daemon) {
  return daemon.address().substr(5);
}

struct Caller {
  const char* label;
  std::string token;
  Role role;  // kNone: not authenticated
};

// The acceptance table: for each RPC and caller, UNAUTHENTICATED without
// valid credentials, PERMISSION_DENIED naming the role when the caller's
// role is too small, and anything else (the RPC ran) when it is enough.
TEST(AuthTest, EveryRpcAnswersEveryRoleAsTheTableSays) {
  TempDir dir;
  // Root (this test) gets no role from its uid, so only tokens count.
  MHC_ASSERT_OK_AND_ASSIGN(
      auto daemon,
      Daemon::Start({"--auth_tokens=" + WriteTokensFile(dir),
                     absl::StrCat("--unix_peer_roles=", kNobody, ":read")}));
  auto channel = grpc::CreateChannel(daemon->address(),
                                     grpc::InsecureChannelCredentials());
  const std::vector<Caller> callers = {
      {"no token", "", Role::kNone},
      {"unknown token", "unknown-token-0123456789abcdef", Role::kNone},
      {"read", kReadToken, Role::kRead},
      {"compute", kComputeToken, Role::kCompute},
      {"admin", kAdminToken, Role::kAdmin},
  };
  const google::protobuf::ServiceDescriptor& service = MhcService();
  ASSERT_GT(service.method_count(), 40);
  for (int i = 0; i < service.method_count(); ++i) {
    const google::protobuf::MethodDescriptor& method = *service.method(i);
    auto needed = server::RequiredRole(
        absl::StrCat(server::kMhcServicePrefix, method.name()));
    ASSERT_TRUE(needed.ok()) << needed.status();
    for (const Caller& caller : callers) {
      SCOPED_TRACE(absl::StrCat(method.name(), " as ", caller.label));
      const absl::Status status = CallEmpty(channel, method, caller.token);
      if (caller.role == Role::kNone) {
        EXPECT_EQ(status.code(), absl::StatusCode::kUnauthenticated) << status;
      } else if (caller.role < *needed) {
        EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
        EXPECT_TRUE(absl::StrContains(
            status.message(),
            absl::StrCat("needs the ", RoleName(*needed), " role")))
            << status;
      } else {
        EXPECT_NE(status.code(), absl::StatusCode::kUnauthenticated) << status;
        EXPECT_NE(status.code(), absl::StatusCode::kPermissionDenied) << status;
      }
    }
  }
  // Probes keep working without credentials.
  MHC_ASSERT_OK_AND_ASSIGN(auto anonymous, daemon->Connect());
  auto health = anonymous->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, "SERVING");
}

TEST(AuthTest, TheDaemonsOwnUserIsAdminAndATokenDecidesAlone) {
  TempDir dir;
  MHC_ASSERT_OK_AND_ASSIGN(
      auto daemon, Daemon::Start({"--auth_tokens=" + WriteTokensFile(dir)}));
  MHC_ASSERT_OK_AND_ASSIGN(auto owner, daemon->Connect());
  v1::CreateLayerRequest create = LayerRequest("l", 4, 64);
  auto created = owner->CreateLayer(create);
  ASSERT_TRUE(created.ok()) << created.status();

  client::ClientOptions reader_options;
  reader_options.bearer_token = kReadToken;
  MHC_ASSERT_OK_AND_ASSIGN(
      auto reader, client::Client::Connect(daemon->address(), reader_options));
  EXPECT_TRUE(reader->GetLayer("l").ok());
  auto deleted = reader->DeleteLayer("l");
  EXPECT_EQ(deleted.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(absl::StrContains(deleted.status().message(),
                                "DeleteLayer needs the admin role; token "
                                "'reader' has read"))
      << deleted.status();

  client::ClientOptions wrong_options;
  wrong_options.bearer_token = "wrong-token-0123456789abcdef";
  MHC_ASSERT_OK_AND_ASSIGN(
      auto wrong, client::Client::Connect(daemon->address(), wrong_options));
  EXPECT_EQ(wrong->GetLayer("l").status().code(),
            absl::StatusCode::kUnauthenticated);
}

TEST(AuthTest, ASessionAnswersOnlyToTheTokenThatOpenedIt) {
  TempDir dir;
  MHC_ASSERT_OK_AND_ASSIGN(
      auto daemon,
      Daemon::Start({"--auth_tokens=" + WriteTokensFile(dir), "--allow_shm"}));
  auto connect = [&](const std::string& token) {
    client::ClientOptions options;
    options.bearer_token = token;
    return client::Client::Connect(daemon->address(), options);
  };
  MHC_ASSERT_OK_AND_ASSIGN(auto opener, connect(kComputeToken));
  MHC_ASSERT_OK_AND_ASSIGN(auto session, client::Session::Open(*opener));
  // The same token on another connection is the same caller.
  MHC_ASSERT_OK_AND_ASSIGN(auto same, connect(kComputeToken));
  same->set_session_id(session->id());
  MHC_ASSERT_OK(same->SharedMemoryStatus().status());
  // A token of a larger role is another caller, and so is the daemon's own
  // user (admin here) without a token.
  for (const char* token : {kAdminToken, ""}) {
    SCOPED_TRACE(token);
    MHC_ASSERT_OK_AND_ASSIGN(auto other, connect(token));
    other->set_session_id(session->id());
    const absl::Status status = other->SharedMemoryStatus().status();
    EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), "another caller"))
        << status;
    EXPECT_EQ(other->UnregisterSharedMemory("").status().code(),
              absl::StatusCode::kPermissionDenied);
  }
}

TEST(AuthTest, UnixPeersGetTheRoleOfTheirUser) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to act as another user";
  TempDir dir;
  MHC_ASSERT_OK_AND_ASSIGN(
      auto daemon,
      Daemon::Start({"--auth_tokens=" + WriteTokensFile(dir),
                     absl::StrCat("--unix_peer_roles=", kNobody, ":read"),
                     "--unix_socket_mode=0666"}));
  const std::string socket_dir =
      SocketPath(*daemon).substr(0, SocketPath(*daemon).rfind('/'));
  ASSERT_EQ(chmod(socket_dir.c_str(), 0755), 0);

  auto info =
      RunAs(kNobody, kNobody,
            {MHC_AUTH_PEER_PATH, "call", daemon->address(), "GetServerInfo"});
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(absl::StartsWith(*info, "code OK")) << *info;
  auto create =
      RunAs(kNobody, kNobody,
            {MHC_AUTH_PEER_PATH, "call", daemon->address(), "CreateLayer"});
  ASSERT_TRUE(create.ok()) << create.status();
  EXPECT_TRUE(absl::StartsWith(*create, "code PERMISSION_DENIED")) << *create;
  EXPECT_TRUE(absl::StrContains(*create, "uid 65534 has read")) << *create;

  // Root is not listed, so without a token it is nobody to this daemon.
  MHC_ASSERT_OK_AND_ASSIGN(auto root, daemon->Connect());
  EXPECT_EQ(root->GetServerInfo().status().code(),
            absl::StatusCode::kUnauthenticated);
}

TEST(AuthTest, StartRefusesATokensFileOthersCanRead) {
  TempDir dir;
  const std::string tokens = WriteTokensFile(dir);
  ASSERT_EQ(chmod(tokens.c_str(), 0644), 0);
  auto daemon = Daemon::Start({"--auth_tokens=" + tokens},
                              /*capture_stderr=*/true);
  ASSERT_FALSE(daemon.ok());
  EXPECT_TRUE(
      absl::StrContains(daemon.status().message(), "other users may access it"))
      << daemon.status();
}

TEST(AuthTest, StartRefusesPlaintextRemoteListenersUnlessAllowed) {
  auto refused = Daemon::Start({"--listen=0.0.0.0:0"}, /*capture_stderr=*/true);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(
      absl::StrContains(refused.status().message(), "--allow_insecure_remote"))
      << refused.status();
  auto allowed =
      Daemon::Start({"--listen=0.0.0.0:0", "--allow_insecure_remote"});
  EXPECT_TRUE(allowed.ok()) << allowed.status();
}

TEST(AuthTest, SocketFileGetsTheModeAndGroupAsked) {
  MHC_ASSERT_OK_AND_ASSIGN(auto by_default, Daemon::Start());
  struct stat st = {};
  ASSERT_EQ(stat(SocketPath(*by_default).c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);

  std::vector<std::string> flags = {"--unix_socket_mode=0600"};
  if (geteuid() == 0)
    flags.push_back(absl::StrCat("--unix_socket_group=", kNobody));
  MHC_ASSERT_OK_AND_ASSIGN(auto asked, Daemon::Start(flags));
  ASSERT_EQ(stat(SocketPath(*asked).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  if (geteuid() == 0) {
    EXPECT_EQ(st.st_gid, kNobody);
  }
  MHC_ASSERT_OK_AND_ASSIGN(auto client, asked->Connect());
  EXPECT_TRUE(client->GetServerInfo().ok());

  auto bad =
      Daemon::Start({"--unix_socket_mode=0999"}, /*capture_stderr=*/true);
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "--unix_socket_mode"))
      << bad.status();
}

}  // namespace
}  // namespace mhc::testing
