// Runs optimizer steps on any Backend through its public interface (memory
// from Backend::Allocate, so the same code drives host and device backends)
// and compares the outcome with the fp64 reference backend.
#ifndef MHC_TESTS_COMMON_OPTIMIZER_HARNESS_H_
#define MHC_TESTS_COMMON_OPTIMIZER_HARNESS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/test_util.h"
#include "gtest/gtest.h"
#include "mhc/backend.h"
#include "mhc/ops/weights.h"
#include "mhc/types.h"

namespace mhc::testing {

// Parameter block sizes of layers built from every preset at odd shapes:
// MHC and HEAD kinds, gamma and bias on and off, a static layer, and one
// block of many norm chunks.
inline std::vector<int64_t> PresetBlockSizes() {
  std::vector<int64_t> sizes;
  struct Shape {
    int n;
    int64_t hidden;
  };
  const Shape shapes[] = {{4, 37}, {3, 129}, {1, 5}, {4, 1000}};
  int variant = 0;
  for (const std::string& preset : PresetNames()) {
    for (const Shape& shape : shapes) {
      absl::StatusOr<LayerSpec> spec =
          PresetSpec(preset, shape.n, shape.hidden);
      EXPECT_TRUE(spec.ok()) << spec.status();
      if (!spec.ok()) continue;
      switch (variant++ % 4) {
        case 0:
          spec->has_gamma = true;
          spec->has_post_bias = true;
          break;
        case 1:
          spec->kind = LayerKind::kHead;
          spec->dynamic = true;
          spec->has_post_bias = false;
          break;
        case 2:
          spec->dynamic = false;
          spec->has_gamma = false;
          break;
        default:
          break;
      }
      sizes.push_back(ParameterCount(*spec));
    }
  }
  return sizes;
}

// What a run leaves behind, in host memory.
struct OptimizerRun {
  std::vector<std::vector<float>> values;  // per block
  std::vector<std::vector<float>> slots;   // per block, slots back to back
  std::vector<std::vector<float>> grads;   // per block, after the last step
  std::vector<double> norms;               // per step (when computed)
};

struct OptimizerCase {
  OptimizerHyperparameters hyper;
  std::vector<int64_t> sizes;
  int steps = 3;
  bool compute_norm = false;
  bool zero_grads = false;
  uint64_t seed = 1;
};

// Gradients of block `b` at step `s`: uniform, with magnitudes differing by
// block so that clipping weighs the blocks unevenly.
inline std::vector<float> StepGradients(const OptimizerCase& c, size_t b,
                                        int s) {
  const float scale = std::pow(10.0f, static_cast<float>(b % 3) - 1.0f);
  return RandomFloats(c.sizes[b], c.seed * 1000003 + b * 7919 + s, -scale,
                      scale);
}

// Runs `c.steps` steps on `backend`; every block starts from the same
// seeded values and zero state. Steps add fresh gradients to the
// accumulators (as backward ops do), so without zero_grads they sum up.
inline OptimizerRun RunOptimizer(Backend& backend, const OptimizerCase& c) {
  OptimizerRun run;
  const int slots = OptimizerSlotCount(c.hyper.algorithm);
  std::vector<void*> owned;
  auto alloc = [&](size_t bytes) -> void* {
    absl::StatusOr<void*> p = backend.Allocate(std::max<size_t>(bytes, 1));
    EXPECT_TRUE(p.ok()) << p.status();
    owned.push_back(p.ok() ? *p : nullptr);
    return owned.back();
  };
  std::vector<OptimizerTensor> tensors(c.sizes.size());
  std::vector<std::vector<float>> host_grads(c.sizes.size());
  for (size_t b = 0; b < c.sizes.size(); ++b) {
    const int64_t n = c.sizes[b];
    const size_t bytes = static_cast<size_t>(n) * sizeof(float);
    OptimizerTensor& t = tensors[b];
    t.count = n;
    t.values = static_cast<float*>(alloc(bytes));
    t.grads = static_cast<float*>(alloc(bytes));
    t.slots = static_cast<float*>(alloc(bytes * slots));
    std::vector<float> values = RandomFloats(n, c.seed + 17 * b, -1.0f, 1.0f);
    EXPECT_TRUE(backend.CopyToDevice(t.values, values.data(), bytes).ok());
    EXPECT_TRUE(backend.Memset(t.grads, 0, bytes).ok());
    EXPECT_TRUE(backend.Memset(t.slots, 0, bytes * slots).ok());
    host_grads[b].assign(n, 0.0f);
  }
  OptimizerStepParams p;
  p.hyper = c.hyper;
  p.tensors = tensors.data();
  p.num_tensors = static_cast<int64_t>(tensors.size());
  p.zero_grads = c.zero_grads;
  double* norm = nullptr;
  if (c.compute_norm || c.hyper.max_grad_norm > 0.0f) {
    norm = static_cast<double*>(alloc(sizeof(double)));
  }
  p.grad_norm = norm;
  const size_t ws_bytes = backend.OptimizerWorkspaceBytes(p);
  Workspace ws{ws_bytes > 0 ? alloc(ws_bytes) : nullptr, ws_bytes};
  for (int s = 0; s < c.steps; ++s) {
    for (size_t b = 0; b < c.sizes.size(); ++b) {
      const std::vector<float> g = StepGradients(c, b, s);
      for (size_t e = 0; e < g.size(); ++e) host_grads[b][e] += g[e];
      EXPECT_TRUE(backend
                      .CopyToDevice(tensors[b].grads, host_grads[b].data(),
                                    g.size() * sizeof(float))
                      .ok());
      tensors[b].step = s + 1;
    }
    absl::Status status = backend.OptimizerStep(p, ws);
    EXPECT_TRUE(status.ok()) << status;
    if (norm != nullptr) {
      double host_norm = 0.0;
      EXPECT_TRUE(backend.CopyToHost(&host_norm, norm, sizeof(double)).ok());
      run.norms.push_back(host_norm);
    }
    if (c.zero_grads) {
      for (auto& g : host_grads) std::fill(g.begin(), g.end(), 0.0f);
    }
  }
  EXPECT_TRUE(backend.Synchronize().ok());
  for (const OptimizerTensor& t : tensors) {
    const size_t n = static_cast<size_t>(t.count);
    run.values.emplace_back(n);
    run.grads.emplace_back(n);
    run.slots.emplace_back(n * slots);
    EXPECT_TRUE(
        backend.CopyToHost(run.values.back().data(), t.values, n * 4).ok());
    EXPECT_TRUE(
        backend.CopyToHost(run.grads.back().data(), t.grads, n * 4).ok());
    EXPECT_TRUE(
        backend.CopyToHost(run.slots.back().data(), t.slots, n * 4 * slots)
            .ok());
  }
  for (void* pointer : owned) backend.Free(pointer);
  return run;
}

// Within `rtol` relative to max(|want|, `floor`): fp32 kernels against the
// float64 oracle, after a few steps whose roundings compound.
inline void ExpectClose(const std::vector<float>& got,
                        const std::vector<float>& want, double rtol,
                        double floor, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  for (size_t e = 0; e < got.size(); ++e) {
    const double tol = rtol * std::max<double>(std::fabs(want[e]), floor);
    if (std::fabs(static_cast<double>(got[e]) - want[e]) <= tol) continue;
    ADD_FAILURE() << what << "[" << e << "]: got " << got[e] << ", want "
                  << want[e] << " (tolerance " << tol << ")";
    if (++reported >= 5) return;
  }
}

// Values, state, gradients and norms of `got` against the reference run.
inline void ExpectMatchesReference(const OptimizerRun& got,
                                   const OptimizerRun& want,
                                   const OptimizerCase& c) {
  ASSERT_EQ(got.values.size(), want.values.size());
  ASSERT_EQ(got.norms.size(), want.norms.size());
  for (size_t s = 0; s < got.norms.size(); ++s) {
    EXPECT_NEAR(got.norms[s], want.norms[s], 1e-12 * want.norms[s])
        << "grad norm of step " << s + 1;
  }
  const int64_t count = static_cast<int64_t>(got.values.size());
  for (int64_t b = 0; b < count; ++b) {
    const std::string block = absl::StrCat("block ", b, " (", c.sizes[b], ")");
    ExpectClose(got.values[b], want.values[b], 2e-6, 1.0,
                absl::StrCat(block, " values"));
    // Each slot against its own scale: the second moment is tiny, and the
    // momentum terms may cancel to near zero, where what is left is a few
    // fp32 roundings of the terms added (each clipped step scales them by
    // a factor itself rounded), about the slot's largest value: the floor
    // is a tenth of it (at a hundredth one seed missed by 2x).
    const int slots = OptimizerSlotCount(c.hyper.algorithm);
    const int64_t n = c.sizes[b];
    for (int s = 0; s < slots; ++s) {
      const std::vector<float> got_slot(got.slots[b].begin() + s * n,
                                        got.slots[b].begin() + (s + 1) * n);
      const std::vector<float> want_slot(want.slots[b].begin() + s * n,
                                         want.slots[b].begin() + (s + 1) * n);
      double largest = 0.0;
      for (float v : want_slot)
        largest = std::max<double>(largest, std::fabs(v));
      ExpectClose(
          got_slot, want_slot, 2e-5, 1e-1 * largest,
          absl::StrCat(block, " ", OptimizerSlotName(c.hyper.algorithm, s)));
    }
    EXPECT_EQ(got.grads[b], want.grads[b]) << block << " gradients";
  }
}

inline bool BitwiseEqual(const OptimizerRun& a, const OptimizerRun& b) {
  auto same = [](const std::vector<std::vector<float>>& x,
                 const std::vector<std::vector<float>>& y) {
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i) {
      if (x[i].size() != y[i].size() ||
          std::memcmp(x[i].data(), y[i].data(), x[i].size() * 4) != 0) {
        return false;
      }
    }
    return true;
  };
  return same(a.values, b.values) && same(a.slots, b.slots) &&
         same(a.grads, b.grads) && a.norms.size() == b.norms.size() &&
         std::memcmp(a.norms.data(), b.norms.data(),
                     a.norms.size() * sizeof(double)) == 0;
}

// The algorithm and hyperparameter variants every backend is checked on.
inline std::vector<std::pair<std::string, OptimizerHyperparameters>>
OptimizerVariants() {
  std::vector<std::pair<std::string, OptimizerHyperparameters>> out;
  OptimizerHyperparameters sgd;
  sgd.algorithm = OptimizerAlgorithm::kSgd;
  sgd.learning_rate = 0.05f;
  out.emplace_back("sgd_plain", sgd);
  sgd.momentum = 0.9f;
  sgd.weight_decay = 0.01f;
  out.emplace_back("sgd_momentum", sgd);
  sgd.nesterov = true;
  out.emplace_back("sgd_nesterov", sgd);
  OptimizerHyperparameters adamw;
  adamw.algorithm = OptimizerAlgorithm::kAdamW;
  adamw.learning_rate = 1e-2f;
  adamw.weight_decay = 0.01f;
  out.emplace_back("adamw", adamw);
  adamw.beta1 = 0.5f;
  adamw.beta2 = 0.9f;
  adamw.epsilon = 1e-6f;
  adamw.weight_decay = 0.0f;
  out.emplace_back("adamw_custom", adamw);
  return out;
}

}  // namespace mhc::testing

#endif  // MHC_TESTS_COMMON_OPTIMIZER_HARNESS_H_
