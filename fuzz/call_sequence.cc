#include "fuzz/call_sequence.h"

#include <algorithm>
#include <cstdint>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

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

std::string EncodeStream(const std::vector<std::string>& pieces) {
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    for (const std::string& piece : pieces) {
      coded.WriteVarint32(static_cast<uint32_t>(piece.size()));
      coded.WriteString(piece);
    }
  }
  return out;
}

bool SplitStream(absl::string_view request, std::vector<std::string>* pieces) {
  google::protobuf::io::CodedInputStream coded(
      reinterpret_cast<const uint8_t*>(request.data()),
      static_cast<int>(request.size()));
  while (coded.CurrentPosition() < static_cast<int>(request.size())) {
    uint32_t size = 0;
    std::string piece;
    if (!coded.ReadVarint32(&size) ||
        !coded.ReadString(&piece, static_cast<int>(size))) {
      return false;
    }
    pieces->push_back(std::move(piece));
  }
  return true;
}

}  // namespace mhc::fuzz
