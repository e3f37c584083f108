// The rpc harness's input: a few calls in a row, so that a layer created,
// converted or loaded by one call is used by the next. Each call is one
// byte of method index (modulo the method count of mhc.v1.Mhc), two bytes
// of little-endian request length, then the request; a length past the end
// of the input takes what is left.
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

}  // namespace mhc::fuzz

#endif  // MHC_FUZZ_CALL_SEQUENCE_H_
