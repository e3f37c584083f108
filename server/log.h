// The daemon's log lines, in one of two formats chosen by --log_format:
//
//   text (default): "mhcd: <message>[ key=value...]", the lines scripts and
//     tests grep for ("mhcd: ready", "mhcd: listening on ...").
//   json: one object per line, {"time", "level", "msg", fields...}, for log
//     collectors.
//
// Info lines go to stdout, warnings and errors to stderr, in both formats.
// Lines are written whole, so concurrent writers never interleave.
#ifndef MHC_SERVER_LOG_H_
#define MHC_SERVER_LOG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mhc::server {

enum class LogFormat { kText, kJson };
enum class LogLevel { kInfo, kWarning, kError };

// "text" or "json".
absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name);
void SetLogFormat(LogFormat format);

// One key of a structured line; numbers stay unquoted in JSON.
struct LogField {
  LogField(absl::string_view key, absl::string_view value);
  LogField(absl::string_view key, const char* value);
  LogField(absl::string_view key, double value);
  LogField(absl::string_view key, int64_t value);

  std::string key;
  std::string value;
  bool number = false;
};

void Log(LogLevel level, absl::string_view message,
         const std::vector<LogField>& fields = {});

// The line Log writes, without the newline (for tests).
std::string FormatLogLine(LogFormat format, LogLevel level,
                          absl::string_view message,
                          const std::vector<LogField>& fields);

}  // namespace mhc::server

#endif  // MHC_SERVER_LOG_H_
