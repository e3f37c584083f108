// The rpc harness's input: a few calls in a row, so that a layer created,
// converted or loaded by one call is used by the next. Each call is one
// byte of method index (modulo the method count of mhc.v1.Mhc), two bytes
// of little-endian request length, then the request; a length past the end
// of the input takes what is left. A client-streaming RPC's request holds
// its pieces (EncodeStream).
#ifndef MHC_FUZZ_CALL_SEQUENCE_H_
#define MHC_FUZZ_CALL_SEQUENCE_H_

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace mhc::fuzz {

// Calls past this many are ignored: longer inputs only cost time.
inline constexpr int kMaxCalls = 8;

struct Call {
  int method = 0;  // index in mhc.v1.Mhc
  absl::string_view request;
};

std::vector<Call> SplitCalls(absl::string_view input, int method_count);
std::string EncodeCall(int method, absl::string_view request);

// The request of a client-streaming RPC: its pieces, each as a varint
// length and the serialized message.
std::string EncodeStream(const std::vector<std::string>& pieces);
// The pieces of such a request; false when it is not one.
bool SplitStream(absl::string_view request, std::vector<std::string>* pieces);

}  // namespace mhc::fuzz

#endif  // MHC_FUZZ_CALL_SEQUENCE_H_
