// Host-side conversions between fp32/fp64 and the 16-bit activation formats.
// Round to nearest even, NaN stays NaN, overflow goes to infinity.
#ifndef MHC_DTYPE_H_
#define MHC_DTYPE_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "mhc/types.h"

namespace mhc {

inline float Bf16ToFloat(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

inline uint16_t FloatToBf16(float value) {
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  if ((word & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it quiet and signed
    return static_cast<uint16_t>((word >> 16) | 0x0040u);
  }
  uint32_t rounding = 0x7fffu + ((word >> 16) & 1u);
  return static_cast<uint16_t>((word + rounding) >> 16);
}

inline float HalfToFloat(uint16_t bits) {
  uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  uint32_t word;
  if (exponent == 0x1f) {
    word = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    word = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    word = sign;
  } else {  // subnormal half: exact in float
    float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    std::memcpy(&word, &magnitude, sizeof(word));
    word |= sign;
  }
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

inline uint16_t FloatToHalf(float value) {
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  uint16_t sign = static_cast<uint16_t>((word >> 16) & 0x8000u);
  uint32_t magnitude_bits = word & 0x7fffffffu;
  if (magnitude_bits > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (magnitude_bits >= 0x477ff000u) return sign | 0x7c00u;  // rounds to inf
  if (magnitude_bits < 0x38800000u) {  // below the smallest normal half
    // Scale so the subnormal grid becomes integers; rint rounds to even.
    float magnitude;
    std::memcpy(&magnitude, &magnitude_bits, sizeof(magnitude));
    return sign |
           static_cast<uint16_t>(std::nearbyint(magnitude * 16777216.0f));
  }
  uint32_t rounding = 0xfffu + ((magnitude_bits >> 13) & 1u);
  magnitude_bits += rounding;
  return sign | static_cast<uint16_t>((magnitude_bits - 0x38000000u) >> 13);
}

// Reads element `index` of an activation buffer as float.
inline float LoadActivation(const void* data, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(data)[index];
    case DType::kBF16:
      return Bf16ToFloat(static_cast<const uint16_t*>(data)[index]);
    case DType::kF16:
      return HalfToFloat(static_cast<const uint16_t*>(data)[index]);
  }
  return NAN;
}

// Rounds `value` once to the activation dtype and stores it.
inline void StoreActivation(void* data, DType dtype, int64_t index,
                            float value) {
  switch (dtype) {
    case DType::kF32:
      static_cast<float*>(data)[index] = value;
      return;
    case DType::kBF16:
      static_cast<uint16_t*>(data)[index] = FloatToBf16(value);
      return;
    case DType::kF16:
      static_cast<uint16_t*>(data)[index] = FloatToHalf(value);
      return;
  }
}

}  // namespace mhc

#endif  // MHC_DTYPE_H_
