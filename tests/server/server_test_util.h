// Helpers shared by the server integration tests: status assertions, layers
// with random parameters, and comparison of daemon outputs against the
// float64 reference backend run in the test process.
#ifndef MHC_TESTS_SERVER_SERVER_TEST_UTIL_H_
#define MHC_TESTS_SERVER_SERVER_TEST_UTIL_H_

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/test_util.h"
#include "daemon.h"
#include "gtest/gtest.h"
#include "mhc/backend.h"
#include "mhc/client/client.h"
#include "mhc/client/compare.h"
#include "mhc/client/spec.h"
#include "mhc/client/tensor.h"
#include "mhc/status.h"

namespace mhc::testing {

#define MHC_ASSERT_OK(expr)                                 \
  do {                                                      \
    const ::absl::Status mhc_test_status_ = (expr);         \
    ASSERT_TRUE(mhc_test_status_.ok()) << mhc_test_status_; \
  } while (0)

// Unwraps a StatusOr or fails the test (use in functions returning void).
#define MHC_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  MHC_ASSERT_OK_AND_ASSIGN_IMPL_(MHC_STATUS_CONCAT_(so_, __LINE__), lhs, expr)
#define MHC_ASSERT_OK_AND_ASSIGN_IMPL_(so, lhs, expr) \
  auto so = (expr);                                   \
  ASSERT_TRUE(so.ok()) << so.status();                \
  lhs = std::move(so).value()

inline const char* CodeName(absl::StatusCode code) {
  static std::string name;
  name = absl::StatusCodeToString(code);
  return name.c_str();
}

// A random fp32 tensor of the given shape (mixing values, gradients).
inline client::HostTensor RandomF32(std::vector<int64_t> shape, float lo = -1,
                                    float hi = 1) {
  return client::RandomTensor(DType::kF32, std::move(shape), FreshSeed(), lo,
                              hi);
}

// Creates `name` from `request` and replaces its parameters by random values
// large enough that every path (gates, Sinkhorn away from the identity) is
// exercised; returns the host copy that the reference runs on.
inline absl::StatusOr<client::HostLayer> CreateRandomLayer(
    client::Client& client, v1::CreateLayerRequest request) {
  auto info = client.CreateLayer(request);
  if (!info.ok()) return info.status();
  absl::StatusOr<LayerSpec> spec = client::SpecFromProto(info->spec());
  if (!spec.ok()) return spec.status();
  v1::SetParametersRequest set;
  set.set_layer(request.name());
  for (const auto& [name, shape] : client::ParameterShapes(*spec)) {
    float lo = -1, hi = 1;
    if (name == "phi") lo = -0.1f, hi = 0.1f;
    if (name == "alpha") lo = 0.5f, hi = 1.0f;
    if (name == "gamma") lo = 0.5f, hi = 1.5f;
    (*set.mutable_parameters()->mutable_tensors())[name] =
        client::ToTensorRef(RandomF32(shape, lo, hi));
  }
  auto updated = client.SetParameters(set);
  if (!updated.ok()) return updated.status();
  auto params = client.GetParameters(request.name());
  if (!params.ok()) return params.status();
  return client::MakeHostLayer(updated->spec(), *params);
}

inline v1::CreateLayerRequest LayerRequest(const std::string& name, int n,
                                           int64_t hidden,
                                           const std::string& preset = "") {
  v1::CreateLayerRequest request;
  request.set_name(name);
  request.set_preset(preset);
  request.mutable_spec()->set_n(n);
  request.mutable_spec()->set_hidden(hidden);
  request.set_seed(7);
  return request;
}

// Value of the first sample line of a /metrics scrape that starts with
// `prefix` and contains all of `parts`; -1 when there is none.
inline double MetricSample(const std::string& scrape, absl::string_view prefix,
                           const std::vector<std::string>& parts) {
  for (absl::string_view line : absl::StrSplit(scrape, '\n')) {
    if (!absl::StartsWith(line, prefix)) continue;
    bool all = true;
    for (const std::string& part : parts) all &= absl::StrContains(line, part);
    double value = 0;
    if (all && absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &value)) {
      return value;
    }
  }
  return -1;
}

// Checks shape, dtype and values of a daemon output against the reference.
inline void ExpectMatches(const v1::TensorRef& got_ref,
                          const client::HostTensor& want, double tolerance,
                          const std::string& what) {
  auto got = client::FromTensorRef(got_ref);
  ASSERT_TRUE(got.ok()) << what << ": " << got.status();
  EXPECT_EQ(got->shape, want.shape) << what;
  EXPECT_EQ(got->dtype, want.dtype) << what;
  client::Comparison c = client::Compare(got->ToFloats(), want.ToFloats());
  EXPECT_TRUE(c.Within(tolerance))
      << what << ": error " << c.ToString() << " > " << tolerance;
}

// Compares the layer's accumulated gradients with the reference's.
inline void ExpectGradients(client::Client& client, const std::string& layer,
                            const client::HostLayer& host, double tolerance,
                            const std::string& what) {
  auto grads = client.GetGradients(layer);
  ASSERT_TRUE(grads.ok()) << grads.status();
  for (const auto& [name, want] : host.gradients) {
    auto it = grads->gradients().tensors().find(name);
    ASSERT_NE(it, grads->gradients().tensors().end()) << what << " " << name;
    auto got = client::FromTensorRef(it->second);
    ASSERT_TRUE(got.ok()) << got.status();
    client::Comparison c = client::Compare(got->ToFloats(), want);
    EXPECT_TRUE(c.Within(tolerance))
        << what << " grad " << name << ": " << c.ToString();
  }
}

}  // namespace mhc::testing

#endif  // MHC_TESTS_SERVER_SERVER_TEST_UTIL_H_
