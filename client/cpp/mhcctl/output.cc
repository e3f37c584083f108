#include "mhcctl/output.h"

#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/util/json_util.h"

namespace mhc::mhcctl {

std::string JsonQuote(absl::string_view text) {
  std::string out = "\"";
  for (char ch : text) {
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20) {
          out += absl::StrFormat("\\u%04x", static_cast<unsigned char>(ch));
        } else {
          out += ch;
        }
    }
  }
  out += "\"";
  return out;
}

std::string JsonNumber(double value) {
  if (!std::isfinite(value)) return "null";
  return absl::StrFormat("%.9g", value);
}

std::string JsonIntArray(const std::vector<int64_t>& values) {
  return absl::StrCat("[", absl::StrJoin(values, ","), "]");
}

JsonObject& JsonObject::Add(absl::string_view key, absl::string_view value) {
  return AddRaw(key, JsonQuote(value));
}
JsonObject& JsonObject::Add(absl::string_view key, const char* value) {
  return AddRaw(key, JsonQuote(value));
}
JsonObject& JsonObject::Add(absl::string_view key, double value) {
  return AddRaw(key, JsonNumber(value));
}
JsonObject& JsonObject::Add(absl::string_view key, int64_t value) {
  return AddRaw(key, absl::StrCat(value));
}
JsonObject& JsonObject::Add(absl::string_view key, int value) {
  return AddRaw(key, absl::StrCat(value));
}
JsonObject& JsonObject::Add(absl::string_view key, bool value) {
  return AddRaw(key, value ? "true" : "false");
}
JsonObject& JsonObject::AddRaw(absl::string_view key, std::string json) {
  fields_.emplace_back(std::string(key), std::move(json));
  return *this;
}

std::string JsonObject::Dump() const {
  std::string out = "{";
  for (size_t i = 0; i < fields_.size(); ++i) {
    if (i > 0) out += ",";
    absl::StrAppend(&out, JsonQuote(fields_[i].first), ":", fields_[i].second);
  }
  out += "}";
  return out;
}

std::string ProtoJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  options.always_print_enums_as_ints = false;
  std::string out;
  if (!google::protobuf::util::MessageToJsonString(message, &out, options)
           .ok()) {
    return "null";
  }
  return out;
}

int ReportError(absl::string_view what, const absl::Status& status, bool json) {
  if (json) {
    std::printf("%s\n",
                JsonObject()
                    .Add("ok", false)
                    .Add("command", what)
                    .Add("code", absl::StatusCodeToString(status.code()))
                    .Add("error", status.message())
                    .Dump()
                    .c_str());
  } else {
    std::fprintf(stderr, "mhcctl %s: %s\n", std::string(what).c_str(),
                 status.ToString().c_str());
  }
  return 1;
}

}  // namespace mhc::mhcctl
