// The row kernels (aggregate, post, expand) and the projection backward on
// activation tensors that start off every vector boundary, which sends the
// row kernels down the strided path of kernels/cuda/row_access.cuh and the
// projection's dx / dphi tiles through primitives/staged_slots.cuh (16-bit rows
// one element off a word realigned on chip): the elementwise outputs and the
// projection's gradients bit for bit those of the vector path on the same
// data, the row kernels' channel sums (summed in another order) within fp32
// rounding, and not a byte written outside the outputs. Odd C against the
// float64 reference is in cuda_ops_test and cuda_projection_test. Where the
// aligned run takes the post's tensor-core path (bf16, stream-major, n = 3
// or more but 4) and the shifted one the FFMA path, the post's outputs are
// compared within bf16 rounding instead. At odd C the 16-bit strided rows
// of tensors on 16 bytes are staged through shared memory
// (primitives/staged_windows.cuh) and those one element off are loaded by
// elements: the same slots, so every row kernel output, channel sums
// included, matches bit for bit. Skips without a GPU.
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_harness.h"
#include "gtest/gtest.h"

namespace mhc::testing {
namespace {

// Poisoned bytes kept after every output, checked after the run.
constexpr size_t kGuardBytes = 32;

// Device copies of a run's tensors, inputs `input_shift` and outputs
// `output_shift` elements past a fresh allocation's (aligned) start.
class Placed {
 public:
  Placed(Harness& h, DType dtype, int input_shift, int output_shift)
      : h_(h),
        elem_(DTypeSize(dtype)),
        input_shift_(input_shift),
        output_shift_(output_shift) {}

  const void* In(const Pair& src) {
    keep_.push_back(h_.Output(input_shift_ * elem_ + src.bytes));
    char* p = static_cast<char*>(keep_.back().dev) + input_shift_ * elem_;
    if (src.bytes > 0) {
      EXPECT_TRUE(h_.cuda().CopyToDevice(p, src.host.data(), src.bytes).ok());
    }
    return p;
  }

  void* Out(const std::string& name, size_t bytes) {
    keep_.push_back(h_.Output(output_shift_ * elem_ + bytes + kGuardBytes));
    outputs_[name] = {keep_.size() - 1, bytes};
    return static_cast<char*>(keep_.back().dev) + output_shift_ * elem_;
  }

  // Every output's bytes; the poison before and after each must be intact.
  std::map<std::string, std::vector<uint8_t>> Results() {
    std::map<std::string, std::vector<uint8_t>> results;
    const size_t before = output_shift_ * elem_;
    for (const auto& [name, where] : outputs_) {
      const std::vector<uint8_t> all = h_.Fetch(keep_[where.first]);
      const size_t bytes = where.second;
      size_t outside = 0;
      for (size_t i = 0; i < all.size(); ++i) {
        if ((i < before || i >= before + bytes) && all[i] != 0xFF) ++outside;
      }
      EXPECT_EQ(outside, 0u) << name << ": bytes written outside the output";
      results[name].assign(all.begin() + before, all.begin() + before + bytes);
    }
    return results;
  }

 private:
  Harness& h_;
  size_t elem_;
  int input_shift_;
  int output_shift_;
  std::vector<Pair> keep_;
  std::map<std::string, std::pair<size_t, size_t>> outputs_;
};

struct RowInputs {
  Pair x, f, dy, dxn, hpre, hpost, hres, bias;
  Pair phi, gamma, dh, dms;  // projection backward
  std::vector<float> dbias_init;
};

// Runs aggregate, post and expand forward and backward and the projection
// backward on the CUDA backend with the tensors placed as `at` says; returns
// every output's bytes.
std::map<std::string, std::vector<uint8_t>> RunRowOps(Harness& h,
                                                      const LayerSpec& spec,
                                                      DType dt, int64_t M,
                                                      RowInputs& in,
                                                      Placed& at) {
  const int64_t n = spec.n, C = spec.hidden, K = spec.K();
  const size_t es = DTypeSize(dt);
  Backend& cuda = h.cuda();
  const void* x = at.In(in.x);
  const void* f = at.In(in.f);
  const void* dy = at.In(in.dy);
  const void* dxn = at.In(in.dxn);
  auto floats = [&](const std::string& name, int64_t count) {
    return static_cast<float*>(at.Out(name, count * 4));
  };
  auto ws = [&](OpKind op) { return h.Scratch(1, op, spec, M, dt); };

  AggregateForwardParams af;
  af.spec = &spec;
  af.tokens = M;
  af.act_dtype = dt;
  af.x = x;
  af.h_pre = in.hpre.f(1);
  af.y = at.Out("aggregate y", M * C * es);
  EXPECT_TRUE(cuda.AggregateForward(af, ws(OpKind::kAggregateForward)).ok());

  AggregateBackwardParams ab;
  ab.spec = &spec;
  ab.tokens = M;
  ab.act_dtype = dt;
  ab.x = x;
  ab.h_pre = in.hpre.f(1);
  ab.dy = dy;
  ab.dx = at.Out("aggregate dx", M * K * es);
  ab.dh_pre = floats("aggregate dh_pre", M * n);
  EXPECT_TRUE(cuda.AggregateBackward(ab, ws(OpKind::kAggregateBackward)).ok());

  PostForwardParams pf;
  pf.spec = &spec;
  pf.tokens = M;
  pf.act_dtype = dt;
  pf.f = f;
  pf.x = x;
  pf.h_post = in.hpost.f(1);
  pf.h_res = in.hres.f(1);
  pf.weights.bias = in.bias.f(1);
  pf.x_next = at.Out("post x_next", M * K * es);
  EXPECT_TRUE(cuda.PostForward(pf, ws(OpKind::kPostForward)).ok());

  Pair dbias = h.Input(in.dbias_init.data(), C * 4);
  PostBackwardParams pb;
  pb.spec = &spec;
  pb.tokens = M;
  pb.act_dtype = dt;
  pb.dx_next = dxn;
  pb.f = f;
  pb.x = x;
  pb.h_post = in.hpost.f(1);
  pb.h_res = in.hres.f(1);
  pb.weights.bias = in.bias.f(1);
  pb.df = at.Out("post df", M * C * es);
  pb.dx = at.Out("post dx", M * K * es);
  pb.dh_post = floats("post dh_post", M * n);
  pb.dh_res = floats("post dh_res", M * n * n);
  pb.grads.bias = dbias.f(1);
  EXPECT_TRUE(cuda.PostBackward(pb, ws(OpKind::kPostBackward)).ok());

  ExpandForwardParams ef;
  ef.spec = &spec;
  ef.tokens = M;
  ef.act_dtype = dt;
  ef.e = f;
  ef.x = at.Out("expand x", M * K * es);
  EXPECT_TRUE(cuda.ExpandForward(ef, ws(OpKind::kExpandForward)).ok());

  ExpandBackwardParams eb;
  eb.spec = &spec;
  eb.tokens = M;
  eb.act_dtype = dt;
  eb.dx = dxn;
  eb.de = at.Out("expand de", M * C * es);
  EXPECT_TRUE(cuda.ExpandBackward(eb, ws(OpKind::kExpandBackward)).ok());

  const int64_t N = spec.NumLogits();
  const std::vector<float> zeros(N * K, 0.0f);
  Pair dphi = h.Input(zeros.data(), N * K * 4);
  Pair dgamma = h.Input(zeros.data(), K * 4);
  ProjectionBackwardParams qb;
  qb.spec = &spec;
  qb.tokens = M;
  qb.act_dtype = dt;
  qb.x = x;
  qb.weights.phi = in.phi.f(1);
  qb.weights.gamma = in.gamma.f(1);
  qb.dh = in.dh.f(1);
  qb.dmean_square = in.dms.f(1);
  qb.dx = at.Out("projection dx", M * K * es);
  qb.grads.phi = dphi.f(1);
  qb.grads.gamma = dgamma.f(1);
  EXPECT_TRUE(
      cuda.ProjectionBackward(qb, ws(OpKind::kProjectionBackward)).ok());

  EXPECT_TRUE(cuda.Synchronize().ok());
  std::map<std::string, std::vector<uint8_t>> results = at.Results();
  results["post dbias"] = h.Fetch(dbias);
  results["projection dphi"] = h.Fetch(dphi);
  results["projection dgamma"] = h.Fetch(dgamma);
  return results;
}

// Outputs summed over channels, whose order follows the access path.
const std::set<std::string> kChannelSums = {"aggregate dh_pre", "post dh_post",
                                            "post dh_res"};
// The post's elementwise outputs, rounded from other sums on the tensor cores.
const std::set<std::string> kPostRows = {"post x_next", "post df", "post dx"};
// The phi gradients of n = 4 and 8 16-bit stream-major layers: aligned rows
// sum a token chunk in the warpgroup mmas' accumulators
// (projection/backward/wgmma_n4.cu, projection/backward/wgmma_n8.cu), shifted
// ones per stage in fp32 (projection/backward/mma.cuh).
const std::set<std::string> kPhiSums = {"projection dphi", "projection dgamma"};

// Relative error bounds of outputs that another path rounds or sums
// differently: at most a bf16 ulp (2^-7) at the largest output, and fp32
// sums in another order.
constexpr double kBf16Ulp = 8e-3;
constexpr double kSumOrder = 1e-5;

// `got` against `want`, elements of `dt`: bit for bit where tolerance is 0,
// else within that relative error.
void ExpectOutputMatches(const std::string& name,
                         const std::vector<uint8_t>& got,
                         const std::vector<uint8_t>& want, DType dt,
                         double tolerance) {
  if (tolerance == 0.0) {
    EXPECT_TRUE(got == want) << name << " differs";
    return;
  }
  const int64_t count = static_cast<int64_t>(want.size() / DTypeSize(dt));
  EXPECT_LE(RelativeError(got, want, dt, count), tolerance) << name;
}

// The inputs of RunRowOps for a layer, every tensor fresh random data.
RowInputs RandomRowInputs(Harness& h, const LayerSpec& spec, DType dt,
                          int64_t M) {
  const int64_t n = spec.n, C = spec.hidden, K = spec.K();
  RowInputs in;
  in.x = h.Act(dt, M * K, FreshSeed());
  in.f = h.Act(dt, M * C, FreshSeed());
  in.dy = h.Act(dt, M * C, FreshSeed());
  in.dxn = h.Act(dt, M * K, FreshSeed());
  in.hpre = h.Floats(M * n, FreshSeed(), 0.0f, 1.0f);
  in.hpost = h.Floats(M * n, FreshSeed(), 0.0f, 2.0f);
  in.hres = h.Floats(M * n * n, FreshSeed(), 0.0f, 1.0f);
  in.bias = h.Floats(C, FreshSeed());
  in.dbias_init = RandomFloats(C, FreshSeed());
  const int64_t N = spec.NumLogits();
  in.phi = h.Floats(N * K, FreshSeed(), -0.05f, 0.05f);
  in.gamma = h.Floats(K, FreshSeed(), 0.5f, 1.5f);
  in.dh = h.Floats(M * N, FreshSeed());
  in.dms = h.Floats(M, FreshSeed());
  return in;
}

TEST(CudaRowAccessTest, UnalignedRowsMatchVectorRows) {
  MHC_SKIP_WITHOUT_GPU();
  // C = 1040 is a multiple of every vector width, so the unshifted run takes
  // the vector path at n = 2, 4 and 8 (or the post's tensor cores), and at
  // n = 16 in the aggregate and expand; C is not a multiple of 32 V, so the
  // strided path's last step of every row is partial. n = 3, and the post's
  // FFMA kernels at n = 16, run element accesses.
  constexpr int64_t kHidden = 1040, kTokens = 37;
  for (int n : {2, 3, 4, 8, 16}) {
    for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
      for (Layout layout : {Layout::kStreamMajor, Layout::kStreamMinor}) {
        LayerSpec spec = PresetSpec("deepseek_v4", n, kHidden).value();
        spec.has_post_bias = true;
        spec.has_gamma = true;
        spec.layout = layout;
        const int64_t M = kTokens;
        SCOPED_TRACE(
            absl::StrCat("n=", n, " ", DTypeName(dt), " ", LayoutName(layout)));
        Harness h;
        RowInputs in = RandomRowInputs(h, spec, dt, M);

        Placed aligned(h, dt, 0, 0);
        const auto want = RunRowOps(h, spec, dt, M, in, aligned);
        for (int shift : {1, 3}) {
          SCOPED_TRACE(absl::StrCat("inputs ", shift, " and outputs ",
                                    shift + 1, " elements off"));
          Placed shifted(h, dt, shift, shift + 1);
          const auto got = RunRowOps(h, spec, dt, M, in, shifted);
          const bool tensor_cores = dt == DType::kBF16 &&
                                    layout == Layout::kStreamMajor && n != 2 &&
                                    n != 4;
          const bool wgmma_dphi = dt != DType::kF32 &&
                                  layout == Layout::kStreamMajor &&
                                  (n == 4 || n == 8);
          for (const auto& [name, bytes] : want) {
            if (tensor_cores && kPostRows.count(name) > 0) {
              ExpectOutputMatches(name, got.at(name), bytes, dt, kBf16Ulp);
            } else if (kChannelSums.count(name) > 0 ||
                       (wgmma_dphi && kPhiSums.count(name) > 0)) {
              ExpectOutputMatches(name, got.at(name), bytes, DType::kF32,
                                  kSumOrder);
            } else {
              ExpectOutputMatches(name, got.at(name), bytes, dt, 0.0);
            }
          }
        }
      }
    }
  }
}

TEST(CudaRowAccessTest, StagedRowsMatchElementRows) {
  MHC_SKIP_WITHOUT_GPU();
  // Odd C: every row but the first starts off 16 bytes, at every offset
  // over the 37 tokens; a row's last window is partial (C = 135: its only
  // one), and with M odd the last row's last chunk runs past the tensor's
  // end, which the copies must not read. Stream-major only: the
  // stream-minor rows never stage; nor do fp32 ones, whose two runs both
  // load elements.
  constexpr int64_t kTokens = 37;
  for (int64_t hidden : {135, 263, 1041, 5129}) {
    for (int n : {2, 4, 8, 16}) {
      for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
        LayerSpec spec = PresetSpec("deepseek_v4", n, hidden).value();
        spec.has_post_bias = true;
        spec.has_gamma = true;
        const int64_t M = kTokens;
        SCOPED_TRACE(absl::StrCat("C=", hidden, " n=", n, " ", DTypeName(dt)));
        Harness h;
        RowInputs in = RandomRowInputs(h, spec, dt, M);
        Placed staged(h, dt, 0, 0);
        const auto want = RunRowOps(h, spec, dt, M, in, staged);
        Placed by_elements(h, dt, 1, 2);
        const auto got = RunRowOps(h, spec, dt, M, in, by_elements);
        // As in UnalignedRowsMatchVectorRows: the post may run on the tensor
        // cores at 16-byte tensors, and the phi gradients sum in another
        // order there.
        const bool tensor_cores = dt == DType::kBF16 && n != 2 && n != 4;
        const bool wgmma_dphi = dt != DType::kF32 && (n == 4 || n == 8);
        for (const auto& [name, bytes] : want) {
          if (tensor_cores && kPostRows.count(name) > 0) {
            ExpectOutputMatches(name, got.at(name), bytes, dt, kBf16Ulp);
          } else if (tensor_cores &&
                     (name == "post dh_post" || name == "post dh_res")) {
            ExpectOutputMatches(name, got.at(name), bytes, DType::kF32,
                                kBf16Ulp);
          } else if (wgmma_dphi && kPhiSums.count(name) > 0) {
            ExpectOutputMatches(name, got.at(name), bytes, DType::kF32,
                                kSumOrder);
          } else {
            ExpectOutputMatches(name, got.at(name), bytes, dt, 0.0);
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace mhc::testing
