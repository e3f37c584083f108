// Helpers shared by the test suites: fresh random data in every activation
// dtype, host buffers, and error measures against the fp64 reference.
#ifndef MHC_TESTS_COMMON_TEST_UTIL_H_
#define MHC_TESTS_COMMON_TEST_UTIL_H_

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "mhc/dtype.h"
#include "mhc/types.h"

namespace mhc::testing {

// A seed that differs per test run unless MHC_TEST_SEED is set, printed so a
// failure can be reproduced.
inline uint64_t FreshSeed() {
  static const uint64_t base = [] {
    const char* env = std::getenv("MHC_TEST_SEED");
    uint64_t seed =
        env ? std::strtoull(env, nullptr, 10) : std::random_device{}();
    std::printf("MHC_TEST_SEED=%llu\n", static_cast<unsigned long long>(seed));
    return seed;
  }();
  static uint64_t counter = 0;
  return base + 0x9E3779B97F4A7C15ull * ++counter;
}

// An activation tensor: raw bytes in `dtype` plus its float values (the
// values after rounding to dtype, so references see exactly what kernels see).
struct ActTensor {
  DType dtype = DType::kF32;
  std::vector<uint8_t> bytes;
  std::vector<float> values;

  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  int64_t size() const { return static_cast<int64_t>(values.size()); }
};

inline ActTensor MakeAct(DType dtype, int64_t count) {
  ActTensor t;
  t.dtype = dtype;
  t.bytes.assign(static_cast<size_t>(count) * DTypeSize(dtype), 0);
  t.values.assign(static_cast<size_t>(count), 0.0f);
  return t;
}

// Uniform in [lo, hi), rounded to dtype; never all zeros.
inline ActTensor RandomAct(DType dtype, int64_t count, uint64_t seed,
                           float lo = -1.0f, float hi = 1.0f) {
  ActTensor t = MakeAct(dtype, count);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  for (int64_t i = 0; i < count; ++i) {
    StoreActivation(t.data(), dtype, i, dist(rng));
    t.values[i] = LoadActivation(t.data(), dtype, i);
  }
  return t;
}

// Refreshes `values` from `bytes` (after a kernel wrote the bytes).
inline void SyncValues(ActTensor& t) {
  for (int64_t i = 0; i < t.size(); ++i) {
    t.values[i] = LoadActivation(t.data(), t.dtype, i);
  }
}

inline std::vector<float> RandomFloats(int64_t count, uint64_t seed,
                                       float lo = -1.0f, float hi = 1.0f) {
  std::vector<float> v(static_cast<size_t>(count));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  for (float& x : v) x = dist(rng);
  return v;
}

// Distance in units in the last place of the 16-bit format (or fp32) between
// two values of the same dtype; NaN vs NaN is 0, NaN vs number is huge.
inline int64_t UlpDistance(DType dtype, float a, float b) {
  if (std::isnan(a) || std::isnan(b)) {
    return std::isnan(a) && std::isnan(b) ? 0 : INT64_MAX;
  }
  auto ordered = [dtype](float v) -> int64_t {
    int64_t bits;
    if (dtype == DType::kF32) {
      int32_t word;
      std::memcpy(&word, &v, 4);
      bits = word;
      return bits < 0 ? INT32_MIN - bits : bits;
    }
    uint16_t half = dtype == DType::kBF16 ? FloatToBf16(v) : FloatToHalf(v);
    bits = static_cast<int16_t>(half);
    return bits < 0 ? INT16_MIN - bits : bits;
  };
  int64_t d = ordered(a) - ordered(b);
  return d < 0 ? -d : d;
}

}  // namespace mhc::testing

#endif  // MHC_TESTS_COMMON_TEST_UTIL_H_
