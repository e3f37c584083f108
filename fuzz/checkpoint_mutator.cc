// libFuzzer's custom mutator for checkpoint_fuzzer (fuzz builds only):
// every other mutation gets its checksums recomputed, so that changes to
// the manifest and tensor data are judged by the checks behind the
// checksums; the rest keep them as mutated, which fuzzes the checksum
// checks themselves.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "fuzz/checkpoint_checksums.h"

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size,
                                          size_t max_size, unsigned int seed) {
  size = LLVMFuzzerMutate(data, size, max_size);
  if (seed % 2 == 0) return size;
  std::string file(reinterpret_cast<const char*>(data), size);
  if (!mhc::fuzz::FixCheckpointChecksums(&file) || file.size() > max_size) {
    return size;
  }
  std::memcpy(data, file.data(), file.size());
  return file.size();
}
