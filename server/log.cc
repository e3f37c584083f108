#include "server/log.h"

#include <atomic>
#include <cstdio>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/json_text.h"

namespace mhc::server {

namespace {

std::atomic<LogFormat> format{LogFormat::kText};

absl::Mutex& WriteMutex() {
  static absl::Mutex* mu = new absl::Mutex;
  return *mu;
}

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kWarning:
      return "warning";
    case LogLevel::kError:
      return "error";
  }
  return "info";
}

// Bare when it reads unambiguously as one token, else JSON-quoted.
void AppendTextValue(std::string* out, absl::string_view value) {
  bool bare = !value.empty();
  for (char c : value) {
    bare = bare && absl::ascii_isgraph(static_cast<unsigned char>(c)) &&
           c != '"' && c != '=';
  }
  if (bare) {
    out->append(value.data(), value.size());
  } else {
    AppendJsonString(out, value);
  }
}

}  // namespace

LogField::LogField(absl::string_view key, absl::string_view value)
    : key(key), value(value) {}
LogField::LogField(absl::string_view key, const char* value)
    : LogField(key, absl::string_view(value)) {}
LogField::LogField(absl::string_view key, double value)
    : key(key), value(absl::StrFormat("%.6g", value)), number(true) {}
LogField::LogField(absl::string_view key, int64_t value)
    : key(key), value(absl::StrCat(value)), number(true) {}

absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name) {
  if (name == "text") return LogFormat::kText;
  if (name == "json") return LogFormat::kJson;
  return absl::InvalidArgumentError(
      absl::StrCat("--log_format: expected text or json, got '", name, "'"));
}

void SetLogFormat(LogFormat value) { format.store(value); }

std::string FormatLogLine(LogFormat line_format, LogLevel level,
                          absl::string_view message,
                          const std::vector<LogField>& fields) {
  std::string line;
  if (line_format == LogFormat::kText) {
    absl::StrAppend(&line, "mhcd: ", message);
    for (const LogField& field : fields) {
      absl::StrAppend(&line, " ", field.key, "=");
      AppendTextValue(&line, field.value);
    }
    return line;
  }
  line = "{\"time\":";
  AppendJsonString(&line, absl::FormatTime("%Y-%m-%d%ET%H:%M:%E6SZ",
                                           absl::Now(), absl::UTCTimeZone()));
  absl::StrAppend(&line, ",\"level\":\"", LevelName(level), "\",\"msg\":");
  AppendJsonString(&line, message);
  for (const LogField& field : fields) {
    line.push_back(',');
    AppendJsonString(&line, field.key);
    line.push_back(':');
    if (field.number) {
      line.append(field.value);
    } else {
      AppendJsonString(&line, field.value);
    }
  }
  line.push_back('}');
  return line;
}

void Log(LogLevel level, absl::string_view message,
         const std::vector<LogField>& fields) {
  std::string line = FormatLogLine(format.load(), level, message, fields);
  line.push_back('\n');
  FILE* stream = level == LogLevel::kInfo ? stdout : stderr;
  absl::MutexLock lock(&WriteMutex());
  std::fwrite(line.data(), 1, line.size(), stream);
  std::fflush(stream);
}

}  // namespace mhc::server
