// System shared memory follows the caller: the daemon (root here) maps an
// object only when the unix peer could open it for reading and writing
// itself. The peer is auth_peer run as another user.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "auth_test_util.h"
#include "mhc/client/shm.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

constexpr uid_t kNobody = 65534;
constexpr uint64_t kBytes = 4096;

// A POSIX shm object made by this test with the given owner and mode.
class Object {
 public:
  Object(const std::string& tag, uid_t uid, gid_t gid, mode_t mode)
      : key_(client::UniqueShmKey("mhcd_", tag)) {
    const int fd =
        shm_open(("/" + key_).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    ok_ = fd >= 0 && ftruncate(fd, kBytes) == 0 && fchown(fd, uid, gid) == 0 &&
          fchmod(fd, mode) == 0;
    if (fd >= 0) close(fd);
  }
  ~Object() { shm_unlink(("/" + key_).c_str()); }
  const std::string& key() const { return key_; }
  bool ok() const { return ok_; }

 private:
  std::string key_;
  bool ok_ = false;
};

class ShmOwnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root to act as another user";
  }

  // Starts a daemon nobody may connect to, with `flags`.
  void StartDaemon(std::vector<std::string> flags) {
    flags.push_back("--allow_shm");
    flags.push_back("--unix_socket_mode=0666");
    MHC_ASSERT_OK_AND_ASSIGN(daemon_, Daemon::Start(flags));
    const std::string socket = daemon_->address().substr(5);
    ASSERT_EQ(chmod(socket.substr(0, socket.rfind('/')).c_str(), 0755), 0);
  }

  // What registering `object` as nobody (gid `gid`) answers.
  std::string RegisterAsNobody(const Object& object, gid_t gid = kNobody) {
    auto out = RunAs(kNobody, gid,
                     {MHC_AUTH_PEER_PATH, "register", daemon_->address(),
                      object.key(), std::to_string(kBytes)});
    return out.ok() ? *out : std::string(out.status().message());
  }

  std::unique_ptr<Daemon> daemon_;
};

TEST_F(ShmOwnerTest, AnObjectThePeerCannotOpenIsRefused) {
  StartDaemon({});
  Object roots(/*tag=*/"roots", 0, 0, 0600);
  ASSERT_TRUE(roots.ok());
  const std::string answer = RegisterAsNobody(roots);
  EXPECT_TRUE(absl::StartsWith(answer, "code PERMISSION_DENIED")) << answer;
  EXPECT_TRUE(absl::StrContains(answer, "uid 65534")) << answer;

  // Read-only for everyone is not enough either: regions are writable.
  Object readable("readable", 0, 0, 0644);
  ASSERT_TRUE(readable.ok());
  EXPECT_TRUE(
      absl::StartsWith(RegisterAsNobody(readable), "code PERMISSION_DENIED"));
}

TEST_F(ShmOwnerTest, ObjectsThePeerCanOpenAreMapped) {
  StartDaemon({});
  Object own("own", kNobody, kNobody, 0600);
  Object shared("shared", 0, 0, 0666);
  Object group("group", 0, kNobody, 0660);
  ASSERT_TRUE(own.ok() && shared.ok() && group.ok());
  EXPECT_EQ(RegisterAsNobody(own), "code OK: \n");
  EXPECT_EQ(RegisterAsNobody(shared), "code OK: \n");
  EXPECT_EQ(RegisterAsNobody(group), "code OK: \n");
  // The same object for a member of another group only.
  EXPECT_TRUE(
      absl::StartsWith(RegisterAsNobody(group, 0), "code PERMISSION_DENIED"));
}

TEST_F(ShmOwnerTest, ASessionAnswersOnlyToTheUserThatOpenedIt) {
  StartDaemon({});
  MHC_ASSERT_OK_AND_ASSIGN(auto client, daemon_->Connect());
  MHC_ASSERT_OK_AND_ASSIGN(auto session, client::Session::Open(*client));
  // Another connection of the same user is the same caller...
  MHC_ASSERT_OK_AND_ASSIGN(auto same_user, daemon_->Connect());
  same_user->set_session_id(session->id());
  MHC_ASSERT_OK(same_user->SharedMemoryStatus().status());
  // ...another user is not, even with the id.
  auto answer =
      RunAs(kNobody, kNobody,
            {MHC_AUTH_PEER_PATH, "status", daemon_->address(), session->id()});
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_TRUE(absl::StartsWith(*answer, "code PERMISSION_DENIED")) << *answer;
  EXPECT_TRUE(absl::StrContains(*answer, "another caller")) << *answer;
  // Nobody's own session works for nobody.
  auto own = RunAs(kNobody, kNobody,
                   {MHC_AUTH_PEER_PATH, "status", daemon_->address(), ""});
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ(*own, "code OK: \n");
}

TEST_F(ShmOwnerTest, RootMayMapAnotherUsersObject) {
  StartDaemon({});
  Object nobodys("nobodys", kNobody, kNobody, 0600);
  ASSERT_TRUE(nobodys.ok());
  MHC_ASSERT_OK_AND_ASSIGN(auto client, daemon_->Connect());
  MHC_ASSERT_OK_AND_ASSIGN(auto session, client::Session::Open(*client));
  MHC_ASSERT_OK(
      client->RegisterSystemSharedMemory("r", nobodys.key(), 0, kBytes));
}

TEST_F(ShmOwnerTest, WithAuthenticationOnlyUnixPeersMapSystemMemory) {
  TempDir dir;
  StartDaemon({"--auth_tokens=" + WriteTokensFile(dir),
               absl::StrCat("--unix_peer_roles=", kNobody, ":compute"),
               absl::StrCat("--listen=", "127.0.0.1:0"), "--shm_allow_tcp"});
  // The harness's socket was replaced by TCP; find the port.
  std::string address;
  for (absl::string_view line : absl::StrSplit(daemon_->Stdout(), '\n')) {
    if (absl::ConsumePrefix(&line, "mhcd: listening on ")) {
      address = std::string(line);
    }
  }
  ASSERT_FALSE(address.empty()) << daemon_->Stdout();
  Object shared("tcp", 0, 0, 0666);
  ASSERT_TRUE(shared.ok());
  client::ClientOptions options;
  options.bearer_token = kComputeToken;
  MHC_ASSERT_OK_AND_ASSIGN(auto client,
                           client::Client::Connect(address, options));
  MHC_ASSERT_OK_AND_ASSIGN(auto session, client::Session::Open(*client));
  const absl::Status status =
      client->RegisterSystemSharedMemory("r", shared.key(), 0, kBytes);
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "unix socket")) << status;
}

}  // namespace
}  // namespace mhc::testing
