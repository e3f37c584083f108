// Output helpers of mhcctl: a small ordered JSON writer (for --json) and
// proto-to-JSON, so every command has a machine-readable form.
#ifndef MHC_CLIENT_MHCCTL_OUTPUT_H_
#define MHC_CLIENT_MHCCTL_OUTPUT_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"

namespace mhc::mhcctl {

std::string JsonQuote(absl::string_view text);
// Shortest round-trippable form; non-finite values become null.
std::string JsonNumber(double value);
std::string JsonIntArray(const std::vector<int64_t>& values);

// Fields keep insertion order, which makes the output easy to read and diff.
class JsonObject {
 public:
  JsonObject& Add(absl::string_view key, absl::string_view value);
  JsonObject& Add(absl::string_view key, const char* value);
  JsonObject& Add(absl::string_view key, double value);
  JsonObject& Add(absl::string_view key, int64_t value);
  JsonObject& Add(absl::string_view key, int value);
  JsonObject& Add(absl::string_view key, bool value);
  JsonObject& AddRaw(absl::string_view key, std::string json);
  std::string Dump() const;

 private:
  std::vector<std::pair<std::string, std::string>> fields_;
};

// Compact JSON of a message with the proto field names, defaults included.
std::string ProtoJson(const google::protobuf::Message& message);

// Prints an RPC failure ({"ok": false, "code": ..., "error": ...} with
// --json) and returns the exit code for it.
int ReportError(absl::string_view what, const absl::Status& status, bool json);

}  // namespace mhc::mhcctl

#endif  // MHC_CLIENT_MHCCTL_OUTPUT_H_
