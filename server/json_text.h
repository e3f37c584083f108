// JSON text written by hand where a full serializer would be overkill: log
// lines and checkpoint headers.
#ifndef MHC_SERVER_JSON_TEXT_H_
#define MHC_SERVER_JSON_TEXT_H_

#include <string>

#include "absl/strings/string_view.h"

namespace mhc::server {

// Appends `text` as a quoted JSON string, escaping quotes, backslashes and
// control characters.
void AppendJsonString(std::string* out, absl::string_view text);

}  // namespace mhc::server

#endif  // MHC_SERVER_JSON_TEXT_H_
