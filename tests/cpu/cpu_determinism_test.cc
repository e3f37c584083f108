// Determinism, batch invariance, special values and M = 0 of the fast CPU
// backend (docs/SPEC.md sections 6 and 7).
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "mhc/backend.h"
#include "op_harness.h"

namespace mhc::testing {
namespace {

void ExpectBitwiseEqual(const std::vector<Output>& a,
                        const std::vector<Output>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t o = 0; o < a.size(); ++o) {
    SCOPED_TRACE(a[o].name);
    EXPECT_TRUE(a[o].bits == b[o].bits);
  }
}

LayerSpec TestSpec(const std::string& preset, int n, int64_t hidden) {
  LayerSpec spec = *PresetSpec(preset, n, hidden);
  spec.has_gamma = true;
  spec.has_post_bias = true;
  return spec;
}

// Same inputs: run twice, and on 1, 2 and 3 threads; every output and every
// parameter gradient must have identical bits.
TEST(CpuDeterminismTest, RepeatedRunsAndThreadCountsAreBitwiseEqual) {
  auto one = MakeCpuBackend(1);
  auto two = MakeCpuBackend(2);
  auto three = MakeCpuBackend(3);
  for (const char* preset : {"deepseek_v4", "transformer_engine"}) {
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      for (OpKind op : kAllOps) {
        const LayerSpec spec = SpecFor(op, TestSpec(preset, 4, 1031));
        SCOPED_TRACE(absl::StrCat(preset, " ", DTypeName(dtype), " ",
                                  OpFamilyName(op), " ", OpDirectionName(op)));
        const Inputs in = MakeInputs(spec, 137, dtype);
        const std::vector<Output> first = RunOp(*two, op, in);
        ExpectBitwiseEqual(first, RunOp(*two, op, in));
        ExpectBitwiseEqual(first, RunOp(*one, op, in));
        ExpectBitwiseEqual(first, RunOp(*three, op, in));
      }
    }
  }
}

// Token t of a batch of 137 against the same token alone (M = 1).
Inputs SliceToken(const Inputs& in, int64_t t) {
  Inputs out = in;
  out.tokens = 1;
  const int64_t n = in.spec.n, c = in.spec.hidden, k = in.spec.K();
  const int64_t big_n = in.spec.NumLogits();
  auto act = [&](const ActTensor& a, int64_t width) {
    ActTensor s = MakeAct(a.dtype, width);
    const size_t size = DTypeSize(a.dtype);
    std::memcpy(s.bytes.data(), a.bytes.data() + t * width * size,
                width * size);
    SyncValues(s);
    return s;
  };
  auto floats = [&](const std::vector<float>& v, int64_t width) {
    return std::vector<float>(v.begin() + t * width,
                              v.begin() + (t + 1) * width);
  };
  out.x = act(in.x, k);
  out.f = act(in.f, c);
  out.dy = act(in.dy, c);
  out.dx_next = act(in.dx_next, k);
  out.e = act(in.e, c);
  out.h = floats(in.h, big_n);
  out.ms = floats(in.ms, 1);
  out.h_pre = floats(in.h_pre, n);
  out.h_post = floats(in.h_post, n);
  out.h_res = floats(in.h_res, n * n);
  out.logits = floats(in.logits, n * n);
  out.dh = floats(in.dh, big_n);
  out.dms = floats(in.dms, 1);
  out.dh_pre = floats(in.dh_pre, n);
  out.dh_post = floats(in.dh_post, n);
  out.dh_res = floats(in.dh_res, n * n);
  out.dlogits = floats(in.dlogits, n * n);
  return out;
}

// Per-token outputs (y, H_post, H_res, x_next, dx, ...) of a token do not
// change by a bit when it runs inside a batch. Parameter gradients are sums
// over tokens and are excluded.
TEST(CpuBatchInvarianceTest, TokenAloneEqualsTokenInBatch) {
  auto cpu = MakeCpuBackend(2);
  for (const char* preset : {"deepseek_v4", "transformer_engine", "liger"}) {
    for (OpKind op : kAllOps) {
      const LayerSpec spec = SpecFor(op, TestSpec(preset, 4, 1031));
      SCOPED_TRACE(absl::StrCat(preset, " ", OpFamilyName(op), " ",
                                OpDirectionName(op)));
      const Inputs batch = MakeInputs(spec, 137, DType::kBF16);
      const std::vector<Output> all = RunOp(*cpu, op, batch);
      for (int64_t t : {0, 68, 136}) {
        const std::vector<Output> alone = RunOp(*cpu, op, SliceToken(batch, t));
        ASSERT_EQ(all.size(), alone.size());
        for (size_t o = 0; o < all.size(); ++o) {
          const std::string& name = all[o].name;
          if (name.rfind("d", 0) == 0 && name != "dx" && name != "dh" &&
              name != "dms" && name != "dh_pre" && name != "dh_post" &&
              name != "dh_res" && name != "dlogits" && name != "df" &&
              name != "de") {
            continue;  // parameter gradient
          }
          SCOPED_TRACE(absl::StrCat(name, " token ", t));
          const size_t width = alone[o].bits.size();
          ASSERT_EQ(all[o].bits.size(), width * 137);
          EXPECT_EQ(std::memcmp(all[o].bits.data() + t * width,
                                alone[o].bits.data(), width),
                    0);
        }
      }
    }
  }
}

// The projection PreForward keeps is the one PreBackward recomputes: taking
// it changes no bit of dx or of the parameter gradients.
TEST(CpuKeptProjectionTest, BackwardFromKeptEqualsRecompute) {
  auto cpu = MakeCpuBackend(2);
  for (const char* preset : {"deepseek_v4", "liger"}) {
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      SCOPED_TRACE(absl::StrCat(preset, " ", DTypeName(dtype)));
      Inputs in = MakeInputs(TestSpec(preset, 4, 1031), 137, dtype);
      in.keep_projection = true;
      const std::vector<Output> forward = RunOp(*cpu, OpKind::kPreForward, in);
      ASSERT_EQ(forward.size(), 6u);
      ASSERT_EQ(forward[4].name, "h");
      const std::vector<float> random_h = in.h;
      in.h = forward[4].values;
      in.ms = forward[5].values;
      const std::vector<Output> kept = RunOp(*cpu, OpKind::kPreBackward, in);
      in.keep_projection = false;
      ExpectBitwiseEqual(kept, RunOp(*cpu, OpKind::kPreBackward, in));
      // And it is used: another h gives another dx.
      in.keep_projection = true;
      in.h = random_h;
      EXPECT_FALSE(kept[0].bits ==
                   RunOp(*cpu, OpKind::kPreBackward, in)[0].bits);
    }
  }
}

bool AnyNonFinite(const std::vector<float>& v, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    if (!std::isfinite(v[i])) return true;
  }
  return false;
}

// A NaN or Inf in x reaches that token's outputs and no other token's.
TEST(CpuSpecialValuesTest, NanAndInfPropagate) {
  auto cpu = MakeCpuBackend(2);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity()};
  for (float special : specials) {
    for (OpKind op : {OpKind::kAggregateForward, OpKind::kPostForward,
                      OpKind::kPreForward, OpKind::kHeadForward,
                      OpKind::kPreBackward, OpKind::kProjectionForward}) {
      const LayerSpec spec = SpecFor(op, TestSpec("deepseek_v4", 4, 67));
      SCOPED_TRACE(absl::StrCat(OpFamilyName(op), " ", OpDirectionName(op), " ",
                                special));
      Inputs in = MakeInputs(spec, 13, DType::kBF16);
      StoreActivation(in.x.data(), DType::kBF16, 5 * spec.K() + 3, special);
      SyncValues(in.x);
      const std::vector<Output> out = RunOp(*cpu, op, in);
      const Output& first = out[0];
      const int64_t width = first.values.size() / 13;
      EXPECT_TRUE(AnyNonFinite(first.values, 5 * width, 6 * width));
      EXPECT_FALSE(AnyNonFinite(first.values, 0, 5 * width));
      EXPECT_FALSE(AnyNonFinite(first.values, 6 * width, 13 * width));
    }
  }
  // Sinkhorn: a NaN logit poisons its token's H_res; finite logits give a
  // finite H_res whose columns sum to 1.
  for (const char* preset : {"deepseek_v4", "transformer_engine"}) {
    const LayerSpec spec = TestSpec(preset, 4, 8);
    Inputs in = MakeInputs(spec, 13, DType::kF32);
    in.logits[2 * 16 + 5] = std::numeric_limits<float>::quiet_NaN();
    const std::vector<float> h_res =
        RunOp(*cpu, OpKind::kSinkhornForward, in)[0].values;
    EXPECT_TRUE(AnyNonFinite(h_res, 32, 48));
    for (int64_t m = 0; m < 13; ++m) {
      if (m == 2) continue;
      EXPECT_FALSE(AnyNonFinite(h_res, m * 16, (m + 1) * 16));
      for (int j = 0; j < 4; ++j) {
        float sum = 0.0f;
        for (int i = 0; i < 4; ++i) sum += h_res[m * 16 + i * 4 + j];
        EXPECT_NEAR(sum, 1.0f, 1e-5f);
      }
    }
  }
}

template <typename Params>
Params Empty(const LayerSpec& spec) {
  Params p;
  p.spec = &spec;
  return p;
}

// M = 0 succeeds for every op with null tensors and writes nothing.
TEST(CpuEmptyBatchTest, ZeroTokensIsANoOp) {
  auto cpu = MakeCpuBackend(2);
  const LayerSpec mhc = TestSpec("deepseek_v4", 4, 16);
  LayerSpec head = mhc;
  head.kind = LayerKind::kHead;
  head.has_post_bias = false;
  std::vector<float> grad(1024, 7.0f);
  LayerGrads grads{grad.data(), grad.data(), grad.data(), grad.data(),
                   grad.data()};
  Workspace ws;
  EXPECT_TRUE(
      cpu->ProjectionForward(Empty<ProjectionForwardParams>(mhc), ws).ok());
  ProjectionBackwardParams pb;
  pb.spec = &mhc;
  pb.grads = grads;
  EXPECT_TRUE(cpu->ProjectionBackward(pb, ws).ok());
  EXPECT_TRUE(cpu->ScaleForward(Empty<ScaleForwardParams>(mhc), ws).ok());
  ScaleBackwardParams sb;
  sb.spec = &mhc;
  sb.grads = grads;
  EXPECT_TRUE(cpu->ScaleBackward(sb, ws).ok());
  EXPECT_TRUE(cpu->SinkhornForward(Empty<SinkhornForwardParams>(mhc), ws).ok());
  EXPECT_TRUE(
      cpu->SinkhornBackward(Empty<SinkhornBackwardParams>(mhc), ws).ok());
  EXPECT_TRUE(
      cpu->AggregateForward(Empty<AggregateForwardParams>(mhc), ws).ok());
  EXPECT_TRUE(
      cpu->AggregateBackward(Empty<AggregateBackwardParams>(mhc), ws).ok());
  EXPECT_TRUE(cpu->PostForward(Empty<PostForwardParams>(mhc), ws).ok());
  PostBackwardParams postb;
  postb.spec = &mhc;
  postb.grads = grads;
  EXPECT_TRUE(cpu->PostBackward(postb, ws).ok());
  EXPECT_TRUE(cpu->ExpandForward(Empty<ExpandForwardParams>(mhc), ws).ok());
  EXPECT_TRUE(cpu->ExpandBackward(Empty<ExpandBackwardParams>(mhc), ws).ok());
  EXPECT_TRUE(cpu->PreForward(Empty<PreForwardParams>(mhc), ws).ok());
  PreBackwardParams preb;
  preb.spec = &mhc;
  preb.grads = grads;
  EXPECT_TRUE(cpu->PreBackward(preb, ws).ok());
  EXPECT_TRUE(cpu->HeadForward(Empty<HeadForwardParams>(head), ws).ok());
  HeadBackwardParams hb;
  hb.spec = &head;
  hb.grads = grads;
  EXPECT_TRUE(cpu->HeadBackward(hb, ws).ok());
  for (float g : grad) EXPECT_EQ(g, 7.0f);
}

// A workspace smaller than WorkspaceBytes is an error, not a crash.
TEST(CpuWorkspaceTest, TooSmallWorkspaceIsRejected) {
  auto cpu = MakeCpuBackend(2);
  const LayerSpec spec = TestSpec("deepseek_v4", 4, 64);
  Inputs in = MakeInputs(spec, 3, DType::kBF16);
  ASSERT_GT(cpu->WorkspaceBytes(OpKind::kPreBackward, spec, 3, DType::kBF16),
            0u);
  std::vector<float> h(3 * spec.NumLogits()), ms(3);
  const LayerWeights w = WeightsOf(in);
  std::vector<uint8_t> small(16);
  absl::Status status = cpu->ProjectionForward(
      {&spec, 3, DType::kBF16, in.x.data(), w, h.data(), ms.data()},
      Workspace{small.data(), small.size()});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
}

// h and mean_square of the kept projection go together, and only with a
// dynamic layer.
TEST(CpuKeptProjectionTest, HalfOrStaticIsRejected) {
  auto cpu = MakeCpuBackend(2);
  LayerSpec spec = TestSpec("deepseek_v4", 4, 64);
  Inputs in = MakeInputs(spec, 3, DType::kBF16);
  std::vector<float> dx(3 * spec.K()), h_post(3 * 4), h_res(3 * 16);
  const LayerWeights w = WeightsOf(in);
  std::vector<uint8_t> ws(
      cpu->WorkspaceBytes(OpKind::kPreBackward, spec, 3, DType::kBF16));
  PreBackwardParams p;
  p.spec = &spec;
  p.tokens = 3;
  p.act_dtype = DType::kBF16;
  p.x = in.x.data();
  p.weights = w;
  p.dy = in.dy.data();
  p.dh_post = in.dh_post.data();
  p.dh_res = in.dh_res.data();
  p.dx = dx.data();
  p.h = in.h.data();  // without mean_square
  absl::Status status = cpu->PreBackward(p, Workspace{ws.data(), ws.size()});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("mean_square"), std::string::npos) << status;
  PreForwardParams f;
  f.spec = &spec;
  f.tokens = 3;
  f.act_dtype = DType::kBF16;
  f.x = in.x.data();
  f.weights = w;
  f.y = dx.data();
  f.h_post = h_post.data();
  f.h_res = h_res.data();
  f.mean_square = h_post.data();
  EXPECT_EQ(cpu->PreForward(f, Workspace{ws.data(), ws.size()}).code(),
            absl::StatusCode::kInvalidArgument);
  spec.dynamic = false;
  spec.has_gamma = false;
  p.mean_square = in.h.data();
  status = cpu->PreBackward(p, Workspace{ws.data(), ws.size()});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("static"), std::string::npos) << status;
}

}  // namespace
}  // namespace mhc::testing
