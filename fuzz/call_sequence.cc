#include "fuzz/call_sequence.h"

#include <algorithm>
#include <cstdint>

namespace mhc::fuzz {

std::vector<Call> SplitCalls(absl::string_view input, int method_count) {
  std::vector<Call> calls;
  while (!input.empty() && static_cast<int>(calls.size()) < kMaxCalls) {
    Call call;
    call.method = static_cast<uint8_t>(input[0]) % method_count;
    input.remove_prefix(1);
    size_t length = input.size();
    if (input.size() >= 2) {
      length = static_cast<uint8_t>(input[0]) |
               static_cast<size_t>(static_cast<uint8_t>(input[1])) << 8;
      input.remove_prefix(2);
    }
    length = std::min(length, input.size());
    call.request = input.substr(0, length);
    input.remove_prefix(length);
    calls.push_back(call);
  }
  return calls;
}

std::string EncodeCall(int method, absl::string_view request) {
  std::string call;
  call.push_back(static_cast<char>(method));
  call.push_back(static_cast<char>(request.size() & 0xff));
  call.push_back(static_cast<char>(request.size() >> 8 & 0xff));
  call.append(request.data(), request.size());
  return call;
}

}  // namespace mhc::fuzz
