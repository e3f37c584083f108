// Post (expand & combine) x_next[j] = H_post[j] (f + bias) + sum_i R[i][j]
// x[i] and its backward.
//
// Determinism and batch invariance: x_next, df and dx are elementwise sums in
// a fixed order (first term, then i or j = 0..n-1) with one rounding;
// dH_post and dH_res are per-token sums over kBlock-channel blocks in order
// of fixed-order BlockDots. dbias is recomputed per channel block with the
// same Combine as df and summed over tokens in token order by the one task
// that owns the block, so it does not depend on the thread count.
#include "cpu/fast/cpu_ops.h"

namespace mhc::cpu {
namespace {

// R[i][j] of the spec's orientation, from H_res stored row-major.
inline float ResAt(const LayerSpec& spec, const float* h_res, int i, int j) {
  return spec.orientation == Orientation::kSourceRows ? h_res[i * spec.n + j]
                                                      : h_res[j * spec.n + i];
}

// fb = f + bias for one block.
void LoadFPlusBias(const LayerSpec& spec, DType dtype, const void* f,
                   const LayerWeights& w, int64_t m, int64_t c0, int64_t cb,
                   float* fb) {
  LoadAct(dtype, f, m * spec.hidden + c0, cb, fb);
  if (spec.has_post_bias) AddTo(w.bias + c0, cb, fb);
}

// df block = sum_j H_post[j] dx_next[j] (dxn stream-major, staged).
void DfBlock(const LayerSpec& spec, const float* h_post, const float* dxn,
             int64_t cb, float* df) {
  const float* src[kMaxStreams];
  for (int j = 0; j < spec.n; ++j) src[j] = dxn + j * cb;
  Combine(h_post, src, spec.n, cb, /*accumulate=*/false, df);
}

}  // namespace

absl::Status PostForward(const OpContext& ctx, const PostForwardParams& p) {
  const LayerSpec& spec = *p.spec;
  const int n = spec.n;
  const bool stream = StreamOutput(p.act_dtype, p.tokens * spec.K());
  ForTokenBlocks(
      ctx, p.tokens,
      [&](int64_t m, int64_t c0, int64_t cb, const ThreadScratch& s) {
        const float* h_post = p.h_post + m * n;
        const float* h_res = p.h_res + m * n * n;
        LoadFPlusBias(spec, p.act_dtype, p.f, p.weights, m, c0, cb, s.a1);
        if (p.act_dtype == DType::kBF16 &&
            (spec.layout == Layout::kStreamMajor || n == 1)) {
          const uint16_t* rows[kMaxStreams];
          uint16_t* outs[kMaxStreams];
          const uint16_t* base =
              static_cast<const uint16_t*>(p.x) + m * spec.K() + c0;
          uint16_t* out = static_cast<uint16_t*>(p.x_next) + m * spec.K() + c0;
          float* coefs = s.small;  // [n][n + 1]
          for (int j = 0; j < n; ++j) {
            rows[j] = base + j * spec.hidden;
            outs[j] = out + j * spec.hidden;
            coefs[j * (n + 1)] = h_post[j];
            for (int i = 0; i < n; ++i) {
              coefs[j * (n + 1) + i + 1] = ResAt(spec, h_res, i, j);
            }
          }
          if (PostCombineBf16(s.a1, rows, coefs, n, cb, outs, stream)) return;
        }
        float coef[kMaxStreams + 1];
        LoadStreams(spec, p.act_dtype, p.x, m, c0, cb, s.xs, s.tmp);
        const float* src[kMaxStreams + 1];
        src[0] = s.a1;
        for (int i = 0; i < n; ++i) src[i + 1] = s.xs + i * cb;
        for (int j = 0; j < n; ++j) {
          coef[0] = h_post[j];
          for (int i = 0; i < n; ++i) coef[i + 1] = ResAt(spec, h_res, i, j);
          Combine(coef, src, n + 1, cb, /*accumulate=*/false, s.os + j * cb);
        }
        StoreStreams(spec, p.act_dtype, s.os, m, c0, cb, s.tmp, p.x_next,
                     stream);
      });
  return absl::OkStatus();
}

absl::Status PostBackward(const OpContext& ctx, const PostBackwardParams& p) {
  const LayerSpec& spec = *p.spec;
  const int n = spec.n;
  const int64_t hidden = spec.hidden;
  const bool stream = StreamOutput(p.act_dtype, p.tokens * spec.K());
  ForTokens(ctx, p.tokens, [&](int64_t m, const ThreadScratch& s) {
    const float* h_post = p.h_post + m * n;
    const float* h_res = p.h_res + m * n * n;
    float* dh_post = p.dh_post + m * n;
    float* dr = s.small;  // dR[i][j], oriented like R
    for (int j = 0; j < n; ++j) dh_post[j] = 0.0f;
    for (int e = 0; e < n * n; ++e) dr[e] = 0.0f;
    float r_rows[kMaxStreams * kMaxStreams];
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) r_rows[i * n + j] = ResAt(spec, h_res, i, j);
    }
    for (int64_t c0 = 0; c0 < hidden; c0 += kBlock) {
      const int64_t cb = std::min(kBlock, hidden - c0);
      LoadStreams(spec, p.act_dtype, p.dx_next, m, c0, cb, s.xs2, s.tmp);
      LoadStreams(spec, p.act_dtype, p.x, m, c0, cb, s.xs, s.tmp);
      LoadFPlusBias(spec, p.act_dtype, p.f, p.weights, m, c0, cb, s.a1);
      DfBlock(spec, h_post, s.xs2, cb, s.a2);
      StoreAct(p.act_dtype, s.a2, cb, p.df, m * hidden + c0, stream);
      const float* dxn_rows[kMaxStreams];
      const float* x_rows[kMaxStreams];
      for (int i = 0; i < n; ++i) {
        dxn_rows[i] = s.xs2 + i * cb;
        x_rows[i] = s.xs + i * cb;
      }
      float dots[kMaxStreams];
      MultiDot(dxn_rows, n, s.a1, cb, dots);
      for (int j = 0; j < n; ++j) dh_post[j] += dots[j];
      for (int j = 0; j < n; ++j) {
        MultiDot(x_rows, n, s.xs2 + j * cb, cb, dots);
        for (int i = 0; i < n; ++i) dr[i * n + j] += dots[i];
      }
      if (p.dx != nullptr) {
        const float* src[kMaxStreams];
        for (int j = 0; j < n; ++j) src[j] = s.xs2 + j * cb;
        for (int i = 0; i < n; ++i) {
          Combine(r_rows + i * n, src, n, cb, /*accumulate=*/false,
                  s.os + i * cb);
        }
        StoreStreams(spec, p.act_dtype, s.os, m, c0, cb, s.tmp, p.dx, stream);
      }
    }
    float* dh_res = p.dh_res + m * n * n;
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        // dH_res of DEST_ROWS is dR transposed back.
        if (spec.orientation == Orientation::kSourceRows) {
          dh_res[i * n + j] = dr[i * n + j];
        } else {
          dh_res[j * n + i] = dr[i * n + j];
        }
      }
    }
  });
  if (p.grads.bias != nullptr) {
    const int64_t blocks = (hidden + kBlock - 1) / kBlock;
    ctx.pool->Run(blocks, [&](int64_t block, int thread) {
      const ThreadScratch s = ctx.Scratch(thread);
      const int64_t c0 = block * kBlock;
      const int64_t cb = std::min(kBlock, hidden - c0);
      float* sum = s.os;
      for (int64_t c = 0; c < cb; ++c) sum[c] = 0.0f;
      for (int64_t m = 0; m < p.tokens; ++m) {
        LoadStreams(spec, p.act_dtype, p.dx_next, m, c0, cb, s.xs2, s.tmp);
        DfBlock(spec, p.h_post + m * n, s.xs2, cb, s.a2);
        AddTo(s.a2, cb, sum);
      }
      AddTo(sum, cb, p.grads.bias + c0);
    });
  }
  return absl::OkStatus();
}

}  // namespace mhc::cpu
