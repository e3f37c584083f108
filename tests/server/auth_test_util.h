// Helpers of the authentication tests: a private temp directory, a tokens
// file, empty calls to any RPC and processes run as another user.
#ifndef MHC_TESTS_SERVER_AUTH_TEST_UTIL_H_
#define MHC_TESTS_SERVER_AUTH_TEST_UTIL_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/channel.h"

namespace mhc::testing {

inline constexpr char kReadToken[] = "read-token-0123456789abcdef";
inline constexpr char kComputeToken[] = "compute-token-0123456789abcdef";
inline constexpr char kAdminToken[] = "admin-token-0123456789abcdef";

class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  // Writes `text` to `name` in the directory with `mode`; returns the path.
  std::string Write(const std::string& name, const std::string& text,
                    mode_t mode = 0600) const;

 private:
  std::string path_;
};

// A tokens file granting kReadToken, kComputeToken and kAdminToken.
std::string WriteTokensFile(const TempDir& dir);

// Calls `method` of mhc.v1.Mhc with an empty request (one empty message on
// streams, then half-close) and returns its status. `token`: sent as a
// bearer token unless empty.
absl::Status CallEmpty(const std::shared_ptr<grpc::Channel>& channel,
                       const google::protobuf::MethodDescriptor& method,
                       const std::string& token);

// The mhc.v1.Mhc service descriptor.
const google::protobuf::ServiceDescriptor& MhcService();

// Runs `argv` as `uid`:`gid` (no supplementary groups) and returns its
// stdout. Needs root.
absl::StatusOr<std::string> RunAs(uid_t uid, gid_t gid,
                                  const std::vector<std::string>& argv);

}  // namespace mhc::testing

#endif  // MHC_TESTS_SERVER_AUTH_TEST_UTIL_H_
