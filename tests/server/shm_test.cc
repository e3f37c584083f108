// Shared memory end to end: a real mhcd on a unix socket, clients in this
// process and in a separate one (shm_peer). Every hostile case checks its
// exact status code and that the daemon holds exactly the shared-memory
// descriptors and mappings it held before (and this process its
// descriptors).
#include "mhc/client/shm.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

using client::SharedMemoryObject;
using Code = absl::StatusCode;

constexpr int kN = 4;
constexpr int64_t kC = 64;

// Descriptors and mappings of `pid` that refer to POSIX shared memory.
struct ShmUsage {
  int fds = 0;
  int maps = 0;
  bool operator==(const ShmUsage& o) const {
    return fds == o.fds && maps == o.maps;
  }
};

ShmUsage UsageOf(pid_t pid) {
  ShmUsage usage;
  const std::string proc = absl::StrCat("/proc/", pid);
  std::error_code ec;
  for (const auto& entry :
       std::filesystem::directory_iterator(proc + "/fd", ec)) {
    std::error_code link_ec;
    auto target = std::filesystem::read_symlink(entry.path(), link_ec);
    if (!link_ec && absl::StartsWith(target.string(), "/dev/shm/")) {
      ++usage.fds;
    }
  }
  std::ifstream maps(proc + "/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (absl::StrContains(line, "/dev/shm/")) ++usage.maps;
  }
  return usage;
}

int OpenFds() {
  int count = 0;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec);
       it != std::filesystem::directory_iterator(); ++it) {
    ++count;
  }
  return count;
}

std::string ToString(const ShmUsage& u) {
  return absl::StrCat("{fds ", u.fds, ", maps ", u.maps, "}");
}

v1::TensorRef XRef(const std::string& region, uint64_t offset, int64_t m) {
  return client::ShmTensorRef(DType::kF32, {m, kN, kC}, region, offset);
}

uint64_t XBytes(int64_t m) { return static_cast<uint64_t>(m) * kN * kC * 4; }

class ShmTest : public ::testing::Test {
 protected:
  void SetUp() override { StartDaemon({"--allow_shm"}); }

  void StartDaemon(std::vector<std::string> flags) {
    client_.reset();
    daemon_.reset();
    auto daemon = Daemon::Start(flags);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::move(*daemon);
    auto client = daemon_->Connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    ASSERT_TRUE(CreateRandomLayer(*client_, LayerRequest("l", kN, kC)).ok());
  }

  std::unique_ptr<SharedMemoryObject> Object(size_t bytes,
                                             const std::string& tag = "t") {
    auto object = SharedMemoryObject::Create(
        client::UniqueShmKey("mhcd_test_", tag), bytes);
    EXPECT_TRUE(object.ok()) << object.status();
    return object.ok() ? std::move(*object) : nullptr;
  }

  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<client::Client> client_;
};

TEST_F(ShmTest, SeparateClientProcessGetsTheInlineBytes) {
  auto result = RunCommand({MHC_SHM_PEER_PATH, "equal", daemon_->address(), "l",
                            std::to_string(kN), std::to_string(kC), "37"});
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->first, 0) << result->second;
  EXPECT_TRUE(absl::StrContains(result->second, "equal")) << result->second;
  // The peer's session ended with its process: nothing stays mapped.
  absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!(UsageOf(daemon_->pid()) == ShmUsage{}) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(ToString(UsageOf(daemon_->pid())), ToString(ShmUsage{}));
}

TEST_F(ShmTest, MhcctlRunWithShmPassesItsChecks) {
  auto result =
      RunCommand({MHC_MHCCTL_PATH, "--address=" + daemon_->address(), "run",
                  "--shm", "--tokens=16", "--hidden=64", "--dtype=f32"});
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->first, 0) << result->second;
  EXPECT_TRUE(absl::StrContains(result->second, "PASS")) << result->second;
  EXPECT_EQ(ToString(UsageOf(daemon_->pid())), ToString(ShmUsage{}));
}

// A client process dies holding a session: its region is released, and its
// session id no longer works.
TEST_F(ShmTest, SessionEndReleasesItsRegions) {
  MHC_ASSERT_OK_AND_ASSIGN(
      HoldingPeer peer,
      StartHoldingPeer(MHC_SHM_PEER_PATH, daemon_->address()));
  EXPECT_EQ(UsageOf(daemon_->pid()).maps, 1);

  // Another session cannot see or touch it, and a stolen id is refused
  // once the owner is gone.
  MHC_ASSERT_OK_AND_ASSIGN(auto session, client::Session::Open(*client_));
  EXPECT_EQ(client_->UnregisterSharedMemory("held").status().code(),
            Code::kPermissionDenied);

  kill(peer.pid, SIGKILL);
  waitpid(peer.pid, nullptr, 0);
  close(peer.stdin_fd);
  absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (UsageOf(daemon_->pid()).maps != 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(ToString(UsageOf(daemon_->pid())), ToString(ShmUsage{}));
  // The object itself belonged to the dead process; remove it here.
  shm_unlink(absl::StrCat("/", peer.shm_key).c_str());
  client_->set_session_id(peer.session_id);
  EXPECT_EQ(client_->SharedMemoryStatus().status().code(), Code::kNotFound);
  EXPECT_EQ(client_->UnregisterSharedMemory("held").status().code(),
            Code::kNotFound);
  client_->set_session_id(session->id());
  MHC_ASSERT_OK_AND_ASSIGN(auto status, client_->SharedMemoryStatus());
  EXPECT_EQ(status.regions_size(), 0);
}

TEST_F(ShmTest, SecondSessionCanNeitherSeeUseNorUnregister) {
  MHC_ASSERT_OK_AND_ASSIGN(auto other, daemon_->Connect());
  MHC_ASSERT_OK_AND_ASSIGN(auto mine, client::Session::Open(*client_));
  MHC_ASSERT_OK_AND_ASSIGN(auto theirs, client::Session::Open(*other));
  auto object = Object(XBytes(2));
  ASSERT_NE(object, nullptr);
  MHC_ASSERT_OK(client_->RegisterSystemSharedMemory("a", object->key(), 0,
                                                    object->size()));
  v1::PreRequest pre;
  pre.set_layer("l");
  *pre.mutable_x() = XRef("a", 0, 2);
  MHC_ASSERT_OK(client_->Pre(pre).status());
  EXPECT_EQ(other->Pre(pre).status().code(), Code::kPermissionDenied);
  EXPECT_EQ(other->UnregisterSharedMemory("a").status().code(),
            Code::kPermissionDenied);
  MHC_ASSERT_OK_AND_ASSIGN(auto listed, other->SharedMemoryStatus());
  EXPECT_EQ(listed.regions_size(), 0);
  EXPECT_EQ(other->UnregisterSharedMemory("").status().code(), Code::kOk);
  // Both sessions may use the same name for their own regions.
  MHC_ASSERT_OK(
      other->RegisterSystemSharedMemory("a", object->key(), 0, object->size()));
  MHC_ASSERT_OK_AND_ASSIGN(listed, client_->SharedMemoryStatus());
  ASSERT_EQ(listed.regions_size(), 1);
  EXPECT_EQ(listed.regions(0).byte_size(), object->size());
  MHC_ASSERT_OK(theirs->Close());
  MHC_ASSERT_OK(client_->Pre(pre).status());
}

// The byte limits bound what travels in messages; a region bounds its own
// tensors: an x over --max_tensor_bytes and --max_request_bytes runs through
// shared memory with every output written there too, while the same x
// inline is refused. (The limits still admit the layer's inline phi.)
TEST_F(ShmTest, ByteLimitsCountInlineBytesOnly) {
  StartDaemon(
      {"--allow_shm", "--max_tensor_bytes=32768", "--max_request_bytes=40000"});
  MHC_ASSERT_OK_AND_ASSIGN(auto session, client::Session::Open(*client_));
  constexpr int64_t kM = 64;
  const std::vector<std::pair<std::string, uint64_t>> outputs = {
      {"y", kM * kC * 4},
      {"h_pre", kM * kN * 4},
      {"h_post", kM * kN * 4},
      {"h_res", kM * kN * kN * 4}};
  uint64_t end = XBytes(kM);
  v1::PreRequest pre;
  pre.set_layer("l");
  *pre.mutable_x() = XRef("big", 0, kM);
  for (const auto& [name, bytes] : outputs) {
    v1::SharedMemoryRef& ref = (*pre.mutable_output_regions())[name];
    ref.set_region("big");
    ref.set_offset(end);
    ref.set_byte_size(bytes);
    end += bytes;
  }
  auto object = Object(end);
  ASSERT_NE(object, nullptr);
  client::HostTensor x = RandomF32({kM, kN, kC});
  std::memcpy(object->data(), x.data(), x.bytes.size());
  MHC_ASSERT_OK(client_->RegisterSystemSharedMemory("big", object->key(), 0,
                                                    object->size()));
  MHC_ASSERT_OK(client_->Pre(pre).status());

  v1::PreRequest inline_x = pre;
  inline_x.clear_output_regions();
  *inline_x.mutable_x() = client::ToTensorRef(x);
  absl::StatusOr<v1::PreResponse> refused = client_->Pre(inline_x);
  EXPECT_EQ(refused.status().code(), Code::kResourceExhausted);
  EXPECT_TRUE(
      absl::StrContains(refused.status().message(), "--max_tensor_bytes"))
      << refused.status();
}

// Stream order and mapped layer memory exist only for CUDA devices: on a
// host backend each is refused with a message that says why, and the
// request changes nothing.
TEST_F(ShmTest, StreamOrderAndLayerMemoryNeedACudaDevice) {
  MHC_ASSERT_OK_AND_ASSIGN(auto session, client::Session::Open(*client_));
  absl::StatusOr<std::vector<std::string>> events =
      client_->RegisterCudaEvents(0, {std::string(64, '\0')});
  EXPECT_EQ(events.status().code(), Code::kFailedPrecondition)
      << events.status();
  absl::StatusOr<v1::LayerMemory> memory = client_->MapLayerMemory("l");
  EXPECT_EQ(memory.status().code(), Code::kFailedPrecondition)
      << memory.status();
  EXPECT_TRUE(absl::StrContains(memory.status().message(), "Get/SetParameters"))
      << memory.status();

  auto object = Object(XBytes(2));
  ASSERT_NE(object, nullptr);
  MHC_ASSERT_OK(client_->RegisterSystemSharedMemory("a", object->key(), 0,
                                                    object->size()));
  v1::PreRequest pre;
  pre.set_layer("l");
  *pre.mutable_x() = XRef("a", 0, 2);
  client_->set_stream_order({/*wait_event=*/0, /*signal_event=*/0});
  absl::StatusOr<v1::PreResponse> ordered = client_->Pre(pre);
  EXPECT_EQ(ordered.status().code(), Code::kFailedPrecondition)
      << ordered.status();
  EXPECT_TRUE(absl::StrContains(ordered.status().message(), "mhc-wait-event"))
      << ordered.status();
  client_->set_stream_order({});
  MHC_ASSERT_OK(client_->Pre(pre).status());
}

struct Hostile {
  std::string name;
  Code code;
  std::function<absl::Status()> run;
};

// Each case runs in the same daemon and session; registrations that a case
// makes on purpose it also removes, so the usage check is exact.
TEST_F(ShmTest, HostileRegistrationsAndUsesFailCleanly) {
  StartDaemon({"--allow_shm", "--shm_max_regions_per_session=3",
               "--shm_max_bytes_per_session=1048576"});
  MHC_ASSERT_OK_AND_ASSIGN(auto session, client::Session::Open(*client_));
  client::Client& c = *client_;
  auto object = Object(64 * 1024, "main");
  ASSERT_NE(object, nullptr);
  const std::string key = object->key();
  MHC_ASSERT_OK(c.RegisterSystemSharedMemory("base", key, 0, object->size()));
  auto pre_with = [&c](v1::TensorRef x) {
    v1::PreRequest pre;
    pre.set_layer("l");
    *pre.mutable_x() = std::move(x);
    return c.Pre(pre).status();
  };

  std::vector<Hostile> cases = {
      {"key with a slash", Code::kInvalidArgument,
       [&] { return c.RegisterSystemSharedMemory("r", "mhcd_a/b", 0, 8); }},
      {"key traversing", Code::kInvalidArgument,
       [&] { return c.RegisterSystemSharedMemory("r", "mhcd_..", 0, 8); }},
      {"key with a leading slash", Code::kInvalidArgument,
       [&] { return c.RegisterSystemSharedMemory("r", "/" + key, 0, 8); }},
      {"key without the prefix", Code::kInvalidArgument,
       [&] { return c.RegisterSystemSharedMemory("r", "other_x", 0, 8); }},
      {"key of no object", Code::kNotFound,
       [&] {
         return c.RegisterSystemSharedMemory("r", key + "_missing", 0, 8);
       }},
      {"bad region name", Code::kInvalidArgument,
       [&] { return c.RegisterSystemSharedMemory("../r", key, 0, 8); }},
      {"zero byte_size", Code::kInvalidArgument,
       [&] { return c.RegisterSystemSharedMemory("r", key, 0, 0); }},
      {"offset + size overflow", Code::kInvalidArgument,
       [&] {
         return c.RegisterSystemSharedMemory("r", key, UINT64_MAX - 4, 8);
       }},
      {"offset past the end", Code::kInvalidArgument,
       [&] {
         return c.RegisterSystemSharedMemory("r", key, object->size() + 4096,
                                             8);
       }},
      {"range past the end", Code::kInvalidArgument,
       [&] {
         return c.RegisterSystemSharedMemory("r", key, 4096, object->size());
       }},
      {"double register", Code::kAlreadyExists,
       [&] { return c.RegisterSystemSharedMemory("base", key, 0, 8); }},
      {"CUDA handle of 63 bytes", Code::kInvalidArgument,
       [&] {
         return c.RegisterCudaSharedMemory("g", std::string(63, 'h'), 0, 8);
       }},
      {"CUDA device id -1", Code::kInvalidArgument,
       [&] {
         return c.RegisterCudaSharedMemory("g", std::string(64, 'h'), -1, 8);
       }},
      {"CUDA without a CUDA device", Code::kFailedPrecondition,
       [&] {
         return c.RegisterCudaSharedMemory("g", std::string(64, 'h'), 0, 8);
       }},
      {"byte quota exceeded", Code::kResourceExhausted,
       [&]() -> absl::Status {
         auto big = Object(2 << 20, "big");
         return c.RegisterSystemSharedMemory("big", big->key(), 0, big->size());
       }},
      {"region quota exceeded", Code::kResourceExhausted,
       [&]() -> absl::Status {
         MHC_RETURN_IF_ERROR(c.RegisterSystemSharedMemory("q1", key, 0, 8));
         MHC_RETURN_IF_ERROR(c.RegisterSystemSharedMemory("q2", key, 0, 8));
         absl::Status third = c.RegisterSystemSharedMemory("q3", key, 0, 8);
         MHC_RETURN_IF_ERROR(c.UnregisterSharedMemory("q1").status());
         MHC_RETURN_IF_ERROR(c.UnregisterSharedMemory("q2").status());
         return third;
       }},
      {"register without a session", Code::kFailedPrecondition,
       [&]() -> absl::Status {
         const std::string id = c.session_id();
         c.set_session_id("");
         absl::Status s = c.RegisterSystemSharedMemory("r", key, 0, 8);
         c.set_session_id(id);
         return s;
       }},
      {"register with a forged session id", Code::kNotFound,
       [&]() -> absl::Status {
         const std::string id = c.session_id();
         c.set_session_id(std::string(32, '0'));
         absl::Status s = c.RegisterSystemSharedMemory("r", key, 0, 8);
         c.set_session_id(id);
         return s;
       }},
      {"use of an unknown region", Code::kNotFound,
       [&] { return pre_with(XRef("nope", 0, 2)); }},
      {"use with a wrong byte_size", Code::kInvalidArgument,
       [&] {
         v1::TensorRef x = XRef("base", 0, 2);
         x.mutable_shm()->set_byte_size(XBytes(2) - 4);
         return pre_with(x);
       }},
      {"use past the region's end", Code::kInvalidArgument,
       [&] { return pre_with(XRef("base", object->size() - 64, 2)); }},
      {"use with offset overflow", Code::kInvalidArgument,
       [&] { return pre_with(XRef("base", UINT64_MAX - 8, 2)); }},
      {"output overlapping an input", Code::kInvalidArgument,
       [&] {
         v1::PreRequest pre;
         pre.set_layer("l");
         *pre.mutable_x() = XRef("base", 0, 2);
         (*pre.mutable_output_regions())["y"] =
             client::ShmRef("base", 64, 2 * kC * 4);
         return c.Pre(pre).status();
       }},
      {"output_regions naming no output", Code::kInvalidArgument,
       [&] {
         v1::PreRequest pre;
         pre.set_layer("l");
         *pre.mutable_x() = XRef("base", 0, 2);
         (*pre.mutable_output_regions())["z"] = client::ShmRef("base", 8192, 8);
         return c.Pre(pre).status();
       }},
      {"unregister of an unknown region", Code::kNotFound,
       [&] { return c.UnregisterSharedMemory("nope").status(); }},
      {"region shrunk after registration", Code::kFailedPrecondition,
       [&]() -> absl::Status {
         auto shrink = Object(XBytes(2), "shrink");
         MHC_RETURN_IF_ERROR(c.RegisterSystemSharedMemory(
             "shrink", shrink->key(), 0, shrink->size()));
         int fd = shm_open(absl::StrCat("/", shrink->key()).c_str(), O_RDWR, 0);
         if (fd < 0 || ftruncate(fd, 100) != 0) {
           return absl::InternalError("truncate");
         }
         close(fd);
         absl::Status s = pre_with(XRef("shrink", 0, 2));
         MHC_RETURN_IF_ERROR(c.UnregisterSharedMemory("shrink").status());
         return s;
       }},
      {"region unlinked after registration still works", Code::kOk,
       [&]() -> absl::Status {
         auto gone = Object(XBytes(2), "gone");
         MHC_RETURN_IF_ERROR(c.RegisterSystemSharedMemory("gone", gone->key(),
                                                          0, gone->size()));
         shm_unlink(absl::StrCat("/", gone->key()).c_str());
         absl::Status s = pre_with(XRef("gone", 0, 2));
         MHC_RETURN_IF_ERROR(c.UnregisterSharedMemory("gone").status());
         return s;
       }},
  };
  ASSERT_GE(cases.size(), 15u);
  for (const Hostile& h : cases) {
    SCOPED_TRACE(h.name);
    const ShmUsage before = UsageOf(daemon_->pid());
    const int fds_before = OpenFds();
    absl::Status status = h.run();
    EXPECT_EQ(status.code(), h.code) << h.name << ": " << status;
    EXPECT_FALSE(absl::StrContains(status.message(), key))
        << h.name << " echoed the key: " << status;
    EXPECT_EQ(ToString(UsageOf(daemon_->pid())), ToString(before)) << h.name;
    EXPECT_EQ(OpenFds(), fds_before) << h.name;
  }
  MHC_ASSERT_OK_AND_ASSIGN(auto status, c.SharedMemoryStatus());
  ASSERT_EQ(status.regions_size(), 1);
  EXPECT_EQ(status.regions(0).name(), "base");
}

// A long batch holds its region: unregistering it is refused while the batch
// runs and succeeds after.
TEST_F(ShmTest, UnregisterWhileInUseIsRefused) {
  MHC_ASSERT_OK_AND_ASSIGN(auto session, client::Session::Open(*client_));
  const int64_t m = 32768;
  auto object = Object(XBytes(m));
  ASSERT_NE(object, nullptr);
  MHC_ASSERT_OK(client_->RegisterSystemSharedMemory("x", object->key(), 0,
                                                    object->size()));
  v1::ExecuteRequest batch;
  for (int i = 0; i < 6; ++i) {
    v1::Op* op = batch.add_ops();
    op->set_id(absl::StrCat("p", i));
    op->mutable_pre()->set_layer("l");
    *op->mutable_pre()->mutable_x() = XRef("x", 0, m);
  }
  batch.add_fetch("p0.h_pre");
  MHC_ASSERT_OK_AND_ASSIGN(auto runner, daemon_->Connect());
  runner->set_session_id(session->id());
  absl::Status ran;
  std::thread thread([&] { ran = runner->Execute(batch).status(); });
  bool seen_in_use = false;
  for (int i = 0; i < 2000 && !seen_in_use; ++i) {
    auto status = client_->SharedMemoryStatus("x");
    seen_in_use = status.ok() && status->regions(0).in_use() > 0;
    if (!seen_in_use) absl::SleepFor(absl::Milliseconds(1));
  }
  absl::Status refused = client_->UnregisterSharedMemory("x").status();
  absl::Status refused_all = client_->UnregisterSharedMemory("").status();
  thread.join();
  MHC_ASSERT_OK(ran);
  ASSERT_TRUE(seen_in_use) << "the batch finished before it was observed";
  EXPECT_EQ(refused.code(), Code::kFailedPrecondition) << refused;
  EXPECT_EQ(refused_all.code(), Code::kFailedPrecondition) << refused_all;
  MHC_ASSERT_OK(client_->UnregisterSharedMemory("x").status());
  EXPECT_EQ(ToString(UsageOf(daemon_->pid())), ToString(ShmUsage{}));
}

TEST(ShmAccessTest, DisabledWithoutAllowShm) {
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start());
  MHC_ASSERT_OK_AND_ASSIGN(auto client, daemon->Connect());
  EXPECT_EQ(client::Session::Open(*client).status().code(),
            Code::kFailedPrecondition);
  EXPECT_EQ(client->RegisterSystemSharedMemory("r", "mhcd_x", 0, 8).code(),
            Code::kFailedPrecondition);
}

TEST(ShmAccessTest, RefusedOverTcpUnlessAllowed) {
  for (bool allow : {false, true}) {
    std::vector<std::string> flags = {"--allow_shm", "--listen=127.0.0.1:0"};
    if (allow) flags.push_back("--shm_allow_tcp");
    MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start(flags));
    std::string address;
    for (absl::string_view line : absl::StrSplit(daemon->Stdout(), '\n')) {
      if (absl::ConsumePrefix(&line, "mhcd: listening on ")) {
        address = std::string(line);
      }
    }
    ASSERT_FALSE(address.empty()) << daemon->Stdout();
    MHC_ASSERT_OK_AND_ASSIGN(auto client, client::Client::Connect(address));
    MHC_ASSERT_OK(client->CreateLayer(LayerRequest("l", kN, kC)).status());
    auto session = client::Session::Open(*client);
    client->set_session_id(std::string(32, 'a'));
    v1::PreRequest pre;
    pre.set_layer("l");
    *pre.mutable_x() = XRef("r", 0, 2);
    if (allow) {
      EXPECT_TRUE(session.ok()) << session.status();
    } else {
      EXPECT_EQ(session.status().code(), Code::kPermissionDenied);
      EXPECT_EQ(client->RegisterSystemSharedMemory("r", "mhcd_x", 0, 8).code(),
                Code::kPermissionDenied);
      EXPECT_EQ(client->Pre(pre).status().code(), Code::kPermissionDenied);
    }
  }
}

}  // namespace
}  // namespace mhc::testing
