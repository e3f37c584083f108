// The registry in process: faults on a truncated object are absorbed and
// reported, pinned mappings outlive their session, and (with a GPU) CUDA IPC
// handles open across two processes.
#include "server/shm_registry.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/shm_guard.h"

#ifdef MHC_HAVE_CUDA
#include <cuda_runtime.h>

#include "server/shm_cuda.h"
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

v1::SharedMemoryRef Ref(const std::string& region, uint64_t bytes) {
  v1::SharedMemoryRef ref;
  ref.set_region(region);
  ref.set_byte_size(bytes);
  return ref;
}

TEST(ShmRegistryTest, TruncationDuringUseIsReportedNotFatal) {
  constexpr size_t kBytes = 256 * 1024;
  ShmRegistry registry(Enabled(), nullptr);
  auto id = registry.OpenSession(nullptr);
  ASSERT_TRUE(id.ok());
  Object object(kBytes);
  ASSERT_TRUE(
      registry.RegisterSystem(*id, Register("r", object.key(), kBytes)).ok());
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

TEST(ShmRegistryTest, PinnedRegionOutlivesItsSession) {
  constexpr size_t kBytes = 4096;
  ShmRegistry registry(Enabled(), nullptr);
  auto id = registry.OpenSession(nullptr);
  ASSERT_TRUE(id.ok());
  Object object(kBytes);
  ASSERT_TRUE(
      registry.RegisterSystem(*id, Register("r", object.key(), kBytes)).ok());
  {
    RegionScope scope(&registry, *id, true);
    auto span = scope.Acquire(Ref("r", kBytes), kBytes, false, "x");
    ASSERT_TRUE(span.ok());
    EXPECT_EQ(registry.Unregister(*id, "r").status().code(),
              absl::StatusCode::kFailedPrecondition);
    registry.CloseSession(*id);
    EXPECT_EQ(ShmMappings(), 1);  // still mapped for the running request
    static_cast<char*>(span->data)[kBytes - 1] = 1;
  }
  EXPECT_EQ(ShmMappings(), 0);
  EXPECT_EQ(registry.session_count(), 0);
}

TEST(ShmRegistryTest, OutputsMayNotAliasThroughTwoRegionsOfOneObject) {
  ShmRegistry registry(Enabled(), nullptr);
  auto id = registry.OpenSession(nullptr);
  ASSERT_TRUE(id.ok());
  Object object(8192);
  ASSERT_TRUE(
      registry.RegisterSystem(*id, Register("a", object.key(), 8192)).ok());
  auto b = Register("b", object.key(), 4096);
  b.set_offset(4096);
  ASSERT_TRUE(registry.RegisterSystem(*id, b).ok());
  RegionScope scope(&registry, *id, true);
  v1::SharedMemoryRef in = Ref("a", 64);
  in.set_offset(4096 + 32);
  ASSERT_TRUE(scope.Acquire(in, 64, false, "x").ok());
  // Region b starts where a's byte 4096 is: b[0, 64) overlaps a[4128, 4192).
  EXPECT_EQ(scope.Acquire(Ref("b", 64), 64, true, "y").status().code(),
            absl::StatusCode::kInvalidArgument);
}

#ifdef MHC_HAVE_CUDA
// The child half of CudaIpcAcrossProcesses: opens the parent's handle
// through the daemon's opener, checks and rewrites the bytes.
int CudaChild(const std::string& hex_handle, size_t bytes) {
  auto opener = MakeCudaIpcOpener();
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
