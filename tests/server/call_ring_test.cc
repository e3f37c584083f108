// The call ring end to end: a real mhcd, compute calls of a session through
// shared memory instead of gRPC. Ring answers equal the RPC's, anything that
// is not a ring or not a valid request is refused without stopping the
// ring, and the ring ends cleanly with its session, with a killed client
// and with a killed daemon.
#include "mhc/client/call_ring.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "mhc/call_ring.h"
#include "mhc/client/shm.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

namespace ring = ::mhc::call_ring;
using client::CallRing;
using client::SharedMemoryObject;
using Code = absl::StatusCode;

constexpr int kN = 4;
constexpr int64_t kC = 64;
constexpr int64_t kM = 3;
constexpr uint64_t kXBytes = kM * kN * kC * sizeof(float);

class CallRingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MHC_ASSERT_OK_AND_ASSIGN(daemon_, Daemon::Start({"--allow_shm"}));
    MHC_ASSERT_OK_AND_ASSIGN(client_, daemon_->Connect());
    ASSERT_TRUE(CreateRandomLayer(*client_, LayerRequest("l", kN, kC)).ok());
    MHC_ASSERT_OK_AND_ASSIGN(session_, client::Session::Open(*client_));
    MHC_ASSERT_OK_AND_ASSIGN(
        x_, SharedMemoryObject::Create(
                client::UniqueShmKey("mhcd_test_", "ring_x"), kXBytes));
    const client::HostTensor x = RandomF32({kM, kN, kC});
    std::memcpy(x_->data(), x.bytes.data(), kXBytes);
    MHC_ASSERT_OK(
        client_->RegisterSystemSharedMemory("x", x_->key(), 0, kXBytes));
    pre_.set_layer("l");
    *pre_.mutable_x() = client::ShmTensorRef(DType::kF32, {kM, kN, kC}, "x", 0);
  }

  // A ring object laid out by hand: `magic` and `area_bytes` as given.
  std::unique_ptr<SharedMemoryObject> RawRing(uint32_t magic,
                                              uint64_t area_bytes,
                                              const std::string& region) {
    auto object = SharedMemoryObject::Create(
        client::UniqueShmKey("mhcd_test_", "raw_ring"),
        ring::RegionBytes(area_bytes));
    EXPECT_TRUE(object.ok()) << object.status();
    if (!object.ok()) return nullptr;
    auto* header = reinterpret_cast<ring::RingHeader*>((*object)->data());
    header->magic = magic;
    header->version = ring::kVersion;
    header->area_bytes = area_bytes;
    EXPECT_TRUE(client_
                    ->RegisterSystemSharedMemory(region, (*object)->key(), 0,
                                                 (*object)->size())
                    .ok());
    return std::move(*object);
  }

  // The first sample of metric `name` whose labels contain all `parts`.
  double Metric(const std::string& name,
                const std::vector<std::string>& parts = {}) {
    auto text =
        HttpGet(daemon_->metrics_host(), daemon_->metrics_port(), "/metrics");
    EXPECT_TRUE(text.ok()) << text.status();
    return text.ok()
               ? MetricSample(*text, name + (parts.empty() ? " " : "{"), parts)
               : -1;
  }

  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<client::Session> session_;
  std::unique_ptr<SharedMemoryObject> x_;
  v1::PreRequest pre_;
};

TEST_F(CallRingTest, RingAnswersEqualTheRpcs) {
  MHC_ASSERT_OK_AND_ASSIGN(v1::PreResponse by_rpc, client_->Pre(pre_));
  MHC_ASSERT_OK_AND_ASSIGN(std::shared_ptr<CallRing> opened,
                           CallRing::Open(*client_));
  client_->set_call_ring(opened);
  EXPECT_EQ(Metric("mhcd_call_rings"), 1);
  for (int call = 0; call < 3; ++call) {
    MHC_ASSERT_OK_AND_ASSIGN(v1::PreResponse by_ring, client_->Pre(pre_));
    EXPECT_EQ(by_ring.SerializeAsString(), by_rpc.SerializeAsString());
  }
  // Errors come back with their code and message, and the ring serves on.
  v1::PreRequest missing = pre_;
  missing.set_layer("nope");
  auto error = client_->Pre(missing);
  EXPECT_EQ(error.status().code(), Code::kNotFound) << error.status();
  EXPECT_TRUE(absl::StrContains(error.status().message(), "nope"));
  MHC_ASSERT_OK(client_->Pre(pre_).status());
  EXPECT_EQ(opened->calls(), 5u);
  // Calls keep their RPC's name in the request metrics.
  EXPECT_GE(Metric("mhcd_requests_total", {"rpc=\"Pre\"", "code=\"OK\""}), 5);
  // Its region cannot go while the ring uses it.
  EXPECT_EQ(client_->UnregisterSharedMemory("call_ring").status().code(),
            Code::kFailedPrecondition);
}

TEST_F(CallRingTest, OpenRefusesWhatIsNotARing) {
  EXPECT_EQ(client_->OpenCallRing("absent").code(), Code::kNotFound);
  auto bad_magic = RawRing(0x1234, ring::kMinAreaBytes, "bad_magic");
  EXPECT_EQ(client_->OpenCallRing("bad_magic").code(), Code::kInvalidArgument);
  auto small = RawRing(ring::kMagic, ring::kMinAreaBytes / 2, "small");
  EXPECT_EQ(client_->OpenCallRing("small").code(), Code::kInvalidArgument);
  auto huge_area = RawRing(ring::kMagic, ring::kMinAreaBytes, "huge_area");
  reinterpret_cast<ring::RingHeader*>(huge_area->data())->area_bytes =
      uint64_t{1} << 40;
  EXPECT_EQ(client_->OpenCallRing("huge_area").code(), Code::kInvalidArgument);
  // A ring without a session.
  const std::string id = session_->id();
  client_->set_session_id("");
  EXPECT_EQ(client_->OpenCallRing("x").code(), Code::kFailedPrecondition);
  client_->set_session_id(id);
  // One ring per session.
  MHC_ASSERT_OK(CallRing::Open(*client_).status());
  auto second = RawRing(ring::kMagic, ring::kMinAreaBytes, "second");
  EXPECT_EQ(client_->OpenCallRing("second").code(), Code::kAlreadyExists);
  // What was refused holds nothing: its regions go.
  for (const char* name : {"bad_magic", "small", "huge_area", "second"}) {
    EXPECT_TRUE(client_->UnregisterSharedMemory(name).ok()) << name;
  }
}

// Requests written by hand: each bad one gets its error, and the ring
// answers the next good one.
TEST_F(CallRingTest, MalformedRequestsAreAnsweredAndTheRingServesOn) {
  auto object = RawRing(ring::kMagic, ring::kMinAreaBytes, "raw");
  MHC_ASSERT_OK(client_->OpenCallRing("raw"));
  void* base = object->data();
  uint32_t seq = 0;
  auto submit = [&](const ring::RingRequest& header,
                    const std::string& payload) {
    char* area = ring::RequestArea(base);
    std::memcpy(area, &header, sizeof(header));
    std::memcpy(
        area + sizeof(header), payload.data(),
        std::min<size_t>(payload.size(), ring::kMinAreaBytes - sizeof(header)));
    ring::Store(ring::RequestSeq(base), ++seq);
    ring::FutexWake(ring::RequestSeq(base));
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (ring::Load(ring::ResponseSeq(base)) != seq &&
           absl::Now() < deadline) {
      ring::FutexWait(ring::ResponseSeq(base), seq - 1, 10'000'000);
    }
    EXPECT_EQ(ring::Load(ring::ResponseSeq(base)), seq);
    ring::RingResponse answer;
    std::memcpy(&answer, ring::ResponseArea(base, ring::kMinAreaBytes),
                sizeof(answer));
    return static_cast<Code>(answer.code);
  };
  auto request = [](const char* method, uint32_t payload_bytes) {
    ring::RingRequest header{};
    std::strncpy(header.method, method, sizeof(header.method));
    header.wait_event = -1;
    header.signal_event = -1;
    header.payload_bytes = payload_bytes;
    return header;
  };
  const std::string good = pre_.SerializeAsString();
  EXPECT_EQ(submit(request("GetLayer", 0), ""), Code::kInvalidArgument);
  EXPECT_EQ(submit(request("NoSuchRpc", 0), ""), Code::kInvalidArgument);
  ring::RingRequest unterminated = request("Pre", 0);
  std::memset(unterminated.method, 'P', sizeof(unterminated.method));
  EXPECT_EQ(submit(unterminated, ""), Code::kInvalidArgument);
  EXPECT_EQ(submit(request("Pre", ring::kMinAreaBytes), good),
            Code::kInvalidArgument);
  EXPECT_EQ(submit(request("Pre", 7), "\xff\xff\xff\xff\xff\xff\xff"),
            Code::kInvalidArgument);
  ring::RingRequest bad_event = request("Pre", good.size());
  bad_event.wait_event = 1 << 20;
  EXPECT_NE(submit(bad_event, good), Code::kOk);
  EXPECT_EQ(submit(request("Pre", good.size()), good), Code::kOk);
  EXPECT_EQ(Metric("mhcd_call_rings"), 1);
}

TEST_F(CallRingTest, SessionEndClosesTheRing) {
  MHC_ASSERT_OK_AND_ASSIGN(std::shared_ptr<CallRing> opened,
                           CallRing::Open(*client_));
  client_->set_call_ring(opened);
  MHC_ASSERT_OK(client_->Pre(pre_).status());
  MHC_ASSERT_OK(session_->Close());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (opened->usable() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_FALSE(opened->usable());
  // Later calls go over gRPC, where the ended session is refused.
  EXPECT_FALSE(client_->Pre(pre_).ok());
  EXPECT_EQ(opened->calls(), 1u);
  EXPECT_EQ(Metric("mhcd_call_rings"), 0);
}

// A client killed in the middle of its calls: the daemon serves on and lets
// go of the ring's and the session's memory.
TEST_F(CallRingTest, KilledClientLeavesNothingBehind) {
  int out[2];
  ASSERT_EQ(pipe2(out, O_CLOEXEC), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], STDOUT_FILENO);
    execl(MHC_SHM_PEER_PATH, MHC_SHM_PEER_PATH, "ring",
          daemon_->address().c_str(), "l", std::to_string(kN).c_str(),
          std::to_string(kC).c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out[1]);
  std::string line;
  char c;
  while (read(out[0], &c, 1) == 1 && c != '\n') line.push_back(c);
  close(out[0]);
  const std::vector<std::string> words = absl::StrSplit(line, ' ');
  ASSERT_EQ(words.size(), 4u) << line;
  ASSERT_EQ(words[0], "ringing") << line;
  EXPECT_EQ(Metric("mhcd_call_rings"), 1);
  absl::SleepFor(absl::Milliseconds(50));  // mid-call, most likely
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  // The killed client's own objects, which only it would have unlinked.
  for (int i = 2; i < 4; ++i) {
    EXPECT_EQ(shm_unlink(absl::StrCat("/", words[i]).c_str()), 0) << words[i];
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (Metric("mhcd_call_rings") != 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(Metric("mhcd_call_rings"), 0);
  MHC_ASSERT_OK_AND_ASSIGN(std::string health, client_->Health());
  EXPECT_EQ(health, "SERVING");
  // Only this test's own session holds memory in the daemon now.
  EXPECT_EQ(Metric("mhcd_shm_regions", {"kind=\"system\""}), 1);
  MHC_ASSERT_OK(client_->Pre(pre_).status());
}

// Deferred calls: each returns before its answer; the done word reaches a
// call's number once its work is done (from the host here: the CPU backend
// finishes work before it answers), a failure is reported by the next call
// instead of running it, and a failed call releases the done word too.
TEST_F(CallRingTest, DeferredCallsReportFailuresOnTheNextCall) {
  MHC_ASSERT_OK_AND_ASSIGN(std::shared_ptr<CallRing> opened,
                           CallRing::Open(*client_));
  const absl::Duration timeout = absl::Seconds(10);
  auto no_event = [] { return absl::OkStatus(); };
  auto await_done = [&](uint32_t seq) {
    const absl::Time deadline = absl::Now() + timeout;
    while (!ring::Reached(ring::Load(opened->done_word()), seq) &&
           absl::Now() < deadline) {
      absl::SleepFor(absl::Microseconds(50));
    }
    return ring::Reached(ring::Load(opened->done_word()), seq);
  };
  uint32_t seq = 0;
  bool sent = false;
  int before_send_runs = 0;
  MHC_ASSERT_OK(opened->Post(
      "Pre", pre_, {},
      [&] {
        ++before_send_runs;
        return absl::OkStatus();
      },
      timeout, &seq, &sent));
  EXPECT_TRUE(sent);
  EXPECT_EQ(before_send_runs, 1);
  EXPECT_TRUE(await_done(seq));

  v1::PreRequest missing = pre_;
  missing.set_layer("nope");
  uint32_t failed_seq = 0;
  MHC_ASSERT_OK(
      opened->Post("Pre", missing, {}, no_event, timeout, &failed_seq, &sent));
  EXPECT_EQ(failed_seq, seq + 1);
  // The stream of a failed call is released all the same.
  EXPECT_TRUE(await_done(failed_seq));
  // The next call reports it, naming it, and does not run.
  absl::Status next =
      opened->Post("Pre", pre_, {}, no_event, timeout, &seq, &sent);
  EXPECT_EQ(next.code(), Code::kNotFound) << next;
  EXPECT_TRUE(absl::StrContains(next.message(), "earlier deferred call (Pre)"))
      << next;
  EXPECT_TRUE(absl::StrContains(next.message(), "nope")) << next;
  EXPECT_FALSE(sent);
  // Reported once: the ring serves on, and a plain call after a deferred
  // one collects its answer first.
  MHC_ASSERT_OK(opened->Post("Pre", pre_, {}, no_event, timeout, &seq, &sent));
  v1::PreResponse answer;
  MHC_ASSERT_OK(opened->Call("Pre", pre_, answer, {}, timeout, &sent));
  MHC_ASSERT_OK(opened->Flush(timeout));
  EXPECT_EQ(opened->calls(), 4u);
  // The done word stands in for a signal event.
  EXPECT_EQ(
      opened->Post("Pre", pre_, {-1, 0}, no_event, timeout, &seq, &sent).code(),
      Code::kInvalidArgument);
}

// The daemon dies: a ring call fails at once instead of waiting for its
// deadline.
TEST_F(CallRingTest, ClientSeesTheDaemonGone) {
  MHC_ASSERT_OK_AND_ASSIGN(std::shared_ptr<CallRing> opened,
                           CallRing::Open(*client_));
  client_->set_call_ring(opened);
  MHC_ASSERT_OK(client_->Pre(pre_).status());
  daemon_->Signal(SIGKILL);
  MHC_ASSERT_OK(daemon_->Wait(absl::Seconds(10)).status());
  const absl::Time start = absl::Now();
  auto answer = client_->Pre(pre_);
  EXPECT_EQ(answer.status().code(), Code::kUnavailable) << answer.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_FALSE(opened->usable());
}

}  // namespace
}  // namespace mhc::testing
