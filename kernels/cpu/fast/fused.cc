// Fused pre (projection -> scale -> Sinkhorn -> aggregate) and head
// (projection -> scale -> aggregate), forward and backward.
//
// Determinism and batch invariance: the forward runs every token through the
// same per-token helpers on one thread. The backward has three passes:
// (1) per token, on one thread: recompute the forward (from the kept
// projection when the caller has it), dH_pre (fixed-block
// dot), the Sinkhorn and scale reverse mode, and stage dh, dz, dms, H_pre,
// R and the dalpha terms in the workspace; (2) per channel block: dx of
// every token in one fp32 expression rounded once (projection terms, H_pre
// dy and, when dx_next is given, R dx_next) and dphi'/dgamma summed over
// tokens in token order; (3) dalpha/dbeta summed over tokens in token order.
// No token's dx depends on other tokens, and no parameter gradient on the
// thread count.
#include <cstring>

#include "cpu/fast/cpu_ops.h"

namespace mhc::cpu {
namespace {

// A dynamic layer's projection kept from its forward (null: recompute it).
struct KeptProjection {
  const float* h = nullptr;            // [M, N]
  const float* mean_square = nullptr;  // [M]
};

// h and ms of a token group into the thread's group buffers: computed from x,
// or copied from the kept projection (static layers have neither); tokens
// that overflowed fp32 are repaired (RepairGroup sets their exponent).
void ProjectGroup(const LayerSpec& spec, DType dtype, const void* x, int64_t m0,
                  int count, const LayerWeights& w, const ThreadScratch& s,
                  int* exponent, const KeptProjection& kept = {}) {
  if (spec.dynamic && kept.h != nullptr) {
    const int64_t big_n = spec.NumLogits();
    std::memcpy(s.hgroup, kept.h + m0 * big_n, count * big_n * sizeof(float));
    std::memcpy(s.msgroup, kept.mean_square + m0, count * sizeof(float));
  } else if (spec.dynamic) {
    ProjectTokens(spec, dtype, x, m0, count, w, s, s.hgroup, s.msgroup);
  } else {
    for (int t = 0; t < count; ++t) s.msgroup[t] = 0.0f;
  }
  if (spec.dynamic) {
    RepairGroup(spec, dtype, x, m0, count, w, s, s.hgroup, s.msgroup, exponent);
  } else {
    for (int t = 0; t < count; ++t) exponent[t] = 0;
  }
}

// The spec a token's scale math runs with (ScaledSpec for repaired tokens).
LayerSpec MixSpec(const LayerSpec& spec, int exponent) {
  return exponent == 0 ? spec : ScaledSpec(spec, exponent);
}

// Pass 1 of the backward for one token (kMhc or kHead).
void BackwardTokenPass(const OpContext& ctx, DType dtype, const void* x,
                       const void* dy, const float* dh_post,
                       const float* dh_res, bool keep_r, int64_t m,
                       const float* h, float ms, int exponent,
                       const LayerWeights& w, const ThreadScratch& s,
                       float* row) {
  const LayerSpec& spec = *ctx.spec;
  const LayerSpec mix_spec = MixSpec(spec, exponent);
  const int n = spec.n;
  const int64_t nn = static_cast<int64_t>(n) * n;
  const FusedRecord rec = MakeFusedRecord(spec);
  const bool mhc = spec.kind == LayerKind::kMhc;
  float* h_post = s.small;
  float* logits = h_post + n;
  float* p = logits + nn;
  float* dlogits = p + nn;
  float* dh_pre = dlogits + nn;
  float* h_pre = row + rec.h_pre;
  ScaleToken(mix_spec, w, h, ms, h_pre, mhc ? h_post : nullptr,
             mhc ? logits : nullptr);
  StreamDotsToken(spec, dtype, x, dy, m, s, dh_pre);
  if (mhc) {
    SinkhornBackwardToken(spec, logits, dh_res + m * nn, dlogits, p, s.hist);
    if (keep_r) {
      float* r = row + rec.r;
      for (int i = 0; i < n; ++i) {
        for (int j = 0; j < n; ++j) {
          r[i * n + j] = spec.orientation == Orientation::kSourceRows
                             ? p[i * n + j]
                             : p[j * n + i];
        }
      }
    }
  }
  ScaleBackwardToken(mix_spec, w, h, ms, dh_pre,
                     mhc ? dh_post + m * n : nullptr, mhc ? dlogits : nullptr,
                     row + rec.dz, row + rec.da, row + rec.dh, row + rec.dms);
  row[rec.exponent] = static_cast<float>(exponent);
}

void FusedBackward(const OpContext& ctx, DType dtype, int64_t tokens,
                   const void* x, const LayerWeights& w, const void* dy,
                   const float* dh_post, const float* dh_res,
                   const void* dx_next, void* dx, const LayerGrads& grads,
                   const KeptProjection& kept = {}) {
  const LayerSpec& spec = *ctx.spec;
  const FusedRecord rec = MakeFusedRecord(spec);
  float* rows = reinterpret_cast<float*>(ctx.shared);
  const bool keep_r = dx_next != nullptr;
  const int64_t big_n = spec.NumLogits();
  ForTokenGroups(
      ctx, tokens, [&](int64_t m0, int count, const ThreadScratch& s) {
        int exponent[kProjGroup];
        ProjectGroup(spec, dtype, x, m0, count, w, s, exponent, kept);
        for (int t = 0; t < count; ++t) {
          const int64_t m = m0 + t;
          BackwardTokenPass(ctx, dtype, x, dy, dh_post, dh_res, keep_r, m,
                            s.hgroup + t * big_n, s.msgroup[t], exponent[t], w,
                            s, rows + m * rec.stride);
        }
      });
  BackwardExtras ex;
  ex.rows = rows;
  ex.stride = rec.stride;
  ex.dh_offset = rec.dh;
  ex.dms_offset = rec.dms;
  ex.exponent_offset = rec.exponent;
  ex.h_pre_offset = rec.h_pre;
  ex.r_offset = keep_r ? rec.r : -1;
  ex.dy = dy;
  ex.dx_next = dx_next;
  ChannelBlockBackward(ctx, dtype, tokens, x, w, ex, dx, grads);
  ReduceScaleGrads(spec, tokens, rows + rec.dz, rec.stride, rec.da - rec.dz,
                   grads);
}

}  // namespace

absl::Status PreForward(const OpContext& ctx, const PreForwardParams& p) {
  const LayerSpec& spec = *p.spec;
  const int n = spec.n;
  const int64_t nn = static_cast<int64_t>(n) * n;
  const int64_t big_n = spec.NumLogits();
  const bool stream = StreamOutput(p.act_dtype, p.tokens * spec.hidden);
  ForTokenGroups(
      ctx, p.tokens, [&](int64_t m0, int count, const ThreadScratch& s) {
        int exponent[kProjGroup];
        ProjectGroup(spec, p.act_dtype, p.x, m0, count, p.weights, s, exponent);
        if (p.h != nullptr) {
          std::memcpy(p.h + m0 * big_n, s.hgroup,
                      count * big_n * sizeof(float));
          std::memcpy(p.mean_square + m0, s.msgroup, count * sizeof(float));
          for (int t = 0; t < count; ++t) {
            if (exponent[t] == 0) continue;
            UnscaleProjection(spec, exponent[t], s.hgroup + t * big_n,
                              s.msgroup[t], p.h + (m0 + t) * big_n,
                              p.mean_square + m0 + t);
          }
        }
        for (int t = 0; t < count; ++t) {
          const int64_t m = m0 + t;
          float* h_pre = s.small;
          float* logits = h_pre + n;
          ScaleToken(MixSpec(spec, exponent[t]), p.weights,
                     s.hgroup + t * big_n, s.msgroup[t], h_pre,
                     p.h_post + m * n, logits);
          SinkhornToken(spec, logits, p.h_res + m * nn, nullptr);
          AggregateToken(spec, p.act_dtype, p.x, m, h_pre, s, p.y, stream);
          if (p.h_pre != nullptr) {
            std::memcpy(p.h_pre + m * n, h_pre, n * sizeof(float));
          }
        }
      });
  return absl::OkStatus();
}

absl::Status PreBackward(const OpContext& ctx, const PreBackwardParams& p) {
  FusedBackward(ctx, p.act_dtype, p.tokens, p.x, p.weights, p.dy, p.dh_post,
                p.dh_res, p.dx_next, p.dx, p.grads, {p.h, p.mean_square});
  return absl::OkStatus();
}

absl::Status HeadForward(const OpContext& ctx, const HeadForwardParams& p) {
  const LayerSpec& spec = *p.spec;
  const int n = spec.n;
  const int64_t big_n = spec.NumLogits();
  const bool stream = StreamOutput(p.act_dtype, p.tokens * spec.hidden);
  ForTokenGroups(
      ctx, p.tokens, [&](int64_t m0, int count, const ThreadScratch& s) {
        int exponent[kProjGroup];
        ProjectGroup(spec, p.act_dtype, p.x, m0, count, p.weights, s, exponent);
        for (int t = 0; t < count; ++t) {
          const int64_t m = m0 + t;
          float* mix = s.small;
          ScaleToken(MixSpec(spec, exponent[t]), p.weights,
                     s.hgroup + t * big_n, s.msgroup[t], mix, nullptr, nullptr);
          AggregateToken(spec, p.act_dtype, p.x, m, mix, s, p.y, stream);
          if (p.mix != nullptr)
            std::memcpy(p.mix + m * n, mix, n * sizeof(float));
        }
      });
  return absl::OkStatus();
}

absl::Status HeadBackward(const OpContext& ctx, const HeadBackwardParams& p) {
  FusedBackward(ctx, p.act_dtype, p.tokens, p.x, p.weights, p.dy, nullptr,
                nullptr, nullptr, p.dx, p.grads);
  return absl::OkStatus();
}

}  // namespace mhc::cpu
