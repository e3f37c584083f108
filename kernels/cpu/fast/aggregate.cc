// Aggregate y[c] = sum_i H_pre[i] x[i][c] and its backward, plus the layout
// staging shared by every op that works per stream.
//
// Determinism and batch invariance: y and dx are elementwise (sum over i in
// order, fp32, one rounding); dH_pre[i] = sum over kBlock-channel blocks, in
// order, of fixed-order BlockDots. Nothing depends on M, on the task split or
// on the thread count; the tests check all three bitwise.
#include "cpu/fast/cpu_ops.h"

namespace mhc::cpu {

void LoadStreams(const LayerSpec& spec, DType dtype, const void* x, int64_t m,
                 int64_t c0, int64_t cb, float* xs, float* tmp) {
  const int64_t hidden = spec.hidden;
  const int64_t k = spec.K();
  if (spec.layout == Layout::kStreamMajor || spec.n == 1) {
    for (int i = 0; i < spec.n; ++i) {
      LoadAct(dtype, x, m * k + i * hidden + c0, cb, xs + i * cb);
    }
    return;
  }
  LoadAct(dtype, x, m * k + c0 * spec.n, cb * spec.n, tmp);
  Deinterleave(tmp, spec.n, cb, xs);
}

void StoreStreams(const LayerSpec& spec, DType dtype, const float* xs,
                  int64_t m, int64_t c0, int64_t cb, float* tmp, void* x,
                  bool stream) {
  const int64_t hidden = spec.hidden;
  const int64_t k = spec.K();
  if (spec.layout == Layout::kStreamMajor || spec.n == 1) {
    for (int i = 0; i < spec.n; ++i) {
      StoreAct(dtype, xs + i * cb, cb, x, m * k + i * hidden + c0, stream);
    }
    return;
  }
  Interleave(xs, spec.n, cb, tmp);
  StoreAct(dtype, tmp, cb * spec.n, x, m * k + c0 * spec.n, stream);
}

namespace {

// y block = sum_i h_pre[i] xs[i]; the one code path for every caller.
void AggregateBlock(const LayerSpec& spec, DType dtype, const void* x,
                    int64_t m, int64_t c0, int64_t cb, const float* h_pre,
                    const ThreadScratch& s, void* y, bool stream) {
  if (dtype == DType::kBF16 &&
      (spec.layout == Layout::kStreamMajor || spec.n == 1)) {
    const uint16_t* rows[kMaxStreams];
    const uint16_t* base = static_cast<const uint16_t*>(x) + m * spec.K() + c0;
    for (int i = 0; i < spec.n; ++i) rows[i] = base + i * spec.hidden;
    uint16_t* dst = static_cast<uint16_t*>(y) + m * spec.hidden + c0;
    if (CombineBf16(h_pre, nullptr, rows, spec.n, cb, dst, stream)) return;
  }
  LoadStreams(spec, dtype, x, m, c0, cb, s.xs, s.tmp);
  const float* src[kMaxStreams];
  for (int i = 0; i < spec.n; ++i) src[i] = s.xs + i * cb;
  Combine(h_pre, src, spec.n, cb, /*accumulate=*/false, s.a1);
  StoreAct(dtype, s.a1, cb, y, m * spec.hidden + c0, stream);
}

}  // namespace

void AggregateToken(const LayerSpec& spec, DType dtype, const void* x,
                    int64_t m, const float* h_pre, const ThreadScratch& s,
                    void* y, bool stream) {
  for (int64_t c0 = 0; c0 < spec.hidden; c0 += kBlock) {
    AggregateBlock(spec, dtype, x, m, c0, std::min(kBlock, spec.hidden - c0),
                   h_pre, s, y, stream);
  }
}

void StreamDotsToken(const LayerSpec& spec, DType dtype, const void* x,
                     const void* dy, int64_t m, const ThreadScratch& s,
                     float* out) {
  for (int i = 0; i < spec.n; ++i) out[i] = 0.0f;
  for (int64_t c0 = 0; c0 < spec.hidden; c0 += kBlock) {
    const int64_t cb = std::min(kBlock, spec.hidden - c0);
    LoadStreams(spec, dtype, x, m, c0, cb, s.xs, s.tmp);
    LoadAct(dtype, dy, m * spec.hidden + c0, cb, s.a1);
    const float* rows[kMaxStreams];
    for (int i = 0; i < spec.n; ++i) rows[i] = s.xs + i * cb;
    float dots[kMaxStreams];
    MultiDot(rows, spec.n, s.a1, cb, dots);
    for (int i = 0; i < spec.n; ++i) out[i] += dots[i];
  }
}

absl::Status AggregateForward(const OpContext& ctx,
                              const AggregateForwardParams& p) {
  const LayerSpec& spec = *p.spec;
  const bool stream = StreamOutput(p.act_dtype, p.tokens * spec.hidden);
  ForTokenBlocks(
      ctx, p.tokens,
      [&](int64_t m, int64_t c0, int64_t cb, const ThreadScratch& s) {
        AggregateBlock(spec, p.act_dtype, p.x, m, c0, cb, p.h_pre + m * spec.n,
                       s, p.y, stream);
      });
  return absl::OkStatus();
}

absl::Status AggregateBackward(const OpContext& ctx,
                               const AggregateBackwardParams& p) {
  const LayerSpec& spec = *p.spec;
  const int n = spec.n;
  const bool stream = StreamOutput(p.act_dtype, p.tokens * spec.K());
  ForTokens(ctx, p.tokens, [&](int64_t m, const ThreadScratch& s) {
    const float* h_pre = p.h_pre + m * n;
    float* dh_pre = p.dh_pre + m * n;
    for (int i = 0; i < n; ++i) dh_pre[i] = 0.0f;
    for (int64_t c0 = 0; c0 < spec.hidden; c0 += kBlock) {
      const int64_t cb = std::min(kBlock, spec.hidden - c0);
      LoadStreams(spec, p.act_dtype, p.x, m, c0, cb, s.xs, s.tmp);
      LoadAct(p.act_dtype, p.dy, m * spec.hidden + c0, cb, s.a1);
      const float* rows[kMaxStreams];
      for (int i = 0; i < n; ++i) rows[i] = s.xs + i * cb;
      float dots[kMaxStreams];
      MultiDot(rows, n, s.a1, cb, dots);
      for (int i = 0; i < n; ++i) {
        dh_pre[i] += dots[i];
        Scale(h_pre[i], s.a1, cb, s.os + i * cb);
      }
      StoreStreams(spec, p.act_dtype, s.os, m, c0, cb, s.tmp, p.dx, stream);
    }
  });
  return absl::OkStatus();
}

}  // namespace mhc::cpu
