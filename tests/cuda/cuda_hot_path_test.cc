// The CUDA backend's launch path allocates nothing: once an op has run at a
// shape (its plan, kernel attributes and occupancy answers cached), a second
// call of it, timed as the daemon times it, makes no heap allocation on the
// calling thread. This binary replaces the global operator new to count
// them; on a failure it prints the stack of the first one. The optimizer
// step, which the daemon runs after training steps, is held to the same.
#include <execinfo.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/gpu_cases.h"
#include "common/test_util.h"
#include "cuda/cuda_harness.h"
#include "gtest/gtest.h"
#include "mhc/backend.h"
#include "mhc/cuda.h"
#include "mhc/cuda_tools.h"
#include "mhc/dtype.h"
#include "mhc/ops/optimizer.h"
#include "mhc/types.h"

namespace {

// Counted only inside a window opened on this thread, so that gtest's,
// the runtime's and other threads' allocations stay out.
thread_local bool counting = false;
thread_local int64_t allocations = 0;
thread_local bool stack_printed = false;

// align: 0 for the default alignment.
void* CountedAllocation(std::size_t bytes, std::size_t align) {
  if (counting) {
    ++allocations;
    if (!stack_printed) {
      stack_printed = true;
      counting = false;  // backtrace itself may allocate
      void* frames[32];
      const int depth = backtrace(frames, 32);
      std::fprintf(stderr, "first allocation in the window (%zu bytes):\n",
                   bytes);
      backtrace_symbols_fd(frames, depth, STDERR_FILENO);
      counting = true;
    }
  }
  if (bytes == 0) bytes = 1;
  void* p = align == 0 ? std::malloc(bytes)
                       : std::aligned_alloc(
                             align, (bytes + align - 1) / align * align);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

}  // namespace

void* operator new(std::size_t bytes) { return CountedAllocation(bytes, 0); }
void* operator new[](std::size_t bytes) { return CountedAllocation(bytes, 0); }
void* operator new(std::size_t bytes, std::align_val_t align) {
  return CountedAllocation(bytes, static_cast<std::size_t>(align));
}
void* operator new[](std::size_t bytes, std::align_val_t align) {
  return CountedAllocation(bytes, static_cast<std::size_t>(align));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}

namespace mhc::testing {
namespace {

using bench::Tensors;

struct HotPathCase {
  int n;
  int64_t hidden;
  int64_t tokens;
  DType dtype;
  Layout layout;
  MatmulPrecision precision;
};

std::string Describe(const HotPathCase& c) {
  return absl::StrCat("n=", c.n, " C=", c.hidden, " M=", c.tokens, " ",
                      DTypeName(c.dtype), " ", LayoutName(c.layout),
                      c.precision == MatmulPrecision::kIeee ? " ieee" : "");
}

// Every tensor of the benchmark's cases on the device, inputs random.
class DeviceTensors {
 public:
  DeviceTensors(Backend& cuda, const LayerSpec& spec, const LayerSpec& head,
                int64_t tokens, DType dtype)
      : cuda_(cuda) {
    t_.act = dtype;
    for (int t = 0; t < bench::kNumTensors; ++t) {
      const int64_t count =
          bench::Elements(t, spec) * (bench::PerToken(t) ? tokens : 1);
      const size_t bytes = count * bench::ElemSize(t, dtype);
      t_.p[t] = Allocate(bytes);
      if (bench::IsGrad(t)) {
        EXPECT_TRUE(cuda_.Memset(t_.p[t], 0, bytes).ok());
        continue;
      }
      const auto [lo, hi] = bench::Range(t);
      if (bench::IsAct(t)) {
        const ActTensor a = RandomAct(dtype, count, 7000 + t, lo, hi);
        EXPECT_TRUE(cuda_.CopyToDevice(t_.p[t], a.data(), bytes).ok());
      } else {
        const std::vector<float> v = RandomFloats(count, 7000 + t, lo, hi);
        EXPECT_TRUE(cuda_.CopyToDevice(t_.p[t], v.data(), bytes).ok());
      }
    }
    const size_t ws = bench::WorkspaceFor(cuda_, spec, head, tokens, dtype);
    t_.ws = Workspace{Allocate(ws), ws};
  }
  ~DeviceTensors() {
    for (void* p : owned_) cuda_.Free(p);
  }
  const Tensors& tensors() const { return t_; }

  // Device memory freed with the tensors.
  void* Allocate(size_t bytes) {
    absl::StatusOr<void*> p = cuda_.Allocate(std::max<size_t>(bytes, 16));
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return nullptr;
    owned_.push_back(*p);
    return *p;
  }

 private:
  Backend& cuda_;
  Tensors t_;
  std::vector<void*> owned_;
};

class CudaHotPathTest : public ::testing::TestWithParam<HotPathCase> {};

TEST_P(CudaHotPathTest, SecondCallOfEveryOpAllocatesNothing) {
  MHC_SKIP_WITHOUT_GPU();
  const HotPathCase& c = GetParam();
  absl::StatusOr<std::unique_ptr<Backend>> made = MakeCudaBackend(0);
  ASSERT_TRUE(made.ok()) << made.status();
  Backend& cuda = **made;
  absl::StatusOr<LayerSpec> preset = PresetSpec("deepseek_v4", c.n, c.hidden);
  ASSERT_TRUE(preset.ok()) << preset.status();
  LayerSpec spec = *preset;
  spec.layout = c.layout;
  spec.matmul_precision = c.precision;
  LayerSpec head = spec;
  head.kind = LayerKind::kHead;
  DeviceTensors device(cuda, spec, head, c.tokens, c.dtype);
  const Tensors& t = device.tensors();
  std::unique_ptr<DeviceTimer> timer = cuda.MakeDeviceTimer();
  ASSERT_NE(timer, nullptr);

  for (int op = 0; op < bench::kNumCases; ++op) {
    const std::string name = absl::StrCat(
        bench::Info(op).op, " ", bench::Info(op).direction, " ", Describe(c));
    const bool keep = op == bench::kLayerFwdBwd;
    // The first call, timed too (the timer's first pair of events).
    timer->Start();
    ASSERT_TRUE(bench::RunCase(op, cuda, spec, head, t, c.tokens, keep).ok())
        << name;
    ASSERT_TRUE(timer->Stop().ok()) << name;
    ASSERT_TRUE(cuda.Synchronize().ok()) << name;
    ASSERT_TRUE(timer->Poll().ok()) << name;

    allocations = 0;
    stack_printed = false;
    counting = true;
    timer->Start();
    const absl::Status run =
        bench::RunCase(op, cuda, spec, head, t, c.tokens, keep);
    const absl::Status stop = timer->Stop();
    counting = false;
    EXPECT_TRUE(run.ok()) << name << ": " << run;
    EXPECT_TRUE(stop.ok()) << name << ": " << stop;
    EXPECT_EQ(allocations, 0) << name;
    ASSERT_TRUE(cuda.Synchronize().ok()) << name;

    allocations = 0;
    counting = true;
    const absl::StatusOr<std::optional<double>> seconds = timer->Poll();
    counting = false;
    EXPECT_TRUE(seconds.ok() && seconds->has_value()) << name;
    EXPECT_EQ(allocations, 0) << name << " (timer poll)";
  }
}

// The optimizer step over a layer's parameters, as the daemon runs it after
// a training step: AdamW with clipping and the norm reported, grads zeroed.
TEST(CudaHotPathOptimizerTest, SecondStepAllocatesNothing) {
  MHC_SKIP_WITHOUT_GPU();
  absl::StatusOr<std::unique_ptr<Backend>> made = MakeCudaBackend(0);
  ASSERT_TRUE(made.ok()) << made.status();
  Backend& cuda = **made;
  absl::StatusOr<LayerSpec> spec = PresetSpec("deepseek_v4", 4, 4096);
  ASSERT_TRUE(spec.ok()) << spec.status();
  LayerSpec head = *spec;
  head.kind = LayerKind::kHead;
  DeviceTensors device(cuda, *spec, head, /*tokens=*/1, DType::kBF16);
  const Tensors& t = device.tensors();
  OptimizerStepParams p;
  p.hyper.algorithm = OptimizerAlgorithm::kAdamW;
  p.hyper.learning_rate = 1e-3f;
  p.hyper.weight_decay = 0.01f;
  p.hyper.max_grad_norm = 1.0f;
  p.zero_grads = true;
  const int slots = OptimizerSlotCount(p.hyper.algorithm);
  std::vector<OptimizerTensor> tensors;
  for (int param : {bench::kPhi, bench::kAlpha, bench::kBeta}) {
    OptimizerTensor o;
    o.values = t.f(param);
    o.grads = t.f(param - bench::kPhi + bench::kGPhi);
    o.count = bench::Elements(param, *spec);
    const size_t slot_bytes = sizeof(float) * slots * o.count;
    o.slots = static_cast<float*>(device.Allocate(slot_bytes));
    ASSERT_TRUE(cuda.Memset(o.slots, 0, slot_bytes).ok());
    tensors.push_back(o);
  }
  p.grad_norm = static_cast<double*>(device.Allocate(sizeof(double)));
  p.tensors = tensors.data();
  p.num_tensors = static_cast<int64_t>(tensors.size());
  const size_t ws_bytes = cuda.OptimizerWorkspaceBytes(p);
  const Workspace ws{device.Allocate(ws_bytes), ws_bytes};

  for (int64_t step = 1; step <= 2; ++step) {
    for (OptimizerTensor& o : tensors) o.step = step;
    // The first step may allocate; the second is counted.
    allocations = 0;
    stack_printed = false;
    counting = step == 2;
    const absl::Status st = cuda.OptimizerStep(p, ws);
    counting = false;
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_EQ(allocations, 0) << "step " << step;
    ASSERT_TRUE(cuda.Synchronize().ok());
  }
}

// The timer's pending measurements come back in stop order while its ring
// wraps and grows: spins of known lengths, some read between the stops.
TEST(CudaEventTimerTest, ReturnsEveryMeasurementInStopOrder) {
  MHC_SKIP_WITHOUT_GPU();
  absl::StatusOr<std::unique_ptr<Backend>> made = MakeCudaBackend(0);
  ASSERT_TRUE(made.ok()) << made.status();
  Backend& cuda = **made;
  std::unique_ptr<DeviceTimer> timer = cuda.MakeDeviceTimer();
  ASSERT_NE(timer, nullptr);
  // The spin kernel's first launch loads its module: not between events.
  ASSERT_TRUE(EnqueueCudaSpin(cuda, 1.0).ok());
  ASSERT_TRUE(cuda.Synchronize().ok());
  std::vector<double> spins, measured;
  auto read_one = [&] {
    absl::StatusOr<std::optional<double>> seconds = timer->Poll();
    while (seconds.ok() && !seconds->has_value()) seconds = timer->Poll();
    ASSERT_TRUE(seconds.ok()) << seconds.status();
    measured.push_back(**seconds * 1e6);
  };
  // 5 in flight, 3 read (the ring's head moves), then 25 more (it wraps
  // and grows twice), then every one read.
  for (int i = 0; i < 30; ++i) {
    const double us = i % 2 == 0 ? 40.0 : 400.0;
    timer->Start();
    ASSERT_TRUE(EnqueueCudaSpin(cuda, us).ok());
    ASSERT_TRUE(timer->Stop().ok());
    spins.push_back(us);
    if (i == 4) {
      for (int r = 0; r < 3; ++r) read_one();
    }
  }
  while (measured.size() < spins.size()) read_one();
  const absl::StatusOr<std::optional<double>> none = timer->Poll();
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value()) << "a measurement past the last stop";
  for (size_t i = 0; i < spins.size(); ++i) {
    // A short spin's time cannot pass half of a long one's: the order shows.
    EXPECT_GE(measured[i], spins[i]) << "measurement " << i;
    EXPECT_LT(measured[i], spins[i] == 40.0 ? 200.0 : 4000.0)
        << "measurement " << i;
  }
}

// The launch paths apart: small and large batches (different plans and
// kernels), 16-bit and fp32 activations, odd channel counts, stream-minor
// rows, wide layers and IEEE products.
INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaHotPathTest,
    ::testing::Values(HotPathCase{4, 1024, 512, DType::kBF16,
                                  Layout::kStreamMajor, MatmulPrecision::kTf32},
                      HotPathCase{4, 4096, 4096, DType::kBF16,
                                  Layout::kStreamMajor, MatmulPrecision::kTf32},
                      HotPathCase{4, 1030, 1100, DType::kF16,
                                  Layout::kStreamMinor, MatmulPrecision::kTf32},
                      HotPathCase{16, 1024, 2048, DType::kBF16,
                                  Layout::kStreamMajor, MatmulPrecision::kTf32},
                      HotPathCase{8, 2048, 2100, DType::kF32,
                                  Layout::kStreamMajor, MatmulPrecision::kTf32},
                      HotPathCase{4, 2048, 700, DType::kBF16,
                                  Layout::kStreamMajor,
                                  MatmulPrecision::kIeee}));

}  // namespace
}  // namespace mhc::testing
