// The role each mhc.v1.Mhc RPC needs, by full method name
// ("/mhc.v1.Mhc/GetLayer"). Every RPC of the service must be listed: a test
// walks the service descriptor, and an RPC missing here is refused.
#ifndef MHC_SERVER_RPC_ROLES_H_
#define MHC_SERVER_RPC_ROLES_H_

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/auth_policy.h"

namespace mhc::server {

inline constexpr char kMhcServicePrefix[] = "/mhc.v1.Mhc/";

// The whole table.
const std::map<std::string, Role>& RpcRoles();
// The role `method` (a full method name) needs; INTERNAL for a method the
// table lacks, so that an unclassified RPC fails closed.
absl::StatusOr<Role> RequiredRole(absl::string_view method);

}  // namespace mhc::server

#endif  // MHC_SERVER_RPC_ROLES_H_
