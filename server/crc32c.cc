#include "server/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace mhc::server {

namespace {

constexpr uint32_t kPolynomial = 0x82F63B78;  // reflected 0x1EDC6F41

// Eight tables for slicing-by-8: table[k][b] is the CRC of byte b followed
// by k zero bytes.
using Tables = std::array<std::array<uint32_t, 256>, 8>;

const Tables& CrcTables() {
  static const Tables tables = [] {
    Tables t{};
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t crc = b;
      for (int bit = 0; bit < 8; ++bit) {
        crc = (crc >> 1) ^ ((crc & 1) ? kPolynomial : 0);
      }
      t[0][b] = crc;
    }
    for (int k = 1; k < 8; ++k) {
      for (uint32_t b = 0; b < 256; ++b) {
        t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
      }
    }
    return t;
  }();
  return tables;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(uint32_t crc,
                                                          const void* data,
                                                          size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t state = ~crc;
  for (; size >= 8; p += 8, size -= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    state = _mm_crc32_u64(state, word);
  }
  uint32_t state32 = static_cast<uint32_t>(state);
  for (; size > 0; ++p, --size) state32 = _mm_crc32_u8(state32, *p);
  return ~state32;
}

bool HaveHardwareCrc() {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}
#endif

}  // namespace

uint32_t Crc32cPortable(uint32_t crc, const void* data, size_t size) {
  const Tables& t = CrcTables();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (; size >= 8; p += 8, size -= 8) {
    // Little-endian words, as the tables assume.
    uint32_t low = crc ^ (uint32_t{p[0]} | uint32_t{p[1]} << 8 |
                          uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24);
    crc = t[7][low & 0xFF] ^ t[6][(low >> 8) & 0xFF] ^
          t[5][(low >> 16) & 0xFF] ^ t[4][low >> 24] ^ t[3][p[4]] ^ t[2][p[5]] ^
          t[1][p[6]] ^ t[0][p[7]];
  }
  for (; size > 0; ++p, --size) crc = (crc >> 8) ^ t[0][(crc ^ *p) & 0xFF];
  return ~crc;
}

uint32_t Crc32c(uint32_t crc, const void* data, size_t size) {
#if defined(__x86_64__)
  if (HaveHardwareCrc()) return Crc32cHardware(crc, data, size);
#endif
  return Crc32cPortable(crc, data, size);
}

}  // namespace mhc::server
