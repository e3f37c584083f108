// Runs one op on the CUDA backend and on the float64 reference with the same
// inputs and compares the outputs. Every output buffer starts poisoned (all
// bytes 0xFF, a NaN in every dtype) so an element the kernel forgot to write
// fails the comparison.
#ifndef MHC_TESTS_CUDA_CUDA_HARNESS_H_
#define MHC_TESTS_CUDA_CUDA_HARNESS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/test_util.h"
#include "gtest/gtest.h"
#include "mhc/backend.h"
#include "mhc/cuda.h"
#include "mhc/dtype.h"
#include "mhc/types.h"

namespace mhc::testing {

#define MHC_SKIP_WITHOUT_GPU()                                  \
  do {                                                          \
    if (::mhc::CudaDeviceCount() == 0) {                        \
      GTEST_SKIP() << "no CUDA device: CUDA tests are skipped"; \
    }                                                           \
  } while (0)

// One tensor in both address spaces: index 0 is the reference's host copy,
// index 1 the CUDA device copy.
struct Pair {
  std::vector<uint8_t> host;
  void* dev = nullptr;
  size_t bytes = 0;

  void* ptr(int b) { return b == 0 ? static_cast<void*>(host.data()) : dev; }
  float* f(int b) { return static_cast<float*>(ptr(b)); }
};

class Harness {
 public:
  Harness() {
    auto cuda = MakeCudaBackend(0);
    EXPECT_TRUE(cuda.ok()) << cuda.status();
    if (cuda.ok()) cuda_ = std::move(cuda).value();
    ref_ = MakeReferenceBackend();
  }
  ~Harness() {
    for (void* p : allocations_) cuda_->Free(p);
  }

  Backend& backend(int b) { return b == 0 ? *ref_ : *cuda_; }
  Backend& cuda() { return *cuda_; }

  Pair Input(const void* data, size_t bytes) {
    Pair p;
    p.bytes = bytes;
    p.host.assign(static_cast<const uint8_t*>(data),
                  static_cast<const uint8_t*>(data) + bytes);
    p.host.resize(std::max<size_t>(bytes, 1));
    p.dev = DeviceAlloc(bytes);
    if (bytes > 0) {
      EXPECT_TRUE(cuda_->CopyToDevice(p.dev, data, bytes).ok());
    }
    return p;
  }
  Pair Act(DType dtype, int64_t count, uint64_t seed, float lo = -1.0f,
           float hi = 1.0f) {
    ActTensor t = RandomAct(dtype, count, seed, lo, hi);
    return Input(t.data(), t.bytes.size());
  }
  Pair Floats(int64_t count, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
    std::vector<float> v = RandomFloats(count, seed, lo, hi);
    return Input(v.data(), v.size() * sizeof(float));
  }
  // A poisoned output.
  Pair Output(size_t bytes) {
    Pair p;
    p.bytes = bytes;
    p.host.assign(std::max<size_t>(bytes, 1), 0xFF);
    p.dev = DeviceAlloc(bytes);
    if (bytes > 0) {
      EXPECT_TRUE(cuda_->Memset(p.dev, 0xFF, bytes).ok());
    }
    return p;
  }
  Workspace Scratch(int b, OpKind op, const LayerSpec& spec, int64_t tokens,
                    DType dtype) {
    const size_t bytes = backend(b).WorkspaceBytes(op, spec, tokens, dtype);
    if (b == 0) {
      host_scratch_.emplace_back(std::max<size_t>(bytes, 1));
      return Workspace{host_scratch_.back().data(), bytes};
    }
    return Workspace{DeviceAlloc(bytes), bytes};
  }

  std::vector<uint8_t> Fetch(const Pair& p) {
    std::vector<uint8_t> out(p.bytes);
    if (p.bytes > 0) {
      EXPECT_TRUE(cuda_->CopyToHost(out.data(), p.dev, p.bytes).ok());
    }
    return out;
  }

 private:
  void* DeviceAlloc(size_t bytes) {
    auto p = cuda_->Allocate(bytes);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok() || *p == nullptr) return nullptr;
    allocations_.push_back(*p);
    return *p;
  }

  std::unique_ptr<Backend> cuda_;
  std::unique_ptr<Backend> ref_;
  std::vector<void*> allocations_;
  std::vector<std::vector<uint8_t>> host_scratch_;
};

inline float ElementAt(const std::vector<uint8_t>& bytes, DType dtype,
                       int64_t i) {
  return LoadActivation(bytes.data(), dtype, i);
}

// How far `got` is from `want`: the norm-wise relative error, max |a - b|
// over max |b| or over `floor` when that is larger (a NaN or infinity where
// the reference is finite, an unwritten or broken element, counts as
// infinite, as does a number where it is NaN), the element that decides it
// and the scale it is measured against.
struct Deviation {
  double error = 0.0;
  int64_t worst = -1;
  double scale = 0.0;
};
inline Deviation DeviationOf(const std::vector<uint8_t>& got,
                             const std::vector<uint8_t>& want, DType dtype,
                             int64_t count, double floor = 0.0) {
  Deviation d;
  double max_diff = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    const double a = ElementAt(got, dtype, i);
    const double b = ElementAt(want, dtype, i);
    if (std::isnan(b) ? !std::isnan(a) : !std::isfinite(a)) {
      d.error = INFINITY;
      d.worst = i;
      break;
    }
    if (std::isnan(b)) continue;
    if (d.worst < 0 || std::fabs(a - b) > max_diff) {
      max_diff = std::fabs(a - b);
      d.worst = i;
    }
    d.scale = std::max(d.scale, std::fabs(b));
  }
  d.scale = std::max({d.scale, floor, 1e-30});
  if (d.error == 0.0) d.error = max_diff / d.scale;
  return d;
}
inline double RelativeError(const std::vector<uint8_t>& got,
                            const std::vector<uint8_t>& want, DType dtype,
                            int64_t count, double floor = 0.0) {
  return DeviationOf(got, want, dtype, count, floor).error;
}

// Expects `got` within `tol` of `want` (DeviationOf), naming the element
// that decides it in the failure message.
inline void ExpectDeviationAtMost(const std::vector<uint8_t>& got,
                                  const std::vector<uint8_t>& want, DType dtype,
                                  int64_t count, double floor, double tol,
                                  const std::string& what) {
  const Deviation d = DeviationOf(got, want, dtype, count, floor);
  const bool any = d.worst >= 0;
  EXPECT_LE(d.error, tol) << what << " (worst [" << d.worst << "] of " << count
                          << ": "
                          << (any ? ElementAt(got, dtype, d.worst) : 0.0)
                          << " against "
                          << (any ? ElementAt(want, dtype, d.worst) : 0.0)
                          << ", scale " << d.scale << ")";
}

inline int64_t MaxUlp(const std::vector<uint8_t>& got,
                      const std::vector<uint8_t>& want, DType dtype,
                      int64_t count) {
  int64_t worst = 0;
  for (int64_t i = 0; i < count; ++i) {
    worst = std::max(worst, UlpDistance(dtype, ElementAt(got, dtype, i),
                                        ElementAt(want, dtype, i)));
  }
  return worst;
}

// Elements more than one 16-bit ulp from the reference's correctly rounded
// value, not counting results whose distance is below the fp32 accumulation
// floor (2^-18 of the tensor's largest magnitude): near a cancellation the
// exact result can be far smaller than the terms, and fp32 accumulation
// (docs/SPEC.md section 1) cannot place it within one ulp of its own tiny
// value.
inline int64_t UlpViolations(const std::vector<uint8_t>& got,
                             const std::vector<uint8_t>& want, DType dtype,
                             int64_t count) {
  double scale = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    const double b = ElementAt(want, dtype, i);
    if (std::isfinite(b)) scale = std::max(scale, std::fabs(b));
  }
  const double floor = std::ldexp(scale, -18);
  int64_t bad = 0;
  for (int64_t i = 0; i < count; ++i) {
    const float a = ElementAt(got, dtype, i);
    const float b = ElementAt(want, dtype, i);
    if (UlpDistance(dtype, a, b) <= 1) continue;
    if (std::isfinite(a) && std::isfinite(b) && std::fabs(a - b) <= floor) {
      continue;
    }
    ++bad;
  }
  return bad;
}

// Compares a CUDA output with the reference's: within `tol` norm-wise for
// fp32 data or 16-bit data downstream of the projection, or within one ulp
// of the reference's correctly rounded value (ulp_mode, 16-bit elementwise
// ops).
inline void ExpectClose(Harness& h, const Pair& out, DType dtype, int64_t count,
                        double tol, bool ulp_mode, const std::string& what) {
  const std::vector<uint8_t> got = h.Fetch(out);
  if (ulp_mode && dtype != DType::kF32) {
    EXPECT_EQ(UlpViolations(got, out.host, dtype, count), 0) << what;
    return;
  }
  ExpectDeviationAtMost(got, out.host, dtype, count, 0.0, tol, what);
}

// An fp32 result against the reference relative to max(its largest
// magnitude, floor): for sums that can cancel far below their terms (a single
// accumulated gradient, a Sinkhorn dlogits row) the floor is the terms'
// scale, e.g. the incoming gradient or the accumulator's starting value.
inline void ExpectCloseWithFloor(Harness& h, const Pair& out, DType dtype,
                                 int64_t count, double floor, double tol,
                                 const std::string& what) {
  ExpectDeviationAtMost(h.Fetch(out), out.host, dtype, count, floor, tol, what);
}
inline void ExpectCloseWithFloor(Harness& h, const Pair& out, int64_t count,
                                 double floor, double tol,
                                 const std::string& what) {
  ExpectCloseWithFloor(h, out, DType::kF32, count, floor, tol, what);
}

// The largest magnitude of n floats, or of a Pair's host values.
inline double MaxAbs(const float* v, int64_t n) {
  double m = 0.0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(double{v[i]}));
  return m;
}
inline double MaxAbs(const Pair& p, DType dtype, int64_t n) {
  double m = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    m = std::max(m, std::fabs(double{ElementAt(p.host, dtype, i)}));
  }
  return m;
}

// A gradient accumulated onto init: its sums over tokens can cancel far
// below their terms, so the error is measured against the accumulator's
// starting scale too.
inline void ExpectAccumulated(Harness& h, const Pair& out, const float* init,
                              int64_t count, double tol,
                              const std::string& what) {
  ExpectCloseWithFloor(h, out, count, MaxAbs(init, count), tol, what);
}

// Tests parameterised by (preset, activation dtype); skipped without a GPU.
class CudaPresetDtypeTest
    : public ::testing::TestWithParam<std::tuple<std::string, DType>> {
 protected:
  void SetUp() override { MHC_SKIP_WITHOUT_GPU(); }
  std::string preset() const { return std::get<0>(GetParam()); }
  DType dtype() const { return std::get<1>(GetParam()); }
};

// Runs backend method `Op` with params[0] on the reference and params[1] on
// CUDA (harness `h`, each with its own workspace), then waits for the GPU.
#define MHC_RUN_BOTH(Op, params, opkind, spec, tokens)                        \
  for (int b = 0; b < 2; ++b) {                                               \
    Workspace ws = h.Scratch(b, opkind, spec, tokens, dtype());               \
    absl::Status st = h.backend(b).Op(params[b], ws);                         \
    ASSERT_TRUE(st.ok()) << #Op << " " << (b ? "cuda" : "ref") << ": " << st; \
  }                                                                           \
  ASSERT_TRUE(h.cuda().Synchronize().ok())

}  // namespace mhc::testing

#endif  // MHC_TESTS_CUDA_CUDA_HARNESS_H_
