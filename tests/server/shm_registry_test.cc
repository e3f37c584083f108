// The registry in process: faults on a truncated object are absorbed and
// reported, mappings in use outlive their session, page locks last exactly
// as long as their mappings, and (with a GPU) CUDA IPC handles open across
// two processes and system regions are really page-locked.
#include "server/shm/shm_registry.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "mhc/status.h"
#include "server/shm/shm_guard.h"

#ifdef MHC_HAVE_CUDA
#include <cuda_runtime.h>

#include "mhc/cuda.h"
#include "server/shm/device_memory.h"
#endif

namespace mhc::server {
namespace {

int ShmMappings() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  int count = 0;
  while (std::getline(maps, line)) {
    if (absl::StrContains(line, "/dev/shm/")) ++count;
  }
  return count;
}

class Object {
 public:
  explicit Object(size_t bytes)
      : key_(absl::StrCat("mhcd_regtest_", getpid(), "_", counter_++)) {
    fd_ = shm_open(("/" + key_).c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0);
  }
  ~Object() {
    close(fd_);
    shm_unlink(("/" + key_).c_str());
  }
  const std::string& key() const { return key_; }
  void Truncate(off_t bytes) { ASSERT_EQ(ftruncate(fd_, bytes), 0); }

 private:
  static inline int counter_ = 0;
  std::string key_;
  int fd_ = -1;
};

ShmOptions Enabled() {
  ShmOptions options;
  options.enabled = true;
  return options;
}

v1::RegisterSystemSharedMemoryRequest Register(const std::string& name,
                                               const std::string& key,
                                               uint64_t bytes) {
  v1::RegisterSystemSharedMemoryRequest r;
  r.set_name(name);
  r.set_key(key);
  r.set_byte_size(bytes);
  return r;
}

// A session of one caller, as the service opens them.
constexpr char kCaller[] = "uid:1000";
absl::StatusOr<SessionRef> OpenSession(ShmRegistry& registry) {
  MHC_ASSIGN_OR_RETURN(std::string id, registry.OpenSession(kCaller, nullptr));
  return SessionRef{id, kCaller};
}

v1::SharedMemoryRef Ref(const std::string& region, uint64_t bytes) {
  v1::SharedMemoryRef ref;
  ref.set_region(region);
  ref.set_byte_size(bytes);
  return ref;
}

TEST(ShmRegistryTest, TruncationDuringUseIsReportedNotFatal) {
  constexpr size_t kBytes = 256 * 1024;
  ShmRegistry registry(Enabled(), nullptr);
  auto id = OpenSession(registry);
  ASSERT_TRUE(id.ok());
  Object object(kBytes);
  ASSERT_TRUE(registry
                  .RegisterSystem(*id, Register("r", object.key(), kBytes),
                                  std::nullopt)
                  .ok());
  {
    RegionScope scope(&registry, *id, /*local=*/true);
    auto span = scope.Acquire(Ref("r", kBytes), kBytes, true, "out");
    ASSERT_TRUE(span.ok()) << span.status();
    ASSERT_TRUE(scope.CheckIntact().ok());
    // The owner truncates while "the kernel" writes: without the guard this
    // write raises SIGBUS and kills the process.
    object.Truncate(0);
    std::memset(span->data, 0x5a, kBytes);
    EXPECT_EQ(static_cast<unsigned char*>(span->data)[kBytes - 1], 0x5a);
    absl::Status intact = scope.CheckIntact();
    EXPECT_EQ(intact.code(), absl::StatusCode::kFailedPrecondition) << intact;
    RegionScope later(&registry, *id, true);
    EXPECT_EQ(later.Acquire(Ref("r", 8), 8, false, "x").status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_TRUE(registry.Unregister(*id, "r").ok());
  EXPECT_EQ(ShmMappings(), 0);
}

// Another caller presenting the id gets PERMISSION_DENIED from every use,
// and nothing of the session changes.
TEST(ShmRegistryTest, ASessionAnswersOnlyToTheCallerThatOpenedIt) {
  ShmRegistry registry(Enabled(), nullptr);
  auto id = OpenSession(registry);
  ASSERT_TRUE(id.ok());
  Object object(4096);
  ASSERT_TRUE(
      registry
          .RegisterSystem(*id, Register("r", object.key(), 4096), std::nullopt)
          .ok());
  for (const char* caller : {"uid:1001", "token:0", ""}) {
    SCOPED_TRACE(caller);
    const SessionRef other{id->id, caller};
    v1::SharedMemoryStatusResponse status;
    EXPECT_EQ(registry.Status(other, "", &status).code(),
              absl::StatusCode::kPermissionDenied);
    EXPECT_EQ(registry
                  .RegisterSystem(other, Register("s", object.key(), 4096),
                                  std::nullopt)
                  .status()
                  .code(),
              absl::StatusCode::kPermissionDenied);
    EXPECT_EQ(registry.Unregister(other, "r").status().code(),
              absl::StatusCode::kPermissionDenied);
    RegionScope scope(&registry, other, /*local=*/true);
    EXPECT_EQ(scope.Acquire(Ref("r", 8), 8, false, "x").status().code(),
              absl::StatusCode::kPermissionDenied);
  }
  v1::SharedMemoryStatusResponse status;
  ASSERT_TRUE(registry.Status(*id, "", &status).ok());
  EXPECT_EQ(status.regions_size(), 1);
  // An id that names no session stays NOT_FOUND, whoever asks.
  EXPECT_EQ(registry.Status({"0123", kCaller}, "", &status).code(),
            absl::StatusCode::kNotFound);
}

// A device copies into a page-locked mapping without ever faulting: the
// object's size is what shows the truncation then.
TEST(ShmRegistryTest, TruncationWithoutAFaultIsReported) {
  ShmRegistry registry(Enabled(), nullptr);
  auto id = OpenSession(registry);
  ASSERT_TRUE(id.ok());
  Object object(8192);
  ASSERT_TRUE(
      registry
          .RegisterSystem(*id, Register("r", object.key(), 8192), std::nullopt)
          .ok());
  RegionScope scope(&registry, *id, true);
  ASSERT_TRUE(scope.Acquire(Ref("r", 8192), 8192, true, "out").ok());
  ASSERT_TRUE(scope.CheckIntact().ok());
  object.Truncate(4096);
  EXPECT_EQ(scope.CheckIntact().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ShmRegistryTest, FaultsOutsideRegionsStillKill) {
  shm_guard::Install();
  EXPECT_EXIT(
      {
        // Unlinked at once: the child dies before it could clean up.
        const std::string path = absl::StrCat("/mhcd_regtest_kill_", getpid());
        int fd = shm_open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
        shm_unlink(path.c_str());
        if (fd < 0 || ftruncate(fd, 8192) != 0) std::exit(1);
        void* p =
            mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED || ftruncate(fd, 0) != 0) std::exit(1);
        static_cast<volatile char*>(p)[0] = 1;
        std::exit(0);
      },
      ::testing::KilledBySignal(SIGBUS), "");
}

TEST(ShmRegistryTest, RegionInUseOutlivesItsSession) {
  constexpr size_t kBytes = 4096;
  ShmRegistry registry(Enabled(), nullptr);
  auto id = OpenSession(registry);
  ASSERT_TRUE(id.ok());
  Object object(kBytes);
  ASSERT_TRUE(registry
                  .RegisterSystem(*id, Register("r", object.key(), kBytes),
                                  std::nullopt)
                  .ok());
  {
    RegionScope scope(&registry, *id, true);
    auto span = scope.Acquire(Ref("r", kBytes), kBytes, false, "x");
    ASSERT_TRUE(span.ok());
    EXPECT_EQ(registry.Unregister(*id, "r").status().code(),
              absl::StatusCode::kFailedPrecondition);
    registry.CloseSession(id->id);
    EXPECT_EQ(ShmMappings(), 1);  // still mapped for the running request
    static_cast<char*>(span->data)[kBytes - 1] = 1;
  }
  EXPECT_EQ(ShmMappings(), 0);
  EXPECT_EQ(registry.session_count(), 0);
}

// Records page locks instead of taking them, and checks that each is
// released exactly once while its memory is still mapped. The log outlives
// the registry, which owns the pinner.
struct PinLog {
  std::map<void*, size_t> locked;
  int pins = 0;
  int unpins = 0;
  int bad_unpins = 0;  // unknown address, or memory no longer mapped
};

class FakePinner final : public HostMemoryPinner {
 public:
  FakePinner(std::shared_ptr<PinLog> log, absl::Status result,
             std::function<void()> during_pin)
      : log_(std::move(log)),
        result_(std::move(result)),
        during_pin_(std::move(during_pin)) {}

  absl::Status Pin(void* base, size_t bytes, bool read_only) override {
    ++log_->pins;
    EXPECT_FALSE(read_only);  // the registry maps every region read-write
    EXPECT_EQ(reinterpret_cast<uintptr_t>(base) % sysconf(_SC_PAGESIZE), 0u);
    if (during_pin_) during_pin_();
    if (!result_.ok()) return result_;
    log_->locked[base] = bytes;
    return absl::OkStatus();
  }

  void Unpin(void* base) override {
    ++log_->unpins;
    unsigned char resident = 0;
    // mincore fails with ENOMEM on an address that is not mapped.
    if (log_->locked.erase(base) != 1 || mincore(base, 1, &resident) != 0) {
      ++log_->bad_unpins;
    }
  }

 private:
  std::shared_ptr<PinLog> log_;
  absl::Status result_;
  std::function<void()> during_pin_;
};

std::unique_ptr<HostMemoryPinner> Pinner(
    std::shared_ptr<PinLog> log, absl::Status result = absl::OkStatus(),
    std::function<void()> during_pin = nullptr) {
  return std::make_unique<FakePinner>(std::move(log), std::move(result),
                                      std::move(during_pin));
}

TEST(ShmRegistryTest, MappingIsPageLockedWhileRegistered) {
  auto log = std::make_shared<PinLog>();
  ShmRegistry registry(Enabled(), nullptr, Pinner(log));
  auto id = OpenSession(registry);
  ASSERT_TRUE(id.ok());
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  Object object(3 * page);
  // From mid-page: the lock covers the page-aligned mapping around it.
  auto request = Register("r", object.key(), page + 100);
  request.set_offset(page + 8);
  auto pinning = registry.RegisterSystem(*id, request, std::nullopt);
  ASSERT_TRUE(pinning.ok()) << pinning.status();
  EXPECT_EQ(*pinning, HostPinning::kPinned);
  ASSERT_EQ(log->locked.size(), 1u);
  EXPECT_EQ(log->locked.begin()->second, 8 + page + 100);
  EXPECT_EQ(registry.PinnedTotals(),
            (std::pair<int, uint64_t>{1, 8 + page + 100}));
  v1::SharedMemoryStatusResponse status;
  ASSERT_TRUE(registry.Status(*id, "", &status).ok());
  ASSERT_EQ(status.regions_size(), 1);
  EXPECT_TRUE(status.regions(0).pinned());
  {
    RegionScope scope(&registry, *id, true);
    auto span = scope.Acquire(Ref("r", 64), 64, false, "x");
    ASSERT_TRUE(span.ok()) << span.status();
    EXPECT_TRUE(span->pinned);
    const char* base = static_cast<const char*>(log->locked.begin()->first);
    EXPECT_EQ(static_cast<const char*>(span->data), base + 8);
  }
  EXPECT_EQ(log->unpins, 0);
  ASSERT_TRUE(registry.Unregister(*id, "r").ok());
  EXPECT_EQ(log->unpins, 1);
  EXPECT_EQ(log->bad_unpins, 0);
  EXPECT_TRUE(log->locked.empty());
  EXPECT_EQ(registry.PinnedTotals(), (std::pair<int, uint64_t>{0, 0}));
  EXPECT_EQ(ShmMappings(), 0);
}

TEST(ShmRegistryTest, PageLockLastsUntilTheLastRequestLeaves) {
  auto log = std::make_shared<PinLog>();
  ShmRegistry registry(Enabled(), nullptr, Pinner(log));
  auto id = OpenSession(registry);
  ASSERT_TRUE(id.ok());
  Object a(4096), b(4096);
  ASSERT_TRUE(
      registry.RegisterSystem(*id, Register("a", a.key(), 4096), std::nullopt)
          .ok());
  ASSERT_TRUE(
      registry.RegisterSystem(*id, Register("b", b.key(), 4096), std::nullopt)
          .ok());
  {
    RegionScope scope(&registry, *id, true);
    ASSERT_TRUE(scope.Acquire(Ref("a", 4096), 4096, true, "y").ok());
    registry.CloseSession(id->id);
    // b had no user: released with the session; a stays for the request.
    EXPECT_EQ(log->unpins, 1);
    EXPECT_EQ(log->locked.size(), 1u);
  }
  EXPECT_EQ(log->unpins, 2);
  EXPECT_EQ(log->bad_unpins, 0);
  EXPECT_EQ(ShmMappings(), 0);
}

TEST(ShmRegistryTest, FailedPageLockRegistersPageable) {
  auto log = std::make_shared<PinLog>();
  ShmRegistry registry(
      Enabled(), nullptr,
      Pinner(log, absl::ResourceExhaustedError("locked-memory limit")));
  auto id = OpenSession(registry);
  ASSERT_TRUE(id.ok());
  Object object(4096);
  auto pinning = registry.RegisterSystem(*id, Register("r", object.key(), 4096),
                                         std::nullopt);
  ASSERT_TRUE(pinning.ok()) << pinning.status();
  EXPECT_EQ(*pinning, HostPinning::kFailed);
  EXPECT_EQ(log->pins, 1);
  EXPECT_EQ(registry.PinnedTotals(), (std::pair<int, uint64_t>{0, 0}));
  v1::SharedMemoryStatusResponse status;
  ASSERT_TRUE(registry.Status(*id, "r", &status).ok());
  EXPECT_FALSE(status.regions(0).pinned());
  {
    RegionScope scope(&registry, *id, true);
    auto span = scope.Acquire(Ref("r", 4096), 4096, false, "x");
    ASSERT_TRUE(span.ok()) << span.status();
    EXPECT_FALSE(span->pinned);
  }
  ASSERT_TRUE(registry.Unregister(*id, "r").ok());
  EXPECT_EQ(log->unpins, 0);  // nothing was locked
}

TEST(ShmRegistryTest, RegistrationFailingAfterThePageLockReleasesIt) {
  auto log = std::make_shared<PinLog>();
  ShmRegistry* registry_ptr = nullptr;
  std::string session;
  // The session ends while the mapping is being locked: the registration
  // then fails, and everything it acquired is released.
  ShmRegistry registry(Enabled(), nullptr, Pinner(log, absl::OkStatus(), [&] {
                         registry_ptr->CloseSession(session);
                       }));
  registry_ptr = &registry;
  auto id = OpenSession(registry);
  ASSERT_TRUE(id.ok());
  session = id->id;
  Object object(4096);
  EXPECT_EQ(
      registry
          .RegisterSystem(*id, Register("r", object.key(), 4096), std::nullopt)
          .status()
          .code(),
      absl::StatusCode::kNotFound);
  EXPECT_EQ(log->pins, 1);
  EXPECT_EQ(log->unpins, 1);
  EXPECT_EQ(log->bad_unpins, 0);
  EXPECT_EQ(ShmMappings(), 0);
}

TEST(ShmRegistryTest, WithoutPinnerNothingIsLocked) {
  ShmRegistry registry(Enabled(), nullptr);
  auto id = OpenSession(registry);
  ASSERT_TRUE(id.ok());
  Object object(4096);
  auto pinning = registry.RegisterSystem(*id, Register("r", object.key(), 4096),
                                         std::nullopt);
  ASSERT_TRUE(pinning.ok());
  EXPECT_EQ(*pinning, HostPinning::kNotNeeded);
  v1::SharedMemoryStatusResponse status;
  ASSERT_TRUE(registry.Status(*id, "r", &status).ok());
  EXPECT_FALSE(status.regions(0).pinned());
}

TEST(ShmRegistryTest, OutputsMayNotAliasThroughTwoRegionsOfOneObject) {
  ShmRegistry registry(Enabled(), nullptr);
  auto id = OpenSession(registry);
  ASSERT_TRUE(id.ok());
  Object object(8192);
  ASSERT_TRUE(
      registry
          .RegisterSystem(*id, Register("a", object.key(), 8192), std::nullopt)
          .ok());
  auto b = Register("b", object.key(), 4096);
  b.set_offset(4096);
  ASSERT_TRUE(registry.RegisterSystem(*id, b, std::nullopt).ok());
  RegionScope scope(&registry, *id, true);
  v1::SharedMemoryRef in = Ref("a", 64);
  in.set_offset(4096 + 32);
  ASSERT_TRUE(scope.Acquire(in, 64, false, "x").ok());
  // Region b starts where a's byte 4096 is: b[0, 64) overlaps a[4128, 4192).
  EXPECT_EQ(scope.Acquire(Ref("b", 64), 64, true, "y").status().code(),
            absl::StatusCode::kInvalidArgument);
}

#ifdef MHC_HAVE_CUDA
bool HaveCudaDevice() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return count > 0;
}

// Whether the CUDA driver holds `p` as page-locked host memory of this
// process.
bool CudaPageLocked(const void* p) {
  unsigned int flags = 0;
  const cudaError_t error = cudaHostGetFlags(&flags, const_cast<void*>(p));
  cudaGetLastError();
  return error == cudaSuccess;
}

// The daemon's real pinner: the mapping is registered with the driver
// (portable) while the region is registered or used, and unregistered before
// it is unmapped; copies through it reach the device and come back.
TEST(ShmRegistryTest, CudaPinnerLocksMappingsForTheirLifetime) {
  if (!HaveCudaDevice()) GTEST_SKIP() << "no CUDA device";
  ShmRegistry registry(Enabled(), nullptr,
                       MakeHostMemoryPinner(MakeCudaDeviceIpc(), 0));
  auto id = OpenSession(registry);
  ASSERT_TRUE(id.ok());
  constexpr size_t kBytes = 8 << 20;
  Object object(kBytes + 4096);
  auto request = Register("r", object.key(), kBytes);
  request.set_offset(4096 + 20);  // mid-page: the whole mapping is locked
  request.set_byte_size(kBytes - 20);
  auto pinning = registry.RegisterSystem(*id, request, std::nullopt);
  ASSERT_TRUE(pinning.ok()) << pinning.status();
  ASSERT_EQ(*pinning, HostPinning::kPinned);
  void* data = nullptr;
  {
    RegionScope scope(&registry, *id, true);
    auto span = scope.Acquire(Ref("r", kBytes - 20), kBytes - 20, true, "y");
    ASSERT_TRUE(span.ok()) << span.status();
    ASSERT_TRUE(span->pinned);
    data = span->data;
    unsigned int flags = 0;
    ASSERT_EQ(cudaHostGetFlags(&flags, data), cudaSuccess);
    EXPECT_NE(flags & cudaHostRegisterPortable, 0u) << flags;
    cudaPointerAttributes attributes;
    ASSERT_EQ(cudaPointerGetAttributes(&attributes, data), cudaSuccess);
    EXPECT_EQ(attributes.type, cudaMemoryTypeHost);
    // Last byte too: the lock spans the registered range.
    EXPECT_TRUE(CudaPageLocked(static_cast<char*>(data) + kBytes - 21));
    std::memset(data, 0x5c, kBytes - 20);
    void* device = nullptr;
    ASSERT_EQ(cudaMalloc(&device, kBytes), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(device, data, kBytes - 20, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemset(device, 0x3a, 4096), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(data, device, kBytes - 20, cudaMemcpyDeviceToHost),
              cudaSuccess);
    cudaFree(device);
    EXPECT_EQ(static_cast<unsigned char*>(data)[0], 0x3a);
    EXPECT_EQ(static_cast<unsigned char*>(data)[kBytes - 21], 0x5c);
    registry.CloseSession(id->id);
    EXPECT_TRUE(CudaPageLocked(data));  // still in use by this "request"
  }
  EXPECT_FALSE(CudaPageLocked(data));
  EXPECT_EQ(ShmMappings(), 0);
}

// The child half of CudaIpcAcrossProcesses: opens the parent's handle
// through the daemon's opener, checks and rewrites the bytes.
int CudaChild(const std::string& hex_handle, size_t bytes) {
  auto opener = MakeDeviceMemoryOpener(MakeCudaDeviceIpc());
  const std::string handle = absl::HexStringToBytes(hex_handle);
  if (opener->Open(handle, 0, bytes + (size_t{1} << 30)).ok()) return 3;
  auto whole = opener->Open(handle, 0, 0);  // the whole allocation, shared
  if (!whole.ok() || whole->byte_size < bytes) return 8;
  auto opened = opener->Open(handle, 0, bytes);
  if (!opened.ok() || opened->ptr != whole->ptr) return 4;
  void* const ptr = opened->ptr;
  std::string host(bytes, '\0');
  if (cudaMemcpy(host.data(), ptr, bytes, cudaMemcpyDeviceToHost) !=
      cudaSuccess) {
    return 5;
  }
  if (host != std::string(bytes, '\x11')) return 6;
  if (cudaMemset(ptr, 0x22, bytes) != cudaSuccess) return 7;
  cudaDeviceSynchronize();
  opener->Close(0, ptr);
  opener->Close(0, ptr);
  return 0;
}

TEST(ShmRegistryTest, CudaIpcAcrossProcesses) {
  if (const char* child = std::getenv("MHC_IPC_CHILD_HANDLE")) {
    std::exit(CudaChild(child, 1 << 20));
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    GTEST_SKIP() << "no CUDA device";
  }
  constexpr size_t kBytes = 1 << 20;
  void* memory = nullptr;
  ASSERT_EQ(cudaMalloc(&memory, kBytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(memory, 0x11, kBytes), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaIpcMemHandle_t handle;
  ASSERT_EQ(cudaIpcGetMemHandle(&handle, memory), cudaSuccess);
  const std::string hex = absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(&handle), 64));
  pid_t pid = fork();
  if (pid == 0) {
    setenv("MHC_IPC_CHILD_HANDLE", hex.c_str(), 1);
    execl("/proc/self/exe", "shm_registry_test",
          "--gtest_filter=ShmRegistryTest.CudaIpcAcrossProcesses",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0);
  std::string host(kBytes, '\0');
  ASSERT_EQ(cudaMemcpy(host.data(), memory, kBytes, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(host, std::string(kBytes, '\x22'));
  cudaFree(memory);
}
#endif

}  // namespace
}  // namespace mhc::server
