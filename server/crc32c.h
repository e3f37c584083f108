// CRC-32C (Castagnoli, the iSCSI / ext4 checksum) of checkpoint tensors:
// the SSE4.2 instruction where the CPU has it, tables elsewhere. The two
// give the same values; Crc32cPortable exists so tests can compare them.
#ifndef MHC_SERVER_CRC32C_H_
#define MHC_SERVER_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace mhc::server {

// Extends `crc` (0 to start) by `size` bytes; chunks give the CRC of the
// whole: Crc32c(Crc32c(0, a), b) == Crc32c(0, a + b).
uint32_t Crc32c(uint32_t crc, const void* data, size_t size);
uint32_t Crc32cPortable(uint32_t crc, const void* data, size_t size);

}  // namespace mhc::server

#endif  // MHC_SERVER_CRC32C_H_
