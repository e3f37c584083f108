#include "mhc/client/shm_key.h"

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <random>

#include "absl/strings/str_cat.h"

namespace mhc::client {

std::string UniqueShmKey(const std::string& prefix, const std::string& tag) {
  // The pid alone repeats: a process killed before it unlinked its objects
  // leaves their names behind for the next process of its pid.
  static const uint32_t nonce = std::random_device{}();
  static std::atomic<uint64_t> counter{0};
  return absl::StrCat(prefix, getpid(), "_", absl::Hex(nonce, absl::kZeroPad8),
                      "_", counter.fetch_add(1), "_", tag);
}

}  // namespace mhc::client
