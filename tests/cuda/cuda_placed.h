// Tensors that start a given number of bytes past a 16-byte boundary, the
// same data in both address spaces, so that a dispatch test can hand a plan
// the alignment its table row names and compare the results with the
// reference's.
#ifndef MHC_TESTS_CUDA_CUDA_PLACED_H_
#define MHC_TESTS_CUDA_CUDA_PLACED_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/cuda_harness.h"

namespace mhc::testing {

// `data` with its first `offset` bytes skipped on both backends.
struct Placed {
  Pair data;
  size_t offset = 0;
  void* ptr(int b) { return static_cast<char*>(data.ptr(b)) + offset; }
  float* f(int b) { return static_cast<float*>(ptr(b)); }
};

// The offset that leaves an allocation's (16-byte aligned) start at
// `alignment` (a power of two up to 16).
inline size_t OffsetFor(int alignment) {
  return static_cast<size_t>(alignment % 16);
}

// Random activations [count], or floats in [lo, hi).
inline Placed PlaceAct(Harness& h, DType dtype, int64_t count, int alignment) {
  const int64_t pad = 16 / static_cast<int64_t>(DTypeSize(dtype));
  return Placed{h.Act(dtype, count + pad, FreshSeed()), OffsetFor(alignment)};
}
inline Placed PlaceFloats(Harness& h, int64_t count, int alignment,
                          float lo = -1.0f, float hi = 1.0f) {
  return Placed{h.Floats(count + 4, FreshSeed(), lo, hi), OffsetFor(alignment)};
}
// A poisoned output of `bytes`.
inline Placed PlaceOutput(Harness& h, size_t bytes, int alignment) {
  return Placed{h.Output(bytes + 16), OffsetFor(alignment)};
}

// The CUDA bytes of `out` and the reference's, from the offset on.
inline std::vector<uint8_t> PlacedDevice(Harness& h, const Placed& out,
                                         size_t bytes) {
  const std::vector<uint8_t> all = h.Fetch(out.data);
  return {all.begin() + out.offset, all.begin() + out.offset + bytes};
}
inline std::vector<uint8_t> PlacedHost(const Placed& out, size_t bytes) {
  return {out.data.host.begin() + out.offset,
          out.data.host.begin() + out.offset + bytes};
}

// As ExpectClose / ExpectCloseWithFloor (cuda_harness.h), on the placed
// elements.
inline void ExpectPlacedClose(Harness& h, const Placed& out, DType dtype,
                              int64_t count, double tol, bool ulp_mode,
                              const std::string& what, double floor = 0.0) {
  const size_t bytes = count * DTypeSize(dtype);
  const std::vector<uint8_t> got = PlacedDevice(h, out, bytes);
  const std::vector<uint8_t> want = PlacedHost(out, bytes);
  if (ulp_mode && dtype != DType::kF32) {
    EXPECT_EQ(UlpViolations(got, want, dtype, count), 0) << what;
    return;
  }
  EXPECT_LE(RelativeError(got, want, dtype, count, floor), tol) << what;
}

// The largest magnitude of the placed elements (the reference's copy).
inline double PlacedMaxAbs(const Placed& p, DType dtype, int64_t count) {
  return MaxAbs(Pair{PlacedHost(p, count * DTypeSize(dtype)), nullptr, 0},
                dtype, count);
}

}  // namespace mhc::testing

#endif  // MHC_TESTS_CUDA_CUDA_PLACED_H_
