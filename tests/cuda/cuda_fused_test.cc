// The fused CUDA ops (pre, head; forward and backward, with and without the
// folded residual gradient) against the float64 reference, plus the
// determinism contract of docs/SPEC.md section 6: identical bits run after run,
// and a token's outputs and dx identical alone or inside a batch. Skips without
// a GPU.
#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/cuda_cases.h"
#include "cuda/cuda_fused_layer.h"
#include "cuda/cuda_harness.h"
#include "gtest/gtest.h"
#include "plans/fused.h"
#include "projection/plan.h"

namespace mhc::testing {
namespace {

// Gradient accumulators starting from the same random values.
struct Grads {
  std::vector<float> init;  // phi, alpha (3), beta, gamma
  Pair phi, alpha, beta, gamma;
  LayerGrads g[2];
};

Grads MakeGrads(Harness& h, const LayerSpec& spec) {
  const int64_t N = spec.NumLogits(), K = spec.K();
  Grads gr;
  gr.init = RandomFloats(N * K + 3 + N + K, 11);
  const float* a = gr.init.data();
  gr.phi = h.Input(a, N * K * 4);
  gr.alpha = h.Input(a + N * K, 3 * 4);
  gr.beta = h.Input(a + N * K + 3, N * 4);
  gr.gamma = h.Input(a + N * K + 3 + N, K * 4);
  for (int b = 0; b < 2; ++b) {
    gr.g[b].phi = spec.dynamic ? gr.phi.f(b) : nullptr;
    gr.g[b].alpha = spec.dynamic ? gr.alpha.f(b) : nullptr;
    gr.g[b].beta = gr.beta.f(b);
    gr.g[b].gamma = spec.dynamic ? gr.gamma.f(b) : nullptr;
  }
  return gr;
}

// An accumulated gradient relative to the larger of its magnitude and its
// starting value's: the sum added into the buffer may cancel that value (a
// single dalpha, say), and fp32 accumulation cannot be finer than the
// operands it adds.
void ExpectGrads(Harness& h, Grads& gr, const LayerSpec& spec, double tol) {
  const int64_t N = spec.NumLogits(), K = spec.K();
  const float* init = gr.init.data();
  ExpectAccumulated(h, gr.beta, init + N * K + 3, N, tol, "dbeta");
  if (!spec.dynamic) return;
  ExpectAccumulated(h, gr.phi, init, N * K, tol, "dphi");
  ExpectAccumulated(h, gr.alpha, init + N * K, spec.NumAlpha(), tol, "dalpha");
  if (spec.has_gamma) {
    ExpectAccumulated(h, gr.gamma, init + N * K + 3 + N, K, tol, "dgamma");
  }
}

// The pre forward and backward of an mHC layer (with and without dx_next)
// against the reference.
void CheckPreLayer(const LayerSpec& spec, int64_t M, DType dt) {
  const auto dtype = [dt] { return dt; };  // what MHC_RUN_BOTH sizes for
  // The mixing values come from the projection: under TF32 its operands are
  // rounded to 11 bits (the projection tests' 2e-3).
  const double mix_tol =
      spec.matmul_precision == MatmulPrecision::kIeee ? kMixTol : 2e-3;
  const size_t es = DTypeSize(dt);
  const int64_t C = spec.hidden, K = spec.K(), n = spec.n;
  Harness h;
  Layer l = MakeLayer(h, spec);
  Pair x = h.Act(dt, M * K, FreshSeed());
  Pair dy = h.Act(dt, M * C, FreshSeed());
  Pair y = h.Output(M * C * es);
  Pair hp = h.Output(M * n * 4);
  Pair hq = h.Output(M * n * 4);
  Pair hr = h.Output(M * n * n * 4);
  // Dynamic layers keep their projection for the backward with dx_next.
  const int64_t N = spec.NumLogits();
  Pair kept_h = h.Output(M * N * 4), kept_ms = h.Output(M * 4);
  PreForwardParams p[2];
  for (int b = 0; b < 2; ++b) {
    p[b].spec = &spec;
    p[b].tokens = M;
    p[b].act_dtype = dt;
    p[b].x = x.ptr(b);
    p[b].weights = l.w[b];
    p[b].y = y.ptr(b);
    p[b].h_pre = hp.f(b);
    p[b].h_post = hq.f(b);
    p[b].h_res = hr.f(b);
    if (spec.dynamic) p[b].h = kept_h.f(b), p[b].mean_square = kept_ms.f(b);
  }
  MHC_RUN_BOTH(PreForward, p, OpKind::kPreForward, spec, M);
  // y = sum_i h_pre[i] x[i][c] can cancel far below its terms (one
  // token, one channel): measured against the scale of x (h_pre <= 1),
  // as the head's y.
  ExpectCloseWithFloor(h, y, dt, M * C, MaxAbs(x, dt, M * K), ForwardTol(dt),
                       "pre y");
  ExpectClose(h, hp, DType::kF32, M * n, mix_tol, false, "pre h_pre");
  ExpectClose(h, hq, DType::kF32, M * n, mix_tol, false, "pre h_post");
  ExpectClose(h, hr, DType::kF32, M * n * n, mix_tol, false, "pre h_res");
  if (spec.dynamic) {
    ExpectClose(h, kept_h, DType::kF32, M * N, mix_tol, false, "pre kept h");
    ExpectClose(h, kept_ms, DType::kF32, M, mix_tol, false,
                "pre kept mean square");
  }
  // Under TF32 the projection's rounding (held to 2e-3 above) enters every
  // token's terms of the parameter gradients, sums over the batch that
  // cancel far below their terms: the reference backward takes the CUDA
  // forward's kept projection (the bits the CUDA backward recomputes), so
  // each backward is held to its own tolerance on the same h.
  const bool same_h =
      spec.dynamic && spec.matmul_precision == MatmulPrecision::kTf32;
  if (same_h) {
    kept_h.host = h.Fetch(kept_h);
    kept_ms.host = h.Fetch(kept_ms);
  }
  for (bool residual : {false, true}) {
    Pair dhq = h.Floats(M * n, FreshSeed());
    Pair dhr = h.Floats(M * n * n, FreshSeed());
    Pair dxn = h.Act(dt, M * K, FreshSeed());
    Pair dx = h.Output(M * K * es);
    Grads gr = MakeGrads(h, spec);
    PreBackwardParams q[2];
    for (int b = 0; b < 2; ++b) {
      q[b].spec = &spec;
      q[b].tokens = M;
      q[b].act_dtype = dt;
      q[b].x = x.ptr(b);
      q[b].weights = l.w[b];
      q[b].dy = dy.ptr(b);
      q[b].dh_post = dhq.f(b);
      q[b].dh_res = dhr.f(b);
      q[b].dx_next = residual ? dxn.ptr(b) : nullptr;
      q[b].dx = dx.ptr(b);
      q[b].grads = gr.g[b];
      if (spec.dynamic && (residual || (same_h && b == 0))) {
        q[b].h = kept_h.f(b), q[b].mean_square = kept_ms.f(b);
      }
    }
    MHC_RUN_BOTH(PreBackward, q, OpKind::kPreBackward, spec, M);
    ExpectClose(h, dx, dt, M * K, BackwardTol(dt), false,
                residual ? "pre dx (with dx_next, kept projection)" : "pre dx");
    ExpectGrads(h, gr, spec, BackwardTol(dt));
  }
}

using CudaFusedTest = CudaPresetDtypeTest;

TEST_P(CudaFusedTest, PreAndHead) {
  const DType dt = dtype();
  const size_t es = DTypeSize(dt);
  const auto& shapes = SampledShapes();
  for (size_t ci = 0; ci < shapes.size(); ++ci) {
    for (int variant = 0; variant < 3; ++variant) {
      LayerSpec spec = CaseSpec(preset(), shapes[ci], static_cast<int>(ci));
      // 0: dynamic mHC layer, 1: static mHC layer, 2: head.
      spec.dynamic = variant != 1;
      if (!spec.dynamic) spec.has_gamma = false;  // static: no phi
      if (variant == 2) {
        spec.kind = LayerKind::kHead;
        spec.has_post_bias = false;
      }
      const int64_t M = shapes[ci].tokens, C = spec.hidden, K = spec.K();
      const int64_t n = spec.n;
      SCOPED_TRACE(CaseName(spec, M, dt) + (variant == 2 ? " head" : ""));
      if (variant != 2) {
        CheckPreLayer(spec, M, dt);
        continue;
      }
      Harness h;
      Layer l = MakeLayer(h, spec);
      Pair x = h.Act(dt, M * K, FreshSeed());
      Pair dy = h.Act(dt, M * C, FreshSeed());
      Pair y = h.Output(M * C * es);
      Pair hp = h.Output(M * n * 4);
      HeadForwardParams p[2];
      for (int b = 0; b < 2; ++b) {
        p[b].spec = &spec;
        p[b].tokens = M;
        p[b].act_dtype = dt;
        p[b].x = x.ptr(b);
        p[b].weights = l.w[b];
        p[b].y = y.ptr(b);
        p[b].mix = hp.f(b);
      }
      MHC_RUN_BOTH(HeadForward, p, OpKind::kHeadForward, spec, M);
      ExpectCloseWithFloor(h, y, dt, M * C, MaxAbs(x, dt, M * K),
                           ForwardTol(dt), "head y");
      ExpectClose(h, hp, DType::kF32, M * n, kMixTol, false, "head mix");
      Grads gr = MakeGrads(h, spec);
      Pair dx = h.Output(M * K * es);
      HeadBackwardParams q[2];
      for (int b = 0; b < 2; ++b) {
        q[b].spec = &spec;
        q[b].tokens = M;
        q[b].act_dtype = dt;
        q[b].x = x.ptr(b);
        q[b].weights = l.w[b];
        q[b].dy = dy.ptr(b);
        q[b].dx = dx.ptr(b);
        q[b].grads = gr.g[b];
      }
      MHC_RUN_BOTH(HeadBackward, q, OpKind::kHeadBackward, spec, M);
      ExpectClose(h, dx, dt, M * K, BackwardTol(dt), false, "head dx");
      // The head backward recomputes the projection (no kept one to share
      // with the reference, as CheckPreLayer does): under TF32 its rounding
      // enters every token's terms of the gradients, held to the 2e-3 of
      // TF32 results.
      const bool tf32 = spec.matmul_precision == MatmulPrecision::kTf32;
      ExpectGrads(h, gr, spec, std::max(BackwardTol(dt), tf32 ? 2e-3 : 0.0));
    }
  }
}

// The n = 4 pre backward on warpgroup mmas (TF32, stream-major, 16-bit rows
// on 16 bytes; projection/backward/wgmma_n4_terms.cu) with and without
// dx_next: a partial channel tile (C = 1032, 33 tiles), chunks split over
// four CTAs two per SM (M = 1100: a partial last stage in the second token
// chunk, whose last two CTAs have none; M = 1034: a second chunk of one
// stage) or one per SM (M = 600: runs of three stages and one, the last
// partial), over three (M = 130: a stage each, the third of two tokens), and
// a batch of one partial stage, gamma on and off.
TEST(CudaFusedN4Test, PreOnWarpgroupMmas) {
  MHC_SKIP_WITHOUT_GPU();
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (bool gamma : {true, false}) {
      for (int64_t m : {1100, 1034, 600, 130, 37}) {
        LayerSpec spec = PresetSpec("deepseek_v4", 4, 1032).value();
        spec.matmul_precision = MatmulPrecision::kTf32;
        spec.has_gamma = gamma;
        SCOPED_TRACE(CaseName(spec, m, dt));
        CheckPreLayer(spec, m, dt);
      }
    }
  }
}

// The n = 8 pre backward on warpgroup mmas (TF32, stream-major, 16-bit rows
// on 16 bytes; projection/backward/wgmma_n8.cu) with and without dx_next: a
// partial channel tile (C = 1032), a partial last stage in the second token
// chunk, gamma on and off.
TEST(CudaFusedN8Test, PreOnWarpgroupMmas) {
  MHC_SKIP_WITHOUT_GPU();
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (bool gamma : {true, false}) {
      LayerSpec spec = PresetSpec("deepseek_v4", 8, 1032).value();
      spec.matmul_precision = MatmulPrecision::kTf32;
      spec.has_gamma = gamma;
      SCOPED_TRACE(CaseName(spec, 1100, dt));
      CheckPreLayer(spec, 1100, dt);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(PresetsAndDtypes, CudaFusedTest,
                         ::testing::Combine(::testing::ValuesIn(PresetNames()),
                                            ::testing::Values(DType::kBF16,
                                                              DType::kF16,
                                                              DType::kF32)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" +
                                  std::string(
                                      DTypeName(std::get<1>(info.param)));
                         });

// ------------------------------------------------ determinism contract --

class CudaDeterminismTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { MHC_SKIP_WITHOUT_GPU(); }
};

struct LayerRun {
  std::vector<uint8_t> y, h_post, h_res, x_next, dx, dx_post, df, dh_res, dphi,
      dbeta;
};

// Runs pre forward, post forward, post backward and pre backward (with the
// residual folded in) on the CUDA backend only, for tokens [first, first +
// count) of the host inputs; with keep_projection the pre backward takes the
// projection the pre forward kept. dx_next_shift: the pre backward's
// dx_next that many bytes past an allocation's start.
LayerRun RunLayer(Harness& h, const LayerSpec& spec, DType dt,
                  const ActTensor& x, const ActTensor& f, const ActTensor& dxn,
                  const ActTensor& dy, const std::vector<float>& params,
                  int64_t first, int64_t count, bool keep_projection = false,
                  size_t dx_next_shift = 0) {
  Backend& cuda = h.cuda();
  const int64_t C = spec.hidden, K = spec.K(), n = spec.n;
  const int64_t N = spec.NumLogits();
  const size_t es = DTypeSize(dt);
  auto slice = [&](const ActTensor& t, int64_t width) {
    return h.Input(t.bytes.data() + first * width * es, count * width * es);
  };
  Pair xs = slice(x, K), fs = slice(f, C), gs = slice(dxn, K),
       dys = slice(dy, C);
  const LayerWeights lw =
      WeightsIn(h.Input(params.data(), params.size() * 4), N, K);
  Pair y = h.Output(count * C * es), hp = h.Output(count * n * 4),
       hq = h.Output(count * n * 4), hr = h.Output(count * n * n * 4),
       xn = h.Output(count * K * es), df = h.Output(count * C * es),
       dxp = h.Output(count * K * es), dhq = h.Output(count * n * 4),
       dhr = h.Output(count * n * n * 4), dx = h.Output(count * K * es),
       kept_h = h.Output(count * N * 4), kept_ms = h.Output(count * 4);
  std::vector<float> zeros(N * K + 3 + N + K + C, 0.0f);
  Pair g = h.Input(zeros.data(), zeros.size() * 4);
  const LayerGrads lg = ParamsIn<LayerGrads>(g, N, K);
  auto ws = [&](OpKind op) { return h.Scratch(1, op, spec, count, dt); };

  PreForwardParams pf{&spec, count,   dt,      xs.dev, lw,
                      y.dev, hp.f(1), hq.f(1), hr.f(1)};
  if (keep_projection) pf.h = kept_h.f(1), pf.mean_square = kept_ms.f(1);
  EXPECT_TRUE(cuda.PreForward(pf, ws(OpKind::kPreForward)).ok());
  PostForwardParams po;
  po.spec = &spec;
  po.tokens = count;
  po.act_dtype = dt;
  po.f = fs.dev;
  po.x = xs.dev;
  po.h_post = hq.f(1);
  po.h_res = hr.f(1);
  po.weights = lw;
  po.x_next = xn.dev;
  EXPECT_TRUE(cuda.PostForward(po, ws(OpKind::kPostForward)).ok());
  PostBackwardParams pb;
  pb.spec = &spec;
  pb.tokens = count;
  pb.act_dtype = dt;
  pb.dx_next = gs.dev;
  pb.f = fs.dev;
  pb.x = xs.dev;
  pb.h_post = hq.f(1);
  pb.h_res = hr.f(1);
  pb.weights = lw;
  pb.df = df.dev;
  pb.dx = dxp.dev;
  pb.dh_post = dhq.f(1);
  pb.dh_res = dhr.f(1);
  pb.grads = lg;
  EXPECT_TRUE(cuda.PostBackward(pb, ws(OpKind::kPostBackward)).ok());
  void* dx_next = gs.dev;
  if (dx_next_shift > 0) {
    Pair shifted = h.Output(gs.bytes + dx_next_shift);
    dx_next = static_cast<char*>(shifted.dev) + dx_next_shift;
    EXPECT_TRUE(cuda.CopyToDevice(dx_next, gs.host.data(), gs.bytes).ok());
  }
  PreBackwardParams qb;
  qb.spec = &spec;
  qb.tokens = count;
  qb.act_dtype = dt;
  qb.x = xs.dev;
  qb.weights = lw;
  qb.dy = dys.dev;
  qb.dh_post = dhq.f(1);
  qb.dh_res = dhr.f(1);
  qb.dx_next = dx_next;
  qb.dx = dx.dev;
  qb.grads = lg;
  qb.h = pf.h;
  qb.mean_square = pf.mean_square;
  EXPECT_TRUE(cuda.PreBackward(qb, ws(OpKind::kPreBackward)).ok());
  EXPECT_TRUE(cuda.Synchronize().ok());
  LayerRun r;
  r.y = h.Fetch(y);
  r.h_post = h.Fetch(hq);
  r.h_res = h.Fetch(hr);
  r.x_next = h.Fetch(xn);
  r.dx = h.Fetch(dx);
  r.dx_post = h.Fetch(dxp);
  r.df = h.Fetch(df);
  r.dh_res = h.Fetch(dhr);
  std::vector<uint8_t> grads = h.Fetch(g);
  r.dphi.assign(grads.begin(), grads.begin() + N * K * 4);
  r.dbeta.assign(grads.begin() + (N * K + 3) * 4,
                 grads.begin() + (N * K + 3 + N) * 4);
  return r;
}

// Bytes of token `t` of a [M, width] tensor of `es`-byte elements.
std::vector<uint8_t> Row(const std::vector<uint8_t>& v, int64_t t,
                         int64_t width, size_t es) {
  return std::vector<uint8_t>(v.begin() + t * width * es,
                              v.begin() + (t + 1) * width * es);
}

TEST_P(CudaDeterminismTest, BitwiseRepeatableAndBatchInvariant) {
  // Cases: (n, C, M, dtype, preset); M spans several token chunks.
  struct Case {
    int n;
    int64_t C, M;
    DType dt;
    const char* preset;
  };
  const Case cases[] = {
      {4, 1024, 2600, DType::kBF16, "deepseek_v4"},
      // The pre backward on the mma kernel (128 x 3 CTAs), single tokens on
      // wgmma_n4_terms: the same dx bits.
      {4, 4096, 2100, DType::kBF16, "deepseek_v4"},
      {4, 5129, 137, DType::kF16, "transformer_engine"},
      {3, 96, 1300, DType::kF32, "liger"},
      {16, 17, 137, DType::kBF16, "megatron"},
      {8, 264, 600, DType::kBF16, "liger"},  // the post on tensor cores
      // The wide dx / dphi kernels on channel tiles, two token chunks.
      {16, 264, 1100, DType::kBF16, "deepseek_v4"},
      // The backward mixing one thread per token past kQuadMixMaxTokens,
      // single tokens on quads of lanes: the same bits.
      {4, 64, cuda::kQuadMixMaxTokens + 5, DType::kBF16, "deepseek_v4"},
      // One token chunk split over four CTAs, one per SM.
      {4, 1024, 600, DType::kBF16, "deepseek_v4"},
  };
  const Case& c = cases[GetParam()];
  LayerSpec spec = PresetSpec(c.preset, c.n, c.C).value();
  spec.has_gamma = true;
  spec.has_post_bias = true;
  SCOPED_TRACE(CaseName(spec, c.M, c.dt));
  const int64_t K = spec.K(), C = c.C, N = spec.NumLogits(), n = c.n;
  const size_t es = DTypeSize(c.dt);
  ActTensor x = RandomAct(c.dt, c.M * K, FreshSeed());
  ActTensor f = RandomAct(c.dt, c.M * C, FreshSeed());
  ActTensor dxn = RandomAct(c.dt, c.M * K, FreshSeed());
  ActTensor dy = RandomAct(c.dt, c.M * C, FreshSeed());
  const std::vector<float> params = RandomParams(K, N, C);

  Harness h;
  const LayerRun a = RunLayer(h, spec, c.dt, x, f, dxn, dy, params, 0, c.M);
  const LayerRun b = RunLayer(h, spec, c.dt, x, f, dxn, dy, params, 0, c.M);
  EXPECT_EQ(a.y, b.y);
  EXPECT_EQ(a.h_res, b.h_res);
  EXPECT_EQ(a.x_next, b.x_next);
  EXPECT_EQ(a.dx, b.dx);
  EXPECT_EQ(a.dx_post, b.dx_post);
  EXPECT_EQ(a.dphi, b.dphi) << "parameter gradients must be deterministic";
  EXPECT_EQ(a.dbeta, b.dbeta);
  // The kept projection is the recompute's bits: the same layer, the same
  // bits.
  const LayerRun kept =
      RunLayer(h, spec, c.dt, x, f, dxn, dy, params, 0, c.M, true);
  EXPECT_EQ(kept.y, a.y);
  EXPECT_EQ(kept.dx, a.dx) << "pre backward from the kept projection";
  EXPECT_EQ(kept.dphi, a.dphi);
  EXPECT_EQ(kept.dbeta, a.dbeta);

  for (int64_t t : {int64_t{0}, c.M / 2, c.M - 1}) {
    SCOPED_TRACE(absl::StrCat("token ", t));
    const LayerRun one = RunLayer(h, spec, c.dt, x, f, dxn, dy, params, t, 1);
    EXPECT_EQ(one.y, Row(a.y, t, C, es));
    EXPECT_EQ(one.h_post, Row(a.h_post, t, n, 4));
    EXPECT_EQ(one.h_res, Row(a.h_res, t, n * n, 4));
    EXPECT_EQ(one.x_next, Row(a.x_next, t, K, es));
    EXPECT_EQ(one.dx, Row(a.dx, t, K, es));
    EXPECT_EQ(one.dx_post, Row(a.dx_post, t, K, es));
    EXPECT_EQ(one.df, Row(a.df, t, C, es));
    EXPECT_EQ(one.dh_res, Row(a.dh_res, t, n * n, 4));
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaDeterminismTest, ::testing::Range(0, 9));

// The n = 4 pre backward's dx kernel takes its stages by tensor copies where
// every tensor sits on 16 bytes, else by realigned cp.async slots (here
// dx_next 8 bytes off, which only this kernel reads): the same dx and
// gradient bits. A partial channel tile (C = 1032, a last CTA of 8
// channels) and a partial last stage, IEEE (M = 1100) and TF32 (M = 8200,
// past the warpgroup kernel's CTAs), bf16 and fp16; the IEEE tensor copies
// against the reference too.
TEST(CudaFusedN4Test, DxTensorCopiesMatchSlotCopies) {
  MHC_SKIP_WITHOUT_GPU();
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (MatmulPrecision prec :
         {MatmulPrecision::kIeee, MatmulPrecision::kTf32}) {
      LayerSpec spec = PresetSpec("deepseek_v4", 4, 1032).value();
      spec.matmul_precision = prec;
      spec.has_gamma = true;
      spec.has_post_bias = true;
      const int64_t M = prec == MatmulPrecision::kIeee ? 1100 : 8200;
      SCOPED_TRACE(CaseName(spec, M, dt));
      if (prec == MatmulPrecision::kIeee) CheckPreLayer(spec, M, dt);
      const int64_t K = spec.K(), C = spec.hidden, N = spec.NumLogits();
      ActTensor x = RandomAct(dt, M * K, FreshSeed());
      ActTensor f = RandomAct(dt, M * C, FreshSeed());
      ActTensor dxn = RandomAct(dt, M * K, FreshSeed());
      ActTensor dy = RandomAct(dt, M * C, FreshSeed());
      const std::vector<float> params = RandomParams(K, N, C);
      Harness h;
      const LayerRun tensor =
          RunLayer(h, spec, dt, x, f, dxn, dy, params, 0, M);
      const LayerRun slots =
          RunLayer(h, spec, dt, x, f, dxn, dy, params, 0, M, false, 8);
      EXPECT_EQ(tensor.dx, slots.dx) << "dx differs between the copy forms";
      EXPECT_EQ(tensor.dphi, slots.dphi);
      EXPECT_EQ(tensor.dbeta, slots.dbeta);
    }
  }
}

// At odd C and the other C off 8 (rows off 16 bytes) with every base on 16
// bytes, the same kernel takes its stages by tensor copies of each row
// residue (DxRowCopy::kRunMaps), else by the slots (dx_next 8 bytes off
// here): the same dx and gradient bits. Row groups of every size (x rows
// of 4 C: 2 at odd C, 1 otherwise; dy rows of C: 8, 4, 2), partial channel
// tiles and last stages, odd M, the fewest tokens the maps take, dx apart
// from dphi (C = 1036, M = 2100: dphi alone on the slots, dx on the maps),
// bf16 and fp16, IEEE and TF32; the IEEE run maps against the reference.
class CudaDxRunMapsTest : public ::testing::TestWithParam<int> {};

TEST_P(CudaDxRunMapsTest, MatchSlotCopies) {
  MHC_SKIP_WITHOUT_GPU();
  struct Case {
    int64_t C, M;
  };
  const Case cases[] = {{5129, 1001}, {1030, 8}, {1036, 2100}, {1027, 67}};
  const Case c = cases[GetParam()];
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (MatmulPrecision prec :
         {MatmulPrecision::kIeee, MatmulPrecision::kTf32}) {
      LayerSpec spec = PresetSpec("deepseek_v4", 4, c.C).value();
      spec.matmul_precision = prec;
      spec.has_gamma = true;
      spec.has_post_bias = true;
      SCOPED_TRACE(CaseName(spec, c.M, dt));
      cuda::DxTerms both;
      both.aggregate = both.residual = true;
      ASSERT_EQ(cuda::PlanProjectionBackward(spec, dt, c.M, {}, both).row_copy,
                cuda::DxRowCopy::kRunMaps);
      if (prec == MatmulPrecision::kIeee && dt == DType::kBF16) {
        CheckPreLayer(spec, c.M, dt);
      }
      const int64_t K = spec.K(), C = spec.hidden, N = spec.NumLogits();
      ActTensor x = RandomAct(dt, c.M * K, FreshSeed());
      ActTensor f = RandomAct(dt, c.M * C, FreshSeed());
      ActTensor dxn = RandomAct(dt, c.M * K, FreshSeed());
      ActTensor dy = RandomAct(dt, c.M * C, FreshSeed());
      const std::vector<float> params = RandomParams(K, N, C);
      Harness h;
      const LayerRun maps =
          RunLayer(h, spec, dt, x, f, dxn, dy, params, 0, c.M);
      const LayerRun slots =
          RunLayer(h, spec, dt, x, f, dxn, dy, params, 0, c.M, false, 8);
      EXPECT_EQ(maps.dx, slots.dx) << "dx differs between the copy forms";
      EXPECT_EQ(maps.dphi, slots.dphi);
      EXPECT_EQ(maps.dbeta, slots.dbeta);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaDxRunMapsTest, ::testing::Range(0, 4));

// The mma dx / dphi kernel runs dphi and dx apart while its CTAs (128
// columns x 1024 tokens) number fewer than an H200's SMs (the plan's
// dx_apart_tokens; fp32, which 16-bit n = 4 layers' wgmma_n4_terms does not
// take: n = 4, C = 1024, M = 4096 on 32 x 4, dx over 128-token
// chunks; M = 512 and 200, dx over 64- and 32-token chunks) and together
// above (M = 4100: 32 x 5). The four tokens past 4096 have no upstream
// gradient, so they add a zero dphi partial: phi's gradient and the first
// rows of dx keep their bits across the two forms; so do the first rows of
// dx at every chunk.
TEST(CudaFusedApartTest, DxAndDphiApartKeepTheirBits) {
  MHC_SKIP_WITHOUT_GPU();
  LayerSpec spec = PresetSpec("deepseek_v4", 4, 1024).value();
  spec.has_gamma = true;
  spec.has_post_bias = true;
  const DType dt = DType::kF32;
  const int64_t M = 4096, total = M + 4;
  const int64_t K = spec.K(), C = spec.hidden, N = spec.NumLogits();
  const size_t es = DTypeSize(dt);
  ActTensor x = RandomAct(dt, total * K, FreshSeed());
  ActTensor f = RandomAct(dt, total * C, FreshSeed());
  ActTensor dxn = RandomAct(dt, total * K, FreshSeed());
  ActTensor dy = RandomAct(dt, total * C, FreshSeed());
  std::fill(dxn.bytes.begin() + M * K * es, dxn.bytes.end(), 0);
  std::fill(dy.bytes.begin() + M * C * es, dy.bytes.end(), 0);
  const std::vector<float> params = RandomParams(K, N, C);

  Harness h;
  const LayerRun together =
      RunLayer(h, spec, dt, x, f, dxn, dy, params, 0, total);
  for (const int64_t m : {M, int64_t{512}, int64_t{200}}) {
    SCOPED_TRACE(m);
    const LayerRun apart = RunLayer(h, spec, dt, x, f, dxn, dy, params, 0, m);
    if (m == M) {
      EXPECT_EQ(apart.dphi, together.dphi) << "dphi differs between the forms";
    }
    const std::vector<uint8_t> rows(together.dx.begin(),
                                    together.dx.begin() + m * K * es);
    EXPECT_EQ(apart.dx, rows) << "dx differs between the forms";
  }
}

TEST(CudaBackendTest, NameAndZeroTokens) {
  MHC_SKIP_WITHOUT_GPU();
  Harness h;
  EXPECT_EQ(h.cuda().Name(), "cuda");
  EXPECT_FALSE(h.cuda().HostAccessible());
  LayerSpec spec = PresetSpec("deepseek_v4", 4, 64).value();
  EXPECT_EQ(
      h.cuda().WorkspaceBytes(OpKind::kPreBackward, spec, 0, DType::kBF16), 0u);
  PreForwardParams p;
  p.spec = &spec;
  p.tokens = 0;
  EXPECT_TRUE(h.cuda().PreForward(p, Workspace{}).ok());
}

}  // namespace
}  // namespace mhc::testing
