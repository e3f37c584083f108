// The tensor-core projection kernels at their tiling edges, forward and
// backward, against the float64 reference; batch invariance of per-token
// results and run-to-run determinism of the parameter gradients. Skips
// without a GPU.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_cases.h"
#include "cuda/cuda_harness.h"
#include "gtest/gtest.h"
#include "projection/plan.h"

namespace mhc::testing {
namespace {

// A case's layer: deepseek_v4 at n streams and width C, the case's
// precision, with or without gamma, a head or an mHC layer.
LayerSpec CaseLayer(int n, int64_t C, MatmulPrecision prec, bool gamma,
                    bool head) {
  LayerSpec spec = PresetSpec("deepseek_v4", n, C).value();
  spec.matmul_precision = prec;
  spec.has_gamma = gamma;
  if (head) spec.kind = LayerKind::kHead;
  return spec;
}

// Fresh projection inputs: x [M, K], phi [N, K] at the 1/sqrt(K) scale of a
// trained layer, gamma [K] around 1.
struct ProjectionInputs {
  Pair x, phi, gamma;
};
ProjectionInputs MakeInputs(Harness& h, const LayerSpec& spec, DType dt,
                            int64_t M) {
  const int64_t K = spec.K();
  const float scale = 1.0f / std::sqrt(static_cast<float>(K));
  ProjectionInputs in;
  in.x = h.Act(dt, M * K, FreshSeed());
  in.phi = h.Floats(spec.NumLogits() * K, FreshSeed(), -scale, scale);
  in.gamma = h.Floats(K, FreshSeed(), 0.5f, 1.5f);
  return in;
}

// A workspace holds whatever the op before it left: the CUDA forward's is
// poisoned, so that a forward reading a byte it did not write first (the
// units' work counter, which its first kernel zeroes) fails.
void PoisonWorkspace(Harness& h, const Workspace& ws) {
  if (ws.bytes == 0) return;
  ASSERT_TRUE(h.cuda().Memset(ws.data, 0xFF, ws.bytes).ok());
}

// The fields the forward and backward params share, for backend b.
template <typename Params>
void SetInputs(Params& p, const LayerSpec& spec, int64_t M, DType dt,
               ProjectionInputs& in, int b) {
  p.spec = &spec;
  p.tokens = M;
  p.act_dtype = dt;
  p.x = in.x.ptr(b);
  p.weights.phi = in.phi.f(b);
  p.weights.gamma = in.gamma.f(b);
}

// The tensor-core projection tiles at tiling edge cases: the widest K split
// (C = 12288) over many tiles, odd C (unaligned rows), partial tiles, n = 1 /
// 2 / 4, n = 5 to 16 (several logit groups, GEMM tiles) and heads, tf32 and
// ieee, bf16 batches large and small; then batch invariance: the rows of a
// slice of the batch (a different M and row alignment) and a single token
// are bitwise unchanged.
TEST(CudaProjectionTilesTest, MatchesReferenceAndIsBatchInvariant) {
  MHC_SKIP_WITHOUT_GPU();
  struct Case {
    int n;
    int64_t C, M;
    DType dt;
    MatmulPrecision prec;
    bool gamma, head;
  };
  const Case cases[] = {
      {4, 12288, 2048, DType::kBF16, MatmulPrecision::kTf32, false, false},
      {4, 1024, 3000, DType::kBF16, MatmulPrecision::kIeee, true, false},
      {4, 1031, 2000, DType::kBF16, MatmulPrecision::kTf32, true, false},
      {8, 2000, 300, DType::kBF16, MatmulPrecision::kTf32, true, false},
      {16, 700, 150, DType::kF32, MatmulPrecision::kIeee, false, false},
      {4, 12288, 300, DType::kBF16, MatmulPrecision::kIeee, true, false},
      {4, 5129, 300, DType::kBF16, MatmulPrecision::kIeee, true, false},
      {4, 5129, 137, DType::kF32, MatmulPrecision::kIeee, false, false},
      {4, 4096, 129, DType::kF32, MatmulPrecision::kTf32, true, false},
      {2, 4096, 257, DType::kF16, MatmulPrecision::kIeee, true, false},
      {1, 777, 200, DType::kBF16, MatmulPrecision::kIeee, false, false},
      {2, 1037, 300, DType::kBF16, MatmulPrecision::kTf32, true, false},
      {16, 1000, 150, DType::kBF16, MatmulPrecision::kIeee, true, true},
      // More units (313) than an H100 / H200 holds CTAs (264): CTAs take
      // units from the counter, in an order that differs run to run.
      {4, 512, 40000, DType::kBF16, MatmulPrecision::kTf32, false, false},
      // The same with four K chunks (564 bf16 units) and three phi' terms.
      {4, 2048, 9000, DType::kBF16, MatmulPrecision::kIeee, true, false},
      // Whole units (136), then a token alone on units split over clusters
      // of 8 CTAs, the last chunk's (31 stages) with a short last group.
      {4, 1000, 4300, DType::kBF16, MatmulPrecision::kTf32, true, false},
      // The GEMM tiles of wide layers (projection/forward/mma_wide.cu and, for
      // TF32 with aligned rows, projection/forward/wgmma_tf32_wide.cu): 3 and 2
      // mma tiles per warp, three K chunks (n = 16, C = 4096), several logit
      // groups, odd K and unaligned rows (element copies), odd N, IEEE with
      // bf16 and fp32 x, and more units (314) than CTAs (n = 9, M = 20000).
      {16, 4096, 140, DType::kBF16, MatmulPrecision::kTf32, true, false},
      {16, 5129, 150, DType::kBF16, MatmulPrecision::kIeee, true, false},
      {12, 333, 137, DType::kF16, MatmulPrecision::kTf32, false, false},
      {9, 1000, 1000, DType::kBF16, MatmulPrecision::kIeee, true, false},
      {9, 64, 20000, DType::kBF16, MatmulPrecision::kTf32, true, false},
      {7, 520, 2000, DType::kF32, MatmulPrecision::kTf32, true, false},
      {7, 777, 200, DType::kBF16, MatmulPrecision::kTf32, true, false},
      {8, 300, 300, DType::kF32, MatmulPrecision::kIeee, true, false},
      // Their warpgroup-mma form (TF32, aligned rows;
      // projection/forward/wgmma_tf32_wide.cu) without gamma: fp16 x in two
      // groups of 96 logits, 144-logit units with a last tile of one token.
      {12, 336, 137, DType::kF16, MatmulPrecision::kTf32, false, false},
      {9, 1024, 129, DType::kBF16, MatmulPrecision::kTf32, false, false},
      // The 80-logit bf16 tiles (n = 7, 8;
      // projection/forward/wgmma_bf16_wide.cu): gamma and none, a partial last
      // stage (C = 1029), IEEE, 63 logits, more units (144 at n = 8, C = 4096,
      // M = 3000) than CTAs.
      {8, 1024, 7000, DType::kBF16, MatmulPrecision::kTf32, true, false},
      {8, 1029, 650, DType::kBF16, MatmulPrecision::kIeee, true, false},
      {8, 4096, 3000, DType::kBF16, MatmulPrecision::kTf32, false, false},
      {7, 1024, 300, DType::kBF16, MatmulPrecision::kTf32, true, false},
      // The TF32 units of fp16 / fp32 x (projection/forward/wgmma_tf32.cu):
      // more units (632) than CTAs, a partial last stage (C = 1000) on the
      // deep ring, n = 2, a head, the widest K split.
      {4, 4096, 5000, DType::kF16, MatmulPrecision::kTf32, true, false},
      {4, 1000, 129, DType::kF32, MatmulPrecision::kTf32, false, false},
      {4, 1000, 700, DType::kF16, MatmulPrecision::kTf32, false, false},
      {2, 4096, 257, DType::kF32, MatmulPrecision::kTf32, true, false},
      {16, 1000, 150, DType::kF32, MatmulPrecision::kTf32, true, true},
      {4, 12288, 2048, DType::kF16, MatmulPrecision::kTf32, false, false},
  };
  for (const Case& c : cases) {
    LayerSpec spec = CaseLayer(c.n, c.C, c.prec, c.gamma, c.head);
    const int64_t M = c.M, K = spec.K(), N = spec.NumLogits();
    SCOPED_TRACE(CaseName(spec, M, c.dt));
    Harness h;
    ProjectionInputs in = MakeInputs(h, spec, c.dt, M);
    Pair& x = in.x;
    Pair hh = h.Output(M * N * 4);
    Pair ms = h.Output(M * 4);
    ProjectionForwardParams p[2];
    for (int b = 0; b < 2; ++b) {
      SetInputs(p[b], spec, M, c.dt, in, b);
      p[b].h = hh.f(b);
      p[b].mean_square = ms.f(b);
    }
    for (int b = 0; b < 2; ++b) {
      Workspace ws = h.Scratch(b, OpKind::kProjectionForward, spec, M, c.dt);
      if (b == 1) PoisonWorkspace(h, ws);
      ASSERT_TRUE(h.backend(b).ProjectionForward(p[b], ws).ok());
    }
    ASSERT_TRUE(h.cuda().Synchronize().ok());
    const double tol = c.prec == MatmulPrecision::kIeee ? 1e-5 : 2e-3;
    ExpectClose(h, hh, DType::kF32, M * N, tol, false, "h");
    ExpectClose(h, ms, DType::kF32, M, 1e-5, false, "mean square");

    const int64_t first = 37, count = M - 60;
    Pair hs = h.Output(count * N * 4);
    Pair mss = h.Output(count * 4);
    ProjectionForwardParams q = p[1];
    q.tokens = count;
    q.x = static_cast<const char*>(x.dev) + first * K * DTypeSize(c.dt);
    q.h = hs.f(1);
    q.mean_square = mss.f(1);
    // On the CUDA backend alone, with the workspace its token count needs.
    auto run_alone = [&](const ProjectionForwardParams& p1) {
      Workspace ws =
          h.Scratch(1, OpKind::kProjectionForward, spec, p1.tokens, c.dt);
      PoisonWorkspace(h, ws);
      ASSERT_TRUE(h.cuda().ProjectionForward(p1, ws).ok());
      ASSERT_TRUE(h.cuda().Synchronize().ok());
    };
    run_alone(q);
    const std::vector<uint8_t> full = h.Fetch(hh), part = h.Fetch(hs);
    const std::vector<uint8_t> full_ms = h.Fetch(ms), part_ms = h.Fetch(mss);
    EXPECT_EQ(
        std::memcmp(full.data() + first * N * 4, part.data(), count * N * 4), 0)
        << "h changed with the batch";
    EXPECT_EQ(
        std::memcmp(full_ms.data() + first * 4, part_ms.data(), count * 4), 0)
        << "mean square changed with the batch";

    ProjectionForwardParams one = q;
    one.tokens = 1;
    run_alone(one);
    const std::vector<uint8_t> alone = h.Fetch(hs), alone_ms = h.Fetch(mss);
    EXPECT_EQ(std::memcmp(full.data() + first * N * 4, alone.data(), N * 4), 0)
        << "h of a token alone differs from the batch";
    EXPECT_EQ(std::memcmp(full_ms.data() + first * 4, alone_ms.data(), 4), 0)
        << "mean square of a token alone differs from the batch";
  }
}

// The wide TF32 units of two logit groups take phi' rounded once per launch
// from a wave of units (264) where the rounded rows fit the forward
// scratch's share, and round it per unit below: n = 12 at C = 3000, fp32 (3
// K chunks x 2 groups) and M = 5600 (44 tiles, 264 units) against 1024
// tokens of it (48 units) and a token alone, bit for bit. No float64
// reference at this size (minutes on the CPU): the per-unit form is held to
// it above.
TEST(CudaProjectionTilesTest, WideRoundedOnceMatchesPerUnitBits) {
  MHC_SKIP_WITHOUT_GPU();
  const LayerSpec spec =
      CaseLayer(12, 3000, MatmulPrecision::kTf32, true, false);
  constexpr DType kDt = DType::kF32;
  const int64_t M = 5600, K = spec.K(), N = spec.NumLogits();
  // The two forms this compares: rounded once for the batch, per unit for
  // the part of it.
  ASSERT_GT(cuda::PlanProjectionForward(spec, kDt, M, {}).workspace.phi_rounded,
            0u);
  ASSERT_EQ(
      cuda::PlanProjectionForward(spec, kDt, 1024, {}).workspace.phi_rounded,
      0u);
  Harness h;
  ProjectionInputs in = MakeInputs(h, spec, kDt, M);
  // h and the mean square of tokens [first, first + tokens), run alone.
  auto run = [&](int64_t first, int64_t tokens) {
    Pair hh = h.Output(tokens * N * 4);
    Pair ms = h.Output(tokens * 4);
    ProjectionForwardParams p;
    SetInputs(p, spec, tokens, kDt, in, 1);
    p.x = static_cast<const char*>(in.x.dev) + first * K * DTypeSize(kDt);
    p.h = hh.f(1);
    p.mean_square = ms.f(1);
    Workspace ws = h.Scratch(1, OpKind::kProjectionForward, spec, tokens, kDt);
    EXPECT_TRUE(h.cuda().ProjectionForward(p, ws).ok());
    EXPECT_TRUE(h.cuda().Synchronize().ok());
    std::vector<uint8_t> out = h.Fetch(hh);
    const std::vector<uint8_t> m = h.Fetch(ms);
    out.insert(out.end(), m.begin(), m.end());
    return out;
  };
  const std::vector<uint8_t> full = run(0, M), part = run(40, 1024),
                             one = run(77, 1);
  for (int64_t m = 40; m < 40 + 1024; ++m) {
    ASSERT_EQ(std::memcmp(full.data() + m * N * 4,
                          part.data() + (m - 40) * N * 4, N * 4),
              0)
        << "h of token " << m;
    ASSERT_EQ(std::memcmp(full.data() + (M * N + m) * 4,
                          part.data() + (1024 * N + m - 40) * 4, 4),
              0)
        << "mean square of token " << m;
  }
  EXPECT_EQ(std::memcmp(full.data() + 77 * N * 4, one.data(), N * 4), 0);
  EXPECT_EQ(std::memcmp(full.data() + (M * N + 77) * 4, one.data() + N * 4, 4),
            0);
}

// The bf16 warpgroup-mma units take x rows on 16 bytes by tensor copies
// (one thread, the copy engine swizzling and zero-filling) and rows 8 or 4
// bytes off by every thread's cp.async pieces: the same bits every way. x
// is placed on 16 bytes, 8 bytes off and 4 bytes off (4-byte pieces). At odd
// C rows alternate between 16 and 8 bytes off: on 16 bytes they come by
// tensor copies of the even rows and of token pairs, else by 8-byte pieces,
// both against the 4-byte ones. Cases: IEEE (three phi' terms), a K past the
// last 64-k block (C = 1000: zeros past K), a small batch with a wide K
// (these three with fewer units than SMs: the tensor copies split each
// unit's flush groups over a cluster, two groups a CTA), more units than
// CTAs; odd C with odd batches (a last even token without its pair) and
// even ones: a last stage of 4 columns (C = 1025), of 36 (C = 5129) over
// more units than CTAs and a partial last tile, IEEE, and a single pair.
TEST(CudaProjectionTilesTest, TensorCopiesMatchThreadCopies) {
  MHC_SKIP_WITHOUT_GPU();
  struct Case {
    int64_t C, M;
    MatmulPrecision prec;
    bool gamma;
  };
  const Case cases[] = {
      {1024, 3000, MatmulPrecision::kIeee, true},
      {1000, 2100, MatmulPrecision::kTf32, true},
      {12288, 77, MatmulPrecision::kTf32, false},
      {512, 40000, MatmulPrecision::kTf32, true},
      {1025, 3001, MatmulPrecision::kTf32, true},
      {5129, 701, MatmulPrecision::kIeee, false},
      {1025, 3002, MatmulPrecision::kTf32, true},
      {5129, 4098, MatmulPrecision::kTf32, true},
      {5129, 702, MatmulPrecision::kIeee, false},
      {1029, 2, MatmulPrecision::kTf32, true},
  };
  constexpr int kOffsets[] = {0, 8, 4};  // bytes past a 16-byte boundary
  for (const Case& c : cases) {
    LayerSpec spec = CaseLayer(4, c.C, c.prec, c.gamma, false);
    const int64_t M = c.M, K = spec.K(), N = spec.NumLogits();
    SCOPED_TRACE(CaseName(spec, M, DType::kBF16));
    Harness h;
    ProjectionInputs in = MakeInputs(h, spec, DType::kBF16, M);
    std::vector<uint8_t> h_rows[3], ms_rows[3];
    for (int run = 0; run < 3; ++run) {
      SCOPED_TRACE(absl::StrCat("x ", kOffsets[run], " bytes off 16"));
      Pair placed = h.Output(M * K * 2 + 16);
      char* x_at = static_cast<char*>(placed.dev) + kOffsets[run];
      ASSERT_TRUE(
          h.cuda().CopyToDevice(x_at, in.x.host.data(), in.x.bytes).ok());
      Pair hh = h.Output(M * N * 4), ms = h.Output(M * 4);
      ProjectionForwardParams p;
      SetInputs(p, spec, M, DType::kBF16, in, 1);
      p.x = x_at;
      p.h = hh.f(1);
      p.mean_square = ms.f(1);
      Workspace ws =
          h.Scratch(1, OpKind::kProjectionForward, spec, M, DType::kBF16);
      ASSERT_TRUE(h.cuda().ProjectionForward(p, ws).ok());
      ASSERT_TRUE(h.cuda().Synchronize().ok());
      h_rows[run] = h.Fetch(hh);
      ms_rows[run] = h.Fetch(ms);
      if (run == 0) continue;
      EXPECT_EQ(h_rows[0], h_rows[run]) << "h differs between the copy forms";
      EXPECT_EQ(ms_rows[0], ms_rows[run])
          << "mean square differs between the copy forms";
    }
  }
}

struct BackwardCase {
  int n;
  int64_t C, M;
  DType dt;
  MatmulPrecision prec;
  bool gamma, head, minor;
};

// dx and the phi / gamma gradients against the reference; then dx of a
// slice of the batch is bitwise the full batch's rows, and a second run
// accumulates bitwise the same gradients.
void CheckBackward(const BackwardCase& c) {
  LayerSpec spec = CaseLayer(c.n, c.C, c.prec, c.gamma, c.head);
  if (c.minor) spec.layout = Layout::kStreamMinor;
  const int64_t M = c.M, K = spec.K(), N = spec.NumLogits();
  const size_t es = DTypeSize(c.dt);
  SCOPED_TRACE(CaseName(spec, M, c.dt));
  Harness h;
  ProjectionInputs in = MakeInputs(h, spec, c.dt, M);
  Pair& x = in.x;
  Pair dh = h.Floats(M * N, FreshSeed());
  Pair dms = h.Floats(M, FreshSeed());
  Pair dx = h.Output(M * K * es);
  const std::vector<float> zeros_phi(N * K, 0.0f), zeros_gamma(K, 0.0f);
  Pair gphi = h.Input(zeros_phi.data(), N * K * 4);
  Pair ggamma = h.Input(zeros_gamma.data(), K * 4);
  ProjectionBackwardParams p[2];
  for (int b = 0; b < 2; ++b) {
    SetInputs(p[b], spec, M, c.dt, in, b);
    p[b].dh = dh.f(b);
    p[b].dmean_square = dms.f(b);
    p[b].dx = dx.ptr(b);
    p[b].grads.phi = gphi.f(b);
    p[b].grads.gamma = ggamma.f(b);
  }
  for (int b = 0; b < 2; ++b) {
    Workspace ws = h.Scratch(b, OpKind::kProjectionBackward, spec, M, c.dt);
    ASSERT_TRUE(h.backend(b).ProjectionBackward(p[b], ws).ok());
  }
  ASSERT_TRUE(h.cuda().Synchronize().ok());
  const bool ieee = c.prec == MatmulPrecision::kIeee;
  const double dx_tol = c.dt != DType::kF32 ? 1e-2 : ieee ? 1e-4 : 2e-3;
  const double grad_tol = ieee ? kMixTol : 2e-3;
  ExpectClose(h, dx, c.dt, M * K, dx_tol, false, "dx");
  ExpectClose(h, gphi, DType::kF32, N * K, grad_tol, false, "dphi");
  if (c.gamma) {
    ExpectClose(h, ggamma, DType::kF32, K, grad_tol, false, "dgamma");
  }

  // Batch invariance of dx: a slice starting at an odd token.
  const int64_t first = 37, count = M - 60;
  Pair dxs = h.Output(count * K * es);
  ProjectionBackwardParams q = p[1];
  q.tokens = count;
  q.x = static_cast<const char*>(x.dev) + first * K * es;
  q.dh = dh.f(1) + first * N;
  q.dmean_square = dms.f(1) + first;
  q.dx = dxs.dev;
  q.grads = LayerGrads{};
  {
    // No gradients: the scratch of the wide kernels alone, where they run.
    Workspace ws = h.Scratch(1, OpKind::kProjectionBackward, spec, count, c.dt);
    ASSERT_TRUE(h.cuda().ProjectionBackward(q, ws).ok());
  }
  // Determinism: the same request into fresh zero gradients.
  Pair gphi2 = h.Input(zeros_phi.data(), N * K * 4);
  Pair ggamma2 = h.Input(zeros_gamma.data(), K * 4);
  ProjectionBackwardParams again = p[1];
  again.dx = h.Output(M * K * es).dev;
  again.grads.phi = gphi2.f(1);
  again.grads.gamma = ggamma2.f(1);
  {
    Workspace ws = h.Scratch(1, OpKind::kProjectionBackward, spec, M, c.dt);
    ASSERT_TRUE(h.cuda().ProjectionBackward(again, ws).ok());
  }
  ASSERT_TRUE(h.cuda().Synchronize().ok());
  const std::vector<uint8_t> full = h.Fetch(dx), part = h.Fetch(dxs);
  EXPECT_EQ(
      std::memcmp(full.data() + first * K * es, part.data(), count * K * es), 0)
      << "dx changed with the batch";
  EXPECT_EQ(h.Fetch(gphi), h.Fetch(gphi2)) << "dphi not deterministic";
  EXPECT_EQ(h.Fetch(ggamma), h.Fetch(ggamma2)) << "dgamma not deterministic";
}

// The register-resident tensor-core dx / dphi kernel: token chunks with a
// partial last stage, CTA column tiles past the last channel, odd C
// (unaligned slots), both layouts, n = 1 / 2 / 4 / 8 layers and n = 8 / 16
// heads, tf32 and ieee, every dtype; and the warpgroup-mma ones (TF32,
// stream-major, 16-bit rows on 16 bytes) of n = 8 layers (C = 1000 with
// gamma, C = 1024 without, fp16, three token chunks) and of n = 4 layers
// (C = 4096 with gamma, a partial last stage; C = 1000 without, fp16, a
// partial channel tile, two stages in the last chunk; chunks split over four
// CTAs at C = 1000, M = 1034, two per SM, the last chunk's last three with
// no stage, and one per SM at M = 600).
TEST(CudaProjectionTilesTest, BackwardMatchesReferenceAndIsDeterministic) {
  MHC_SKIP_WITHOUT_GPU();
  const BackwardCase cases[] = {
      {4, 4096, 2100, DType::kBF16, MatmulPrecision::kTf32, true, false, false},
      {4, 2048, 1500, DType::kF16, MatmulPrecision::kTf32, false, false, true},
      {4, 1000, 1100, DType::kF32, MatmulPrecision::kTf32, true, false, false},
      {4, 12288, 300, DType::kBF16, MatmulPrecision::kIeee, true, false, false},
      {4, 5129, 300, DType::kBF16, MatmulPrecision::kIeee, true, false, false},
      {4, 5129, 137, DType::kF32, MatmulPrecision::kIeee, false, false, true},
      {2, 4096, 257, DType::kF16, MatmulPrecision::kIeee, true, false, false},
      {1, 777, 1200, DType::kBF16, MatmulPrecision::kTf32, false, false, false},
      {2, 1037, 700, DType::kBF16, MatmulPrecision::kTf32, true, false, false},
      {4, 5129, 700, DType::kF16, MatmulPrecision::kTf32, true, false, true},
      {8, 1037, 300, DType::kBF16, MatmulPrecision::kTf32, true, false, false},
      {16, 1000, 150, DType::kBF16, MatmulPrecision::kIeee, true, true, false},
      {8, 512, 1030, DType::kBF16, MatmulPrecision::kTf32, true, true, true},
      {8, 1000, 1100, DType::kBF16, MatmulPrecision::kTf32, true, false, false},
      {8, 520, 300, DType::kF16, MatmulPrecision::kIeee, false, false, true},
      {8, 333, 137, DType::kF32, MatmulPrecision::kIeee, true, false, false},
      {8, 1024, 2100, DType::kF16, MatmulPrecision::kTf32, false, false, false},
      {4, 1000, 1100, DType::kF16, MatmulPrecision::kTf32, false, false, false},
      {4, 1000, 1034, DType::kBF16, MatmulPrecision::kTf32, true, false, false},
      {4, 1000, 600, DType::kBF16, MatmulPrecision::kTf32, true, false, false},
  };
  for (const BackwardCase& c : cases) CheckBackward(c);
}

// The two-kernel one (n = 3 / 5 / 6 / 9 / 12 / 13 / 16 layers): odd N and odd
// K, partial token tiles and chunks, both layouts, tf32 and ieee, every dtype;
// under tf32 with 16-byte rows dphi runs on warpgroup mmas at each of its
// tile widths (144: n = 16, 9; 96: n = 12; 80: n = 13 in three tiles, the
// last past the padded logits, n = 6 and 3), with a partial last column
// tile (n = 9) and fp32 x (n = 12).
TEST(CudaProjectionTilesTest, WideBackwardMatchesReferenceAndIsDeterministic) {
  MHC_SKIP_WITHOUT_GPU();
  const BackwardCase cases[] = {
      {16, 264, 1100, DType::kBF16, MatmulPrecision::kTf32, true, false, false},
      {16, 4096, 70, DType::kBF16, MatmulPrecision::kIeee, true, false, true},
      {16, 333, 137, DType::kF32, MatmulPrecision::kIeee, false, false, true},
      {12, 256, 260, DType::kF32, MatmulPrecision::kTf32, true, false, false},
      {9, 333, 300, DType::kBF16, MatmulPrecision::kTf32, true, false, false},
      {6, 520, 1030, DType::kF16, MatmulPrecision::kIeee, true, false, true},
      {5, 777, 200, DType::kBF16, MatmulPrecision::kIeee, false, false, false},
      {13, 264, 1030, DType::kBF16, MatmulPrecision::kTf32, false, false,
       false},
      {9, 336, 97, DType::kF16, MatmulPrecision::kTf32, true, false, false},
      {6, 520, 1030, DType::kF16, MatmulPrecision::kTf32, true, false, true},
      {3, 1037, 300, DType::kBF16, MatmulPrecision::kTf32, true, false, false},
      {3, 1024, 1030, DType::kF16, MatmulPrecision::kTf32, false, false, true},
      // dphi partials of 2048 tokens (PhiChunkTokens), the second partial.
      {12, 1366, 2100, DType::kBF16, MatmulPrecision::kTf32, true, false,
       false},
  };
  for (const BackwardCase& c : cases) CheckBackward(c);
}

}  // namespace
}  // namespace mhc::testing
