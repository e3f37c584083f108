// Status helpers shared by every layer of mhcd. absl of this vintage does not
// export its RETURN_IF_ERROR macros, so the project carries its own.
#ifndef MHC_STATUS_H_
#define MHC_STATUS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MHC_STATUS_CONCAT_INNER_(a, b) a##b
#define MHC_STATUS_CONCAT_(a, b) MHC_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` yields a non-OK status.
#define MHC_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::absl::Status mhc_status_ = (expr);       \
    if (!mhc_status_.ok()) return mhc_status_; \
  } while (0)

// `MHC_ASSIGN_OR_RETURN(auto v, StatusOrExpr());`
#define MHC_ASSIGN_OR_RETURN(lhs, expr)                                        \
  MHC_ASSIGN_OR_RETURN_IMPL_(MHC_STATUS_CONCAT_(mhc_statusor_, __LINE__), lhs, \
                             expr)
#define MHC_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                               \
  if (!statusor.ok()) return statusor.status();         \
  lhs = std::move(statusor).value()

#endif  // MHC_STATUS_H_
