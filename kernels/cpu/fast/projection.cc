// Projection h = phi' v with the mean square of v, and the channel-block
// backward shared by the projection, pre and head backward ops.
//
// Determinism and batch invariance: h[g] and the mean square are in-order
// sums over kBlock-element blocks of BlockDots (fixed lanes and tree), so a
// token's values never depend on M, on the tasks or on the thread count.
// In the backward every dx element is a fixed-order expression of its own
// token's values; dphi'[g][k] is summed over tokens in token order by the one
// task that owns column k (tasks are channel blocks), then scaled by gamma
// and added once, so parameter gradients do not depend on the thread count.
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu/fast/cpu_ops.h"

namespace mhc::cpu {

void ProjectTokens(const LayerSpec& spec, DType dtype, const void* x,
                   int64_t m0, int count, const LayerWeights& w,
                   const ThreadScratch& s, float* h, float* ms) {
  const int64_t k_total = spec.K();
  const int64_t big_n = spec.NumLogits();
  float squares[kProjGroup] = {};
  for (int64_t e = 0; e < count * big_n; ++e) h[e] = 0.0f;
  for (int64_t k0 = 0; k0 < k_total; k0 += kBlock) {
    const int64_t kb = std::min(kBlock, k_total - k0);
    for (int t = 0; t < count; ++t) {
      float* v = s.vgroup + t * kBlock;
      LoadAct(dtype, x, (m0 + t) * k_total + k0, kb, v);
      squares[t] += BlockDot(v, v, kb);
      if (spec.has_gamma) Multiply(v, w.gamma + k0, kb, v);
    }
    int64_t g = 0;
    for (; g + 4 <= big_n; g += 4) {
      const float* rows[4] = {
          w.phi + g * k_total + k0, w.phi + (g + 1) * k_total + k0,
          w.phi + (g + 2) * k_total + k0, w.phi + (g + 3) * k_total + k0};
      for (int t = 0; t < count; ++t) {
        float out[4];
        BlockDot4(rows, s.vgroup + t * kBlock, kb, out);
        for (int r = 0; r < 4; ++r) h[t * big_n + g + r] += out[r];
      }
    }
    for (; g < big_n; ++g) {
      for (int t = 0; t < count; ++t) {
        h[t * big_n + g] +=
            BlockDot(w.phi + g * k_total + k0, s.vgroup + t * kBlock, kb);
      }
    }
  }
  for (int t = 0; t < count; ++t) {
    ms[t] = squares[t] / static_cast<float>(k_total);
  }
}

absl::Status ProjectionForward(const OpContext& ctx,
                               const ProjectionForwardParams& p) {
  const int64_t big_n = p.spec->NumLogits();
  ForTokenGroups(ctx, p.tokens,
                 [&](int64_t m0, int count, const ThreadScratch& s) {
                   float* h = p.h + m0 * big_n;
                   float* ms = p.mean_square + m0;
                   ProjectTokens(*p.spec, p.act_dtype, p.x, m0, count,
                                 p.weights, s, h, ms);
                   // Overflowed tokens get the float64 values rounded once.
                   int exponent[kProjGroup];
                   RepairGroup(*p.spec, p.act_dtype, p.x, m0, count, p.weights,
                               s, h, ms, exponent);
                   for (int t = 0; t < count; ++t) {
                     if (exponent[t] == 0) continue;
                     UnscaleProjection(*p.spec, exponent[t], h + t * big_n,
                                       ms[t], h + t * big_n, ms + t);
                   }
                 });
  return absl::OkStatus();
}

namespace {

// Copies the columns of channel block [c0, c0 + cb) of a [rows, K] matrix
// into a contiguous [rows, n * cb] buffer in the layout's local order.
void GatherColumns(const LayerSpec& spec, const float* src, int64_t rows,
                   int64_t c0, int64_t cb, float* dst) {
  const int64_t k_total = spec.K();
  const int64_t kb = spec.n * cb;
  for (int64_t g = 0; g < rows; ++g) {
    const float* row = src + g * k_total;
    if (spec.layout == Layout::kStreamMajor) {
      for (int i = 0; i < spec.n; ++i) {
        std::memcpy(dst + g * kb + i * cb, row + i * spec.hidden + c0,
                    cb * sizeof(float));
      }
    } else {
      std::memcpy(dst + g * kb, row + c0 * spec.n, kb * sizeof(float));
    }
  }
}

// t += dms (2 / K) v. dms 2 / K is rounded first, as it always was, unless
// that product is subnormal (the dms of a token whose x is huge, about
// 1 / ms): it would lose bits or vanish where its product with v need not,
// so it is taken scaled by 2^64 and each product with v scaled back, which
// is exact unless the term itself is subnormal. Other tokens keep their bits.
void AddMeanSquareTerm(float dms, float ms_scale, const float* v, int64_t n,
                       float* t) {
  const float dm = dms * ms_scale;
  if (dms == 0.0f || !(std::fabs(dm) < std::numeric_limits<float>::min())) {
    Axpy(dm, v, n, t);
    return;
  }
  const float dm_scaled = dms * 0x1p64f * ms_scale;
  for (int64_t i = 0; i < n; ++i) t[i] += dm_scaled * v[i] * 0x1p-64f;
}

// Global column of local index l of channel block c0 (width cb).
inline int64_t GlobalColumn(const LayerSpec& spec, int64_t c0, int64_t cb,
                            int64_t l) {
  if (spec.layout == Layout::kStreamMajor) {
    return (l / cb) * spec.hidden + c0 + l % cb;
  }
  return c0 * spec.n + l;
}

}  // namespace

void ChannelBlockBackward(const OpContext& ctx, DType dtype, int64_t tokens,
                          const void* x, const LayerWeights& w,
                          const BackwardExtras& ex, void* dx,
                          const LayerGrads& grads) {
  const LayerSpec& spec = *ctx.spec;
  const int n = spec.n;
  const int64_t hidden = spec.hidden;
  const int64_t k_total = spec.K();
  const int64_t big_n = spec.NumLogits();
  const bool dynamic = spec.dynamic;
  const bool gamma = dynamic && spec.has_gamma;
  const bool need_dphi =
      dynamic && (grads.phi != nullptr || (gamma && grads.gamma != nullptr));
  const bool major = spec.layout == Layout::kStreamMajor || n == 1;
  const int64_t width = BackwardChannels(spec);
  const int64_t blocks = (hidden + width - 1) / width;
  // dphi' needs every token of a column in one task; dx alone does not.
  const int64_t chunk = need_dphi ? tokens : TokenChunk(ctx, tokens);
  const int64_t chunks = (tokens + chunk - 1) / chunk;
  const float ms_scale = 2.0f / static_cast<float>(k_total);
  // Blocks write short strided segments per token, which streaming stores
  // would leave as partial lines.
  const bool stream = false;

  ctx.pool->Run(blocks * chunks, [&](int64_t task, int thread) {
    const ThreadScratch s = ctx.Scratch(thread);
    const int64_t c0 = (task % blocks) * width;
    const int64_t cb = std::min(width, hidden - c0);
    const int64_t kb = n * cb;
    const int64_t m0 = (task / blocks) * chunk;
    const int64_t m1 = std::min(tokens, m0 + chunk);
    const float* phi_rows[kMaxStreams * kMaxStreams + 2 * kMaxStreams];
    if (dynamic) {
      GatherColumns(spec, w.phi, big_n, c0, cb, s.phi);
      for (int64_t g = 0; g < big_n; ++g) phi_rows[g] = s.phi + g * kb;
      if (gamma) GatherColumns(spec, w.gamma, 1, c0, cb, s.gamma);
      if (need_dphi) std::memset(s.acc, 0, big_n * kb * sizeof(float));
    }
    const bool has_u = ex.h_pre_offset >= 0 || ex.r_offset >= 0;
    for (int64_t mg = m0; mg < m1; mg += kTokenGroup) {
      const int group =
          static_cast<int>(std::min<int64_t>(kTokenGroup, m1 - mg));
      for (int q = 0; q < group; ++q) {
        const int64_t m = mg + q;
        const float* row =
            ex.rows != nullptr ? ex.rows + m * ex.stride : nullptr;
        float* v = s.v2 + q * kb;
        float* t = s.t2;
        if (dynamic) {
          if (major) {
            for (int i = 0; i < n; ++i) {
              LoadAct(dtype, x, m * k_total + i * hidden + c0, cb, v + i * cb);
            }
          } else {
            LoadAct(dtype, x, m * k_total + c0 * n, kb, v);
          }
          const float* dh =
              ex.dh != nullptr ? ex.dh + m * big_n : row + ex.dh_offset;
          const float dms = ex.dms != nullptr ? ex.dms[m] : row[ex.dms_offset];
          // A repaired token's dh and dms are scaled (RepairGroup): its x
          // is scaled to match here, for dx and for dphi', and its
          // projection terms scaled back once.
          const int exponent = ex.exponent_offset >= 0
                                   ? static_cast<int>(row[ex.exponent_offset])
                                   : 0;
          const float unscale =
              exponent != 0 ? std::ldexp(1.0f, -exponent) : 1.0f;
          if (exponent != 0) Scale(unscale, v, kb, v);
          Combine(dh, phi_rows, static_cast<int>(big_n), kb, false, t);
          if (gamma) Multiply(t, s.gamma, kb, t);
          AddMeanSquareTerm(dms, ms_scale, v, kb, t);
          if (exponent != 0) Scale(unscale, t, kb, t);
        } else {
          std::memset(t, 0, kb * sizeof(float));
        }
        if (has_u) {
          float* u = s.u2;
          if (ex.h_pre_offset >= 0) {
            const float* h_pre = row + ex.h_pre_offset;
            LoadAct(dtype, ex.dy, m * hidden + c0, cb, s.a1);
            for (int i = 0; i < n; ++i) Scale(h_pre[i], s.a1, cb, u + i * cb);
          }
          if (ex.r_offset >= 0) {
            const float* r = row + ex.r_offset;
            LoadStreams(spec, dtype, ex.dx_next, m, c0, cb, s.xs2, s.tmp);
            const float* src[kMaxStreams];
            for (int j = 0; j < n; ++j) src[j] = s.xs2 + j * cb;
            for (int i = 0; i < n; ++i) {
              Combine(r + i * n, src, n, cb, ex.h_pre_offset >= 0, u + i * cb);
            }
          }
          if (major) {
            AddTo(u, kb, t);
          } else {
            Interleave(u, n, cb, s.tmp);
            AddTo(s.tmp, kb, t);
          }
        }
        if (major) {
          for (int i = 0; i < n; ++i) {
            StoreAct(dtype, t + i * cb, cb, dx, m * k_total + i * hidden + c0,
                     stream);
          }
        } else {
          StoreAct(dtype, t, kb, dx, m * k_total + c0 * n, stream);
        }
      }
      if (need_dphi) {
        const float* src[kTokenGroup];
        float coef[kTokenGroup];
        for (int q = 0; q < group; ++q) src[q] = s.v2 + q * kb;
        for (int64_t g = 0; g < big_n; ++g) {
          for (int q = 0; q < group; ++q) {
            const int64_t m = mg + q;
            coef[q] = ex.dh != nullptr
                          ? ex.dh[m * big_n + g]
                          : ex.rows[m * ex.stride + ex.dh_offset + g];
          }
          Combine(coef, src, group, kb, /*accumulate=*/true, s.acc + g * kb);
        }
      }
    }
    if (!need_dphi) return;
    for (int64_t l = 0; l < kb; ++l) {
      const int64_t col = GlobalColumn(spec, c0, cb, l);
      if (grads.phi != nullptr) {
        for (int64_t g = 0; g < big_n; ++g) {
          const float a = s.acc[g * kb + l];
          grads.phi[g * k_total + col] += gamma ? a * s.gamma[l] : a;
        }
      }
      if (gamma && grads.gamma != nullptr) {
        float sum = 0.0f;
        for (int64_t g = 0; g < big_n; ++g) {
          sum += s.acc[g * kb + l] * s.phi[g * kb + l];
        }
        grads.gamma[col] += sum;
      }
    }
  });
}

absl::Status ProjectionBackward(const OpContext& ctx,
                                const ProjectionBackwardParams& p) {
  BackwardExtras ex;
  ex.dh = p.dh;
  ex.dms = p.dmean_square;
  ChannelBlockBackward(ctx, p.act_dtype, p.tokens, p.x, p.weights, ex, p.dx,
                       p.grads);
  return absl::OkStatus();
}

}  // namespace mhc::cpu
