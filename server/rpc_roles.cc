#include "server/rpc_roles.h"

#include <initializer_list>

#include "absl/strings/str_cat.h"

namespace mhc::server {
namespace {

// read: inspects the daemon and its layers. compute: runs kernels on
// existing layers (which accumulates their gradients) and brings its own
// memory. admin: changes what the daemon holds (layers, parameters,
// optimizer state, checkpoints, groups).
constexpr std::pair<const char*, Role> kRoles[] = {
    {"GetServerInfo", Role::kRead},
    {"GetDeterminismReport", Role::kRead},
    {"GetLayer", Role::kRead},
    {"ListLayers", Role::kRead},
    {"GetParameters", Role::kRead},
    {"GetGradients", Role::kRead},
    {"StreamParameters", Role::kRead},
    {"StreamGradients", Role::kRead},
    {"SharedMemoryStatus", Role::kRead},
    {"GetGroup", Role::kRead},
    {"ListCheckpoints", Role::kRead},

    {"Projection", Role::kCompute},
    {"ProjectionBackward", Role::kCompute},
    {"Scale", Role::kCompute},
    {"ScaleBackward", Role::kCompute},
    {"Sinkhorn", Role::kCompute},
    {"SinkhornBackward", Role::kCompute},
    {"Aggregate", Role::kCompute},
    {"AggregateBackward", Role::kCompute},
    {"ExpandCombine", Role::kCompute},
    {"ExpandCombineBackward", Role::kCompute},
    {"Pre", Role::kCompute},
    {"PreBackward", Role::kCompute},
    {"Post", Role::kCompute},
    {"PostBackward", Role::kCompute},
    {"Expand", Role::kCompute},
    {"ExpandBackward", Role::kCompute},
    {"Head", Role::kCompute},
    {"HeadBackward", Role::kCompute},
    {"Execute", Role::kCompute},
    {"ExecuteStream", Role::kCompute},
    {"OpenSession", Role::kCompute},
    {"RegisterSystemSharedMemory", Role::kCompute},
    {"RegisterCudaSharedMemory", Role::kCompute},
    {"UnregisterSharedMemory", Role::kCompute},
    {"RegisterCudaEvents", Role::kCompute},
    {"OpenCallRing", Role::kCompute},
    {"MapLayerMemory", Role::kCompute},

    {"CreateLayer", Role::kAdmin},
    {"DeleteLayer", Role::kAdmin},
    {"SetParameters", Role::kAdmin},
    {"SetParametersStream", Role::kAdmin},
    {"ZeroGradients", Role::kAdmin},
    {"ConvertLayout", Role::kAdmin},
    {"OptimizerStep", Role::kAdmin},
    {"SaveCheckpoint", Role::kAdmin},
    {"LoadCheckpoint", Role::kAdmin},
    {"CreateGroup", Role::kAdmin},
    {"JoinGroup", Role::kAdmin},
    {"AllReduceGradients", Role::kAdmin},
    {"BroadcastParameters", Role::kAdmin},
    {"LeaveGroup", Role::kAdmin},
};

}  // namespace

const std::map<std::string, Role>& RpcRoles() {
  static const auto* const roles = [] {
    auto* table = new std::map<std::string, Role>();
    for (const auto& [name, role] : kRoles) {
      table->emplace(absl::StrCat(kMhcServicePrefix, name), role);
    }
    return table;
  }();
  return *roles;
}

absl::StatusOr<Role> RequiredRole(absl::string_view method) {
  const auto& roles = RpcRoles();
  auto it = roles.find(std::string(method));
  if (it == roles.end()) {
    return absl::InternalError(absl::StrCat(
        method, " has no role in the daemon's table; refused until it has"));
  }
  return it->second;
}

}  // namespace mhc::server
