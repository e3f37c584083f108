#include "server/rpc_observer.h"

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"
#include "server/log.h"
#include "server/status_util.h"

namespace mhc::server {

namespace {

using grpc::experimental::InterceptionHookPoints;
using grpc::experimental::ServerRpcInfo;

constexpr char kRequestIdKey[] = "x-request-id";

const char* TypeName(ServerRpcInfo::Type type) {
  switch (type) {
    case ServerRpcInfo::Type::UNARY:
      return "unary";
    case ServerRpcInfo::Type::CLIENT_STREAMING:
      return "client_stream";
    case ServerRpcInfo::Type::SERVER_STREAMING:
      return "server_stream";
    case ServerRpcInfo::Type::BIDI_STREAMING:
      return "bidi_stream";
  }
  return "unknown";
}

class RpcObserver final : public grpc::experimental::Interceptor {
 public:
  RpcObserver(ServerRpcInfo* info, Metrics* metrics, RequestLogMode log_mode)
      : info_(info),
        metrics_(metrics),
        log_mode_(log_mode),
        start_(absl::Now()),
        type_(TypeName(info->type())) {
    // "/mhc.v1.Mhc/Pre": service mhc.v1.Mhc, method Pre.
    absl::string_view full = info->method() ? info->method() : "";
    full = absl::StripPrefix(full, "/");
    const size_t slash = full.rfind('/');
    service_ = std::string(full.substr(0, slash));
    method_ = slash == absl::string_view::npos
                  ? std::string(full)
                  : std::string(full.substr(slash + 1));
    metrics_->RecordRpcStarted(service_, method_, type_);
  }

  // A call torn down without a status (it cannot happen on the sync
  // server, but then started and handled would drift apart for good).
  ~RpcObserver() override {
    if (!finished_) Finish(grpc::Status(grpc::StatusCode::CANCELLED, ""));
  }

  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            InterceptionHookPoints::PRE_SEND_STATUS)) {
      request_id_ = ClientRequestId();
      methods->GetSendTrailingMetadata()->emplace(kRequestIdKey, request_id_);
      Finish(methods->GetSendStatus());
    }
    methods->Proceed();
  }

 private:
  std::string ClientRequestId() {
    grpc::ServerContextBase* context = info_->server_context();
    if (context == nullptr) return RequestId("");
    auto it = context->client_metadata().find(kRequestIdKey);
    if (it == context->client_metadata().end()) return RequestId("");
    return RequestId(absl::string_view(it->second.data(), it->second.size()));
  }

  void Finish(const grpc::Status& status) {
    finished_ = true;
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start_);
    metrics_->RecordRpcHandled(service_, method_, type_, status.error_code(),
                               seconds);
    const bool failed = !status.ok();
    if (log_mode_ == RequestLogMode::kNone ||
        (log_mode_ == RequestLogMode::kFailed && !failed)) {
      return;
    }
    if (request_id_.empty()) request_id_ = RequestId("");
    std::vector<LogField> fields = {
        {"request_id", request_id_},
        {"grpc_service", service_},
        {"grpc_method", method_},
        {"grpc_code", StatusCodeName(status.error_code())},
        {"seconds", seconds}};
    if (grpc::ServerContextBase* context = info_->server_context()) {
      fields.emplace_back("peer", context->peer());
    }
    if (failed) fields.emplace_back("error", status.error_message());
    Log(failed ? LogLevel::kWarning : LogLevel::kInfo, "request", fields);
  }

  ServerRpcInfo* const info_;
  Metrics* const metrics_;
  const RequestLogMode log_mode_;
  const absl::Time start_;
  const char* const type_;
  std::string service_;
  std::string method_;
  std::string request_id_;
  bool finished_ = false;
};

class RpcObserverFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  RpcObserverFactory(Metrics* metrics, RequestLogMode log_mode)
      : metrics_(metrics), log_mode_(log_mode) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      ServerRpcInfo* info) override {
    return new RpcObserver(info, metrics_, log_mode_);
  }

 private:
  Metrics* const metrics_;
  const RequestLogMode log_mode_;
};

}  // namespace

absl::StatusOr<RequestLogMode> ParseRequestLogMode(absl::string_view name) {
  if (name == "none") return RequestLogMode::kNone;
  if (name == "failed") return RequestLogMode::kFailed;
  if (name == "all") return RequestLogMode::kAll;
  return absl::InvalidArgumentError(absl::StrCat(
      "--log_requests: expected none, failed or all, got '", name, "'"));
}

std::string RequestId(absl::string_view from_client) {
  bool valid = !from_client.empty() && from_client.size() <= 128;
  for (char c : from_client) {
    valid = valid && (absl::ascii_isalnum(static_cast<unsigned char>(c)) ||
                      c == '.' || c == '_' || c == ':' || c == '-');
  }
  if (valid) return std::string(from_client);
  thread_local absl::BitGen bits;
  return absl::StrFormat("%016x", absl::Uniform<uint64_t>(bits));
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeRpcObserverFactory(Metrics* metrics, RequestLogMode log_mode) {
  return std::make_unique<RpcObserverFactory>(metrics, log_mode);
}

}  // namespace mhc::server
