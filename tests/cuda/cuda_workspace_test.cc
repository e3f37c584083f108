// The CUDA backend's workspace against the memory contract: the scratch a
// request needs (WorkspaceBytes) is at most 5 % of the bytes of the tensors
// it reads and writes, at the layer configs of the GPU benchmark, for every
// preset and activation dtype. The backward of the pre / head and of the
// projection at n other than 1, 2 and 4 holds parameter-sized operands (phi'
// rounded once, a dphi partial) and the fused residual terms of a channel
// chunk, and is above the share (docs/kernels.md); its test pins the current
// worst case so that the memory never grows unnoticed.
#include <algorithm>
#include <cstdint>
#include <string>

#include "bench/bench_configs.h"
#include "cuda/cuda_harness.h"
#include "gtest/gtest.h"
#include "mhc/cuda.h"
#include "mhc/dtype.h"
#include "mhc/types.h"

namespace mhc::testing {
namespace {

// Bytes of the per-token tensors of one request of op (the pre / head
// backward without dx_next, the smaller of its two forms).
double ActivationBytes(OpKind op, const LayerSpec& spec, int64_t M,
                       DType dtype) {
  const double es = static_cast<double>(DTypeSize(dtype));
  const double x = static_cast<double>(M) * spec.K() * es;
  const double y = static_cast<double>(M) * spec.hidden * es;
  const double n = spec.n, N = static_cast<double>(spec.NumLogits());
  const double mix =
      4.0 * M * (spec.kind == LayerKind::kHead ? n : n + n * n);  // H_post, R
  switch (op) {
    case OpKind::kProjectionForward:
      return x + 4.0 * M * (N + 1);  // x -> h, mean square
    case OpKind::kProjectionBackward:
      return 2 * x + 4.0 * M * (N + 1);  // x, dh, dms -> dx
    case OpKind::kScaleBackward:  // h, ms, dH_pre, dH_post, dlogits -> dh, dms
      return 4.0 * M * (2 * N + 2 + n) + mix;
    case OpKind::kPostBackward:  // dx_next, x, f -> dx, df
      return 3 * x + 2 * y;
    case OpKind::kPreForward:
    case OpKind::kHeadForward:
      return x + y + mix;
    case OpKind::kPreBackward:
    case OpKind::kHeadBackward:
      return 2 * x + y + mix;
    default:
      return 0.0;
  }
}

bool Backward(OpKind op) {
  return op == OpKind::kProjectionBackward || op == OpKind::kPreBackward ||
         op == OpKind::kHeadBackward;
}

// The largest share over presets, dtypes and shapes of the ops asked for.
double WorstShare(Backend& cuda, int n, bool backward, std::string* where) {
  constexpr OpKind kOps[] = {
      OpKind::kProjectionForward, OpKind::kProjectionBackward,
      OpKind::kScaleBackward,     OpKind::kPostBackward,
      OpKind::kPreForward,        OpKind::kPreBackward,
      OpKind::kHeadForward,       OpKind::kHeadBackward};
  double worst = 0.0;
  for (const std::string& preset : PresetNames()) {
    for (int c = 0; c < bench::kNumLayerConfigs; ++c) {
      const bench::Config& config = bench::kConfigs[c];
      const int64_t tokens = config.B * config.T;
      absl::StatusOr<LayerSpec> mhc = PresetSpec(preset, n, config.C);
      if (!mhc.ok()) continue;
      LayerSpec head = *mhc;
      head.kind = LayerKind::kHead;
      head.has_post_bias = false;
      for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
        for (OpKind op : kOps) {
          if (Backward(op) != backward) continue;
          const bool is_head =
              op == OpKind::kHeadForward || op == OpKind::kHeadBackward;
          const LayerSpec& spec = is_head ? head : *mhc;
          const double share = cuda.WorkspaceBytes(op, spec, tokens, dtype) /
                               ActivationBytes(op, spec, tokens, dtype);
          if (share > worst) {
            worst = share;
            *where = absl::StrCat(OpFamilyName(op), " ", OpDirectionName(op),
                                  " ", preset, " n=", n, " M=", tokens,
                                  " C=", config.C, " ", DTypeName(dtype));
          }
        }
      }
    }
  }
  return worst;
}

TEST(CudaWorkspaceTest, ScratchStaysWithinItsShareOfTheActivations) {
  MHC_SKIP_WITHOUT_GPU();
  absl::StatusOr<std::unique_ptr<Backend>> cuda = MakeCudaBackend(0);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  for (int n = 1; n <= kMaxStreams; ++n) {
    std::string where;
    const double forward = WorstShare(**cuda, n, /*backward=*/false, &where);
    // The pre forward of the widest layers keeps per-token mixing values
    // (H_res logits, the projection for the backward) beside the K-chunk
    // partials.
    EXPECT_LE(forward, n <= 9 ? 0.05 : 0.07) << where;
    const double backward = WorstShare(**cuda, n, /*backward=*/true, &where);
    const bool within = n == 1 || n == 2 || n == 4;
    EXPECT_LE(backward, within ? 0.05 : 0.40) << where;
    std::printf("n = %2d: forward %.1f %%, backward %.1f %% (%s)\n", n,
                100 * forward, 100 * backward, where.c_str());
  }
}

}  // namespace
}  // namespace mhc::testing
