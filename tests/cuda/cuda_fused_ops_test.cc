// The fused CUDA pre / head forward against its ops run in turn: the
// mixing values have the bits of the projection, scale and Sinkhorn ops, and
// a small batch's units the bits of the large batch's. Skips without a GPU.
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/cuda_cases.h"
#include "cuda/cuda_fused_layer.h"
#include "cuda/cuda_harness.h"
#include "gtest/gtest.h"

namespace mhc::testing {
namespace {

// The fused pre / head forward's mixing values have the bits of its ops in
// turn (projection, scale, Sinkhorn): the fused kernel takes each logit,
// and at n = 4 each row's softmax, on threads of its own, the ops a token
// per thread. Its y is the aggregate op's over those H_pre, although its
// aggregate gates H_pre from the projection itself. n = 4 LINEAR and LOG,
// n = 2, 8 and 16, every dtype, a head; several blocks of tokens and a
// partial last one.
TEST(CudaFusedOpsTest, PreForwardIsItsOpsInTurn) {
  MHC_SKIP_WITHOUT_GPU();
  struct Case {
    const char* preset;
    int n;
    bool head;
    DType dt;
  };
  const Case cases[] = {
      {"deepseek_v4", 4, false, DType::kBF16},
      {"transformer_engine", 4, false, DType::kBF16},
      {"deepseek_v4", 2, false, DType::kF16},
      {"megatron", 8, false, DType::kF32},
      {"deepseek_v4", 16, false, DType::kBF16},
      {"deepseek_v4", 4, true, DType::kBF16},
  };
  const int64_t M = 200;
  for (const Case& c : cases) {
    LayerSpec spec = PresetSpec(c.preset, c.n, 256).value();
    spec.has_gamma = true;
    if (c.head) {
      spec.kind = LayerKind::kHead;
      spec.has_post_bias = false;
    }
    const int64_t n = spec.n, N = spec.NumLogits(), K = spec.K();
    SCOPED_TRACE(CaseName(spec, M, c.dt) + (c.head ? " head" : ""));
    Harness h;
    Layer l = MakeLayer(h, spec);
    Pair x = h.Act(c.dt, M * K, FreshSeed());
    Pair ph = h.Output(M * N * 4), pms = h.Output(M * 4);
    Pair ops_pre = h.Output(M * n * 4), ops_post = h.Output(M * n * 4);
    Pair logits = h.Output(M * n * n * 4), ops_res = h.Output(M * n * n * 4);
    Pair pre = h.Output(M * n * 4), post = h.Output(M * n * 4);
    Pair res = h.Output(M * n * n * 4);
    Pair y = h.Output(M * spec.hidden * DTypeSize(c.dt));
    Pair ops_y = h.Output(M * spec.hidden * DTypeSize(c.dt));

    // What every op here takes alike, and its workspace.
    auto common = [&](auto& p) {
      p.spec = &spec;
      p.tokens = M;
      p.act_dtype = c.dt;
      p.x = x.ptr(1);
      p.weights = l.w[1];
    };
    auto scratch = [&](OpKind op) { return h.Scratch(1, op, spec, M, c.dt); };
    ProjectionForwardParams proj;
    common(proj);
    proj.h = ph.f(1);
    proj.mean_square = pms.f(1);
    ASSERT_TRUE(
        h.cuda()
            .ProjectionForward(proj, scratch(OpKind::kProjectionForward))
            .ok());
    ScaleForwardParams scale;
    scale.spec = &spec;
    scale.tokens = M;
    scale.h = ph.f(1);
    scale.mean_square = pms.f(1);
    scale.weights = l.w[1];
    scale.h_pre = ops_pre.f(1);
    if (!c.head) {
      scale.h_post = ops_post.f(1);
      scale.logits = logits.f(1);
    }
    ASSERT_TRUE(
        h.cuda().ScaleForward(scale, scratch(OpKind::kScaleForward)).ok());
    if (c.head) {
      HeadForwardParams fused;
      common(fused);
      fused.y = y.ptr(1);
      fused.mix = pre.f(1);
      ASSERT_TRUE(
          h.cuda().HeadForward(fused, scratch(OpKind::kHeadForward)).ok());
    } else {
      SinkhornForwardParams sinkhorn;
      sinkhorn.spec = &spec;
      sinkhorn.tokens = M;
      sinkhorn.logits = logits.f(1);
      sinkhorn.h_res = ops_res.f(1);
      ASSERT_TRUE(
          h.cuda()
              .SinkhornForward(sinkhorn, scratch(OpKind::kSinkhornForward))
              .ok());
      PreForwardParams fused;
      common(fused);
      fused.y = y.ptr(1);
      fused.h_pre = pre.f(1);
      fused.h_post = post.f(1);
      fused.h_res = res.f(1);
      ASSERT_TRUE(
          h.cuda().PreForward(fused, scratch(OpKind::kPreForward)).ok());
    }
    AggregateForwardParams aggregate;
    aggregate.spec = &spec;
    aggregate.tokens = M;
    aggregate.act_dtype = c.dt;
    aggregate.x = x.ptr(1);
    aggregate.h_pre = ops_pre.f(1);
    aggregate.y = ops_y.ptr(1);
    ASSERT_TRUE(
        h.cuda()
            .AggregateForward(aggregate, scratch(OpKind::kAggregateForward))
            .ok());
    ASSERT_TRUE(h.cuda().Synchronize().ok());
    EXPECT_EQ(h.Fetch(pre), h.Fetch(ops_pre)) << "h_pre";
    EXPECT_EQ(h.Fetch(y), h.Fetch(ops_y)) << "y";
    if (c.head) continue;
    EXPECT_EQ(h.Fetch(post), h.Fetch(ops_post)) << "h_post";
    EXPECT_EQ(h.Fetch(res), h.Fetch(ops_res)) << "h_res";
  }
}

// What a pre (or head) forward of tokens [0, count) of the host x gives,
// with the projection kept.
struct ForwardRun {
  std::vector<uint8_t> y, h_pre, h_post, h_res, h, ms;
};
ForwardRun RunForward(Harness& h, const LayerSpec& spec, DType dt,
                      const ActTensor& x, const std::vector<float>& params,
                      int64_t count) {
  const int64_t K = spec.K(), N = spec.NumLogits(), n = spec.n;
  const size_t es = DTypeSize(dt);
  Pair xs = h.Input(x.bytes.data(), count * K * es);
  const LayerWeights lw =
      WeightsIn(h.Input(params.data(), params.size() * 4), N, K);
  Pair y = h.Output(count * spec.hidden * es), hp = h.Output(count * n * 4),
       hq = h.Output(count * n * 4), hr = h.Output(count * n * n * 4),
       kh = h.Output(count * N * 4), kms = h.Output(count * 4);
  const bool head = spec.kind == LayerKind::kHead;
  const OpKind op = head ? OpKind::kHeadForward : OpKind::kPreForward;
  const Workspace ws = h.Scratch(1, op, spec, count, dt);
  if (head) {
    const HeadForwardParams p{&spec, count, dt, xs.dev, lw, y.dev, hp.f(1)};
    EXPECT_TRUE(h.cuda().HeadForward(p, ws).ok());
  } else {
    const PreForwardParams p{&spec,   count,   dt,      xs.dev,  lw,      y.dev,
                             hp.f(1), hq.f(1), hr.f(1), kh.f(1), kms.f(1)};
    EXPECT_TRUE(h.cuda().PreForward(p, ws).ok());
  }
  EXPECT_TRUE(h.cuda().Synchronize().ok());
  ForwardRun r;
  r.y = h.Fetch(y);
  r.h_pre = h.Fetch(hp);
  if (head) return r;
  r.h_post = h.Fetch(hq);
  r.h_res = h.Fetch(hr);
  r.h = h.Fetch(kh);
  r.ms = h.Fetch(kms);
  return r;
}

// The first `count` tokens' bytes of a [M, width] tensor of `es`-byte
// elements.
std::vector<uint8_t> Head(const std::vector<uint8_t>& v, int64_t count,
                          int64_t width, size_t es) {
  return std::vector<uint8_t>(v.begin(), v.begin() + count * width * es);
}

// Small batches launch the projection's warpgroup units in other shapes
// than large ones (bf16: a cluster per unit, the plan's unit_ctas; the TF32
// units of fp16 and fp32: the deep ring), and a token's forward outputs are
// the same bits either way. K = 4096 has two chunks of eight flush groups;
// a partial last tile, one token, both layouts, gamma on and off, both bf16
// precisions, a head.
TEST(CudaFusedOpsTest, SmallBatchUnitsKeepTheirBits) {
  MHC_SKIP_WITHOUT_GPU();
  const int64_t C = 1024, big = 4352;  // 136 units: one CTA each
  struct Case {
    DType dt;
    Layout layout;
    MatmulPrecision precision;
    bool gamma, head;
  };
  const Case cases[] = {
      {DType::kF16, Layout::kStreamMajor, MatmulPrecision::kTf32, true, false},
      {DType::kF32, Layout::kStreamMinor, MatmulPrecision::kTf32, false, false},
      {DType::kF32, Layout::kStreamMajor, MatmulPrecision::kTf32, true, true},
      {DType::kBF16, Layout::kStreamMajor, MatmulPrecision::kIeee, true, false},
      {DType::kBF16, Layout::kStreamMinor, MatmulPrecision::kTf32, false,
       false},
  };
  for (const Case& c : cases) {
    LayerSpec spec = PresetSpec("deepseek_v4", 4, C).value();
    spec.layout = c.layout;
    spec.matmul_precision = c.precision;
    spec.has_gamma = c.gamma;
    if (c.head) {
      spec.kind = LayerKind::kHead;
      spec.has_post_bias = false;
    }
    const int64_t K = spec.K(), N = spec.NumLogits(), n = spec.n;
    const size_t es = DTypeSize(c.dt);
    SCOPED_TRACE(CaseName(spec, big, c.dt) + (c.head ? " head" : ""));
    ActTensor x = RandomAct(c.dt, big * K, FreshSeed());
    const std::vector<float> params = RandomParams(K, N, C);
    Harness h;
    const ForwardRun all = RunForward(h, spec, c.dt, x, params, big);
    for (int64_t m : {int64_t{1}, int64_t{100}, int64_t{520}}) {
      SCOPED_TRACE(absl::StrCat("first ", m, " tokens"));
      const ForwardRun few = RunForward(h, spec, c.dt, x, params, m);
      EXPECT_EQ(few.y, Head(all.y, m, C, es));
      EXPECT_EQ(few.h_pre, Head(all.h_pre, m, n, 4));
      if (c.head) continue;
      EXPECT_EQ(few.h_post, Head(all.h_post, m, n, 4));
      EXPECT_EQ(few.h_res, Head(all.h_res, m, n * n, 4));
      EXPECT_EQ(few.h, Head(all.h, m, N, 4));
      EXPECT_EQ(few.ms, Head(all.ms, m, 1, 4));
    }
  }
}

// The bf16 split units in every cluster shape the plan makes: 8, 7, 4 and 3
// CTAs a unit, one to three flush groups a CTA, rows shared unevenly among
// the CTAs that add them (7, one of them with none, and 3), and a last K
// chunk with a flush group fewer than the others (C = 1408). Each against the
// same tokens of a batch large enough for one CTA per unit.
TEST(CudaFusedOpsTest, SplitUnitsOfEveryClusterShapeKeepTheirBits) {
  MHC_SKIP_WITHOUT_GPU();
  struct Case {
    int64_t C, big;
    std::vector<int64_t> few;
  };
  const Case cases[] = {
      {1024, 4352, {2100, 4000}},    // 4 CTAs x 2 groups, 3 x 3
      {1280, 2880, {1, 100, 520}},   // 7 x 1
      {1408, 2880, {1, 520, 2100}},  // 8 x 1, 4 x 2; last chunk 7 groups
  };
  for (const Case& c : cases) {
    const LayerSpec spec = PresetSpec("deepseek_v4", 4, c.C).value();
    const int64_t K = spec.K(), N = spec.NumLogits(), n = spec.n;
    SCOPED_TRACE(CaseName(spec, c.big, DType::kBF16));
    ActTensor x = RandomAct(DType::kBF16, c.big * K, FreshSeed());
    const std::vector<float> params = RandomParams(K, N, c.C);
    Harness h;
    const ForwardRun all = RunForward(h, spec, DType::kBF16, x, params, c.big);
    for (int64_t m : c.few) {
      SCOPED_TRACE(absl::StrCat("first ", m, " tokens"));
      const ForwardRun few = RunForward(h, spec, DType::kBF16, x, params, m);
      EXPECT_EQ(few.y, Head(all.y, m, c.C, 2));
      EXPECT_EQ(few.h_pre, Head(all.h_pre, m, n, 4));
      EXPECT_EQ(few.h, Head(all.h, m, N, 4));
      EXPECT_EQ(few.ms, Head(all.ms, m, 1, 4));
    }
  }
}

}  // namespace
}  // namespace mhc::testing
