// Expand x[i][c] = e[c] and its backward de[c] = sum_i dx[i][c].
//
// Determinism and batch invariance: the forward copies bits; the backward
// sums the n streams of one (token, channel) in order i = 0..n-1 in fp32 and
// rounds once. Each output element depends on its own token only, whatever
// the task split or thread count.
#include <cstring>

#include "cpu/fast/cpu_ops.h"

namespace mhc::cpu {

absl::Status ExpandForward(const OpContext& ctx, const ExpandForwardParams& p) {
  const LayerSpec& spec = *p.spec;
  const int n = spec.n;
  const size_t size = DTypeSize(p.act_dtype);
  const char* e = static_cast<const char*>(p.e);
  char* x = static_cast<char*>(p.x);
  ForTokenBlocks(
      ctx, p.tokens,
      [&](int64_t m, int64_t c0, int64_t cb, const ThreadScratch&) {
        const char* src = e + (m * spec.hidden + c0) * size;
        char* dst = x + m * spec.K() * size;
        if (spec.layout == Layout::kStreamMajor) {
          for (int i = 0; i < n; ++i) {
            std::memcpy(dst + (i * spec.hidden + c0) * size, src, cb * size);
          }
          return;
        }
        dst += c0 * n * size;
        for (int64_t c = 0; c < cb; ++c) {
          for (int i = 0; i < n; ++i) {
            std::memcpy(dst + (c * n + i) * size, src + c * size, size);
          }
        }
      });
  return absl::OkStatus();
}

absl::Status ExpandBackward(const OpContext& ctx,
                            const ExpandBackwardParams& p) {
  const LayerSpec& spec = *p.spec;
  const bool stream = StreamOutput(p.act_dtype, p.tokens * spec.hidden);
  float ones[kMaxStreams];
  for (float& one : ones) one = 1.0f;
  ForTokenBlocks(
      ctx, p.tokens,
      [&](int64_t m, int64_t c0, int64_t cb, const ThreadScratch& s) {
        LoadStreams(spec, p.act_dtype, p.dx, m, c0, cb, s.xs, s.tmp);
        const float* src[kMaxStreams];
        for (int i = 0; i < spec.n; ++i) src[i] = s.xs + i * cb;
        Combine(ones, src, spec.n, cb, /*accumulate=*/false, s.a1);
        StoreAct(p.act_dtype, s.a1, cb, p.de, m * spec.hidden + c0, stream);
      });
  return absl::OkStatus();
}

}  // namespace mhc::cpu
