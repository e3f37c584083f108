// The pieces of authentication in process: tokens file, uid roles, the RPC
// role table, peer credentials and the permission check of shared memory.
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "mhc/v1/service.grpc.pb.h"
#include "server/auth_policy.h"
#include "server/peer_credentials.h"
#include "server/rpc_roles.h"
#include "server/security_config.h"
#include "server/unix_listener.h"

namespace mhc::server {
namespace {

constexpr char kRead[] = "read-token-0123456789";
constexpr char kAdmin[] = "admin-token-0123456789";

TEST(AuthPolicyTest, ParsesTokensWithRolesAndNames) {
  auto tokens = AuthPolicy::ParseTokens(
      absl::StrCat("# comment\n\n", kRead, " read ci\n", kAdmin, "\tadmin\n"));
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_EQ(tokens->size(), 2u);
  EXPECT_EQ((*tokens)[0].role, Role::kRead);
  EXPECT_EQ((*tokens)[0].name, "ci");
  EXPECT_EQ((*tokens)[1].role, Role::kAdmin);
  EXPECT_EQ((*tokens)[1].name, "token4");
}

TEST(AuthPolicyTest, RefusesMalformedTokensFiles) {
  for (const std::string& text :
       {std::string("short read\n"), absl::StrCat(kRead, " root\n"),
        absl::StrCat(kRead, "\n"), absl::StrCat(kRead, " read a b\n"),
        absl::StrCat(kRead, " read\n", kRead, " admin\n"),
        std::string("# nothing\n")}) {
    auto tokens = AuthPolicy::ParseTokens(text);
    EXPECT_EQ(tokens.status().code(), absl::StatusCode::kInvalidArgument)
        << text;
  }
  EXPECT_TRUE(absl::StrContains(
      AuthPolicy::ParseTokens(absl::StrCat("\n", kRead, " boss\n"))
          .status()
          .message(),
      "line 2"));
}

TEST(AuthPolicyTest, TokensFileMustBeClosedToOtherUsers) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("mhcd-tokens-" + std::to_string(getpid())))
                               .string();
  std::ofstream(path) << kRead << " read\n";
  ASSERT_EQ(chmod(path.c_str(), 0644), 0);
  auto refused = AuthPolicy::ReadTokensFile(path);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "644"))
      << refused.status();
  ASSERT_EQ(chmod(path.c_str(), 0640), 0);
  auto read = AuthPolicy::ReadTokensFile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->front().secret, kRead);
  std::remove(path.c_str());
  EXPECT_EQ(AuthPolicy::ReadTokensFile(path).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(AuthPolicyTest, ParsesUidRoles) {
  auto roles = AuthPolicy::ParseUidRoles("1000:compute, 0:admin");
  ASSERT_TRUE(roles.ok()) << roles.status();
  EXPECT_EQ(roles->at(1000), Role::kCompute);
  EXPECT_EQ(roles->at(0), Role::kAdmin);
  for (const char* bad : {"1000", "x:read", "1000:root", "1:read,1:admin"}) {
    EXPECT_FALSE(AuthPolicy::ParseUidRoles(bad).ok()) << bad;
  }
}

TEST(AuthPolicyTest, ATokenDecidesAloneAndAPeerFallsBackToItsUid) {
  auto tokens = AuthPolicy::ParseTokens(absl::StrCat(kRead, " read ci\n"));
  ASSERT_TRUE(tokens.ok());
  AuthPolicy policy(*tokens, {{1000, Role::kAdmin}});
  PeerCredentials admin_user;
  admin_user.uid = 1000;
  PeerCredentials stranger;
  stranger.uid = 1001;

  auto by_token = policy.Authenticate(kRead, admin_user);
  ASSERT_TRUE(by_token.ok());
  EXPECT_EQ(by_token->role, Role::kRead);
  EXPECT_EQ(by_token->name, "token 'ci'");
  auto by_uid = policy.Authenticate(std::nullopt, admin_user);
  ASSERT_TRUE(by_uid.ok());
  EXPECT_EQ(by_uid->role, Role::kAdmin);

  EXPECT_EQ(
      policy.Authenticate("read-token-012345678X", admin_user).status().code(),
      absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(policy.Authenticate(std::nullopt, stranger).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(policy.Authenticate(std::nullopt, std::nullopt).status().code(),
            absl::StatusCode::kUnauthenticated);
}

TEST(AuthPolicyTest, ConstantTimeEqualsComparesWholeStrings) {
  EXPECT_TRUE(ConstantTimeEquals("abcdef", "abcdef"));
  EXPECT_FALSE(ConstantTimeEquals("abcdeg", "abcdef"));
  EXPECT_FALSE(ConstantTimeEquals("abcde", "abcdef"));
  EXPECT_FALSE(ConstantTimeEquals("abcdefg", "abcdef"));
  EXPECT_FALSE(ConstantTimeEquals("", "a"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
}

// Every RPC of the service has a role, and the table names no RPC the
// service lacks: a new RPC cannot be served unclassified.
TEST(RpcRolesTest, EveryRpcOfTheServiceHasARole) {
  // Through a message of the file, so that its descriptor is linked in.
  const google::protobuf::ServiceDescriptor* service =
      v1::GetServerInfoRequest::descriptor()->file()->FindServiceByName("Mhc");
  ASSERT_NE(service, nullptr);
  std::set<std::string> methods;
  for (int i = 0; i < service->method_count(); ++i) {
    const std::string full =
        absl::StrCat(kMhcServicePrefix, service->method(i)->name());
    methods.insert(full);
    EXPECT_TRUE(RequiredRole(full).ok()) << full << " has no role";
  }
  for (const auto& [method, role] : RpcRoles()) {
    EXPECT_EQ(methods.count(method), 1u) << method << " is not an RPC";
    EXPECT_NE(role, Role::kNone) << method;
  }
  EXPECT_EQ(RequiredRole("/mhc.v1.Mhc/NoSuchRpc").status().code(),
            absl::StatusCode::kInternal);
}

TEST(RpcRolesTest, RolesFollowWhatTheRpcChanges) {
  EXPECT_EQ(*RequiredRole("/mhc.v1.Mhc/GetServerInfo"), Role::kRead);
  EXPECT_EQ(*RequiredRole("/mhc.v1.Mhc/ListCheckpoints"), Role::kRead);
  EXPECT_EQ(*RequiredRole("/mhc.v1.Mhc/Pre"), Role::kCompute);
  EXPECT_EQ(*RequiredRole("/mhc.v1.Mhc/ExecuteStream"), Role::kCompute);
  EXPECT_EQ(*RequiredRole("/mhc.v1.Mhc/MapLayerMemory"), Role::kCompute);
  EXPECT_EQ(*RequiredRole("/mhc.v1.Mhc/SetParameters"), Role::kAdmin);
  EXPECT_EQ(*RequiredRole("/mhc.v1.Mhc/LoadCheckpoint"), Role::kAdmin);
  EXPECT_EQ(*RequiredRole("/mhc.v1.Mhc/OptimizerStep"), Role::kAdmin);
}

TEST(PeerCredentialsTest, GroupsComeFromTheProcessOnlyWhenItIsTheSameUser) {
  const std::string status =
      "Name:\tpython3\nUid:\t1000\t1000\t1000\t1000\n"
      "Gid:\t100\t100\t100\t100\nGroups:\t27 100 998 \n";
  std::vector<gid_t> groups;
  ASSERT_TRUE(ParseProcStatusGroups(status, 1000, 100, &groups));
  EXPECT_EQ(groups, (std::vector<gid_t>{27, 100, 998}));
  EXPECT_FALSE(ParseProcStatusGroups(status, 1001, 100, &groups));
  EXPECT_FALSE(ParseProcStatusGroups(status, 1000, 0, &groups));
  EXPECT_FALSE(ParseProcStatusGroups("Uid:\t1000\t1000\t1000\t1000\n", 1000,
                                     100, &groups));
}

TEST(PeerCredentialsTest, MayReadWriteFollowsOwnerGroupAndOtherBits) {
  struct stat st = {};
  st.st_uid = 1000;
  st.st_gid = 50;
  PeerCredentials owner{1000, 1000, 1, {}};
  PeerCredentials member{2000, 2000, 1, {50}};
  PeerCredentials other{3000, 3000, 1, {}};
  PeerCredentials root{0, 0, 1, {}};

  st.st_mode = S_IFREG | 0600;
  EXPECT_TRUE(MayReadWrite(owner, st));
  EXPECT_FALSE(MayReadWrite(member, st));
  EXPECT_FALSE(MayReadWrite(other, st));
  EXPECT_TRUE(MayReadWrite(root, st));

  st.st_mode = S_IFREG | 0660;
  EXPECT_TRUE(MayReadWrite(member, st));
  EXPECT_FALSE(MayReadWrite(other, st));

  // Read-only for the group is not enough: regions are mapped writable.
  st.st_mode = S_IFREG | 0640;
  EXPECT_FALSE(MayReadWrite(member, st));

  // The owner's own bits decide for the owner, as in the kernel.
  st.st_mode = S_IFREG | 0066;
  EXPECT_FALSE(MayReadWrite(owner, st));
  EXPECT_TRUE(MayReadWrite(other, st));
}

TEST(ConnectionPeersTest, FindsAConnectionByItsDescriptorUntilItCloses) {
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  auto peer = ReadPeerCredentials(pair[0]);
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ(peer->uid, getuid());
  EXPECT_EQ(peer->pid, getpid());

  ConnectionPeers peers;
  auto fd = peers.Adopt(pair[0], *peer);
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_NE(*fd, pair[0]);
  auto found = peers.Find(absl::StrCat("fd:", *fd));
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->uid, getuid());
  EXPECT_FALSE(peers.Find("unix:/tmp/x.sock").has_value());
  EXPECT_FALSE(peers.Find(absl::StrCat("fd:", pair[1])).has_value());
  EXPECT_FALSE(peers.Find("ipv4:127.0.0.1:5000").has_value());

  // A second connection gets a higher number, never the first one's.
  int pair2[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair2), 0);
  close(*fd);
  EXPECT_FALSE(peers.Find(absl::StrCat("fd:", *fd)).has_value());
  auto fd2 = peers.Adopt(pair2[0], *peer);
  ASSERT_TRUE(fd2.ok());
  EXPECT_GT(*fd2, *fd);
  // A descriptor reused by something else is not mistaken for the socket.
  ASSERT_EQ(dup2(pair[1], *fd), *fd);
  EXPECT_FALSE(peers.Find(absl::StrCat("fd:", *fd)).has_value());
  close(*fd);
  close(*fd2);
  close(pair[1]);
  close(pair2[1]);
}

// A drain waits on this before the gRPC server shuts down.
TEST(ConnectionPeersTest, AwaitClosedWaitsForEveryConnectionToClose) {
  ConnectionPeers peers;
  EXPECT_TRUE(peers.AwaitClosed(absl::Now()));
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  auto peer = ReadPeerCredentials(pair[0]);
  ASSERT_TRUE(peer.ok()) << peer.status();
  auto fd = peers.Adopt(pair[0], *peer);
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_FALSE(peers.AwaitClosed(absl::Now() + absl::Milliseconds(20)));
  std::thread closer([fd = *fd] {
    absl::SleepFor(absl::Milliseconds(20));
    close(fd);
  });
  EXPECT_TRUE(peers.AwaitClosed(absl::Now() + absl::Seconds(10)));
  closer.join();
  EXPECT_EQ(peers.size(), 0u);
  close(pair[1]);
}

TEST(SecurityConfigTest, LoopbackHosts) {
  for (const char* host : {"127.0.0.1", "127.1.2.3", "localhost", "[::1]",
                           "::1", "[::ffff:127.0.0.1]"}) {
    EXPECT_TRUE(IsLoopbackHost(host)) << host;
  }
  for (const char* host :
       {"0.0.0.0", "[::]", "10.0.0.1", "example.com", "", "128.0.0.1"}) {
    EXPECT_FALSE(IsLoopbackHost(host)) << host;
  }
}

TEST(SecurityConfigTest, PlaintextRemoteListenersNeedConsent) {
  SecurityConfig config;
  EXPECT_TRUE(CheckTcpListener(config, "127.0.0.1:1", "127.0.0.1").ok());
  EXPECT_EQ(CheckTcpListener(config, "0.0.0.0:1", "0.0.0.0").code(),
            absl::StatusCode::kInvalidArgument);
  config.allow_insecure_remote = true;
  EXPECT_TRUE(CheckTcpListener(config, "0.0.0.0:1", "0.0.0.0").ok());
}

TEST(SecurityConfigTest, TlsFlagsComeTogether) {
  SecurityConfig config;
  config.tls_cert = "/nonexistent/cert.pem";
  EXPECT_EQ(TcpCredentials(config).status().code(),
            absl::StatusCode::kInvalidArgument);
  config = SecurityConfig();
  config.tls_client_ca = "/nonexistent/ca.pem";
  EXPECT_EQ(TcpCredentials(config).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(TcpCredentials(SecurityConfig()).ok());
}

TEST(SecurityConfigTest, AuthenticationDefaultsMakeTheDaemonsUserAdmin) {
  SecurityConfig config;
  auto off = MakeAuthPolicy(config);
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(*off, nullptr);
  config.unix_peer_roles = std::map<uid_t, Role>{};
  auto empty = MakeAuthPolicy(config);
  ASSERT_TRUE(empty.ok());
  PeerCredentials self;
  self.uid = getuid();
  EXPECT_FALSE((*empty)->Authenticate(std::nullopt, self).ok());
  config = SecurityConfig();
  config.auth_tokens_file = "/nonexistent/tokens";
  EXPECT_FALSE(MakeAuthPolicy(config).ok());
}

}  // namespace
}  // namespace mhc::server
