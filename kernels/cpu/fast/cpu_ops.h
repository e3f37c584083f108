// Internal interface of the fast CPU backend: the per-op entry points called
// by CpuBackend, the per-token building blocks the fused ops share, and the
// workspace layout (per-thread scratch + per-op shared arrays).
//
// Determinism and batch invariance, for every op: a token's outputs are
// computed by one fixed sequence of operations that depends only on that
// token's inputs and the spec (reductions over c or k are the in-order sum of
// kBlock-sized BlockDots), never on M, on the task partition or on the
// thread count. Parameter gradients are sums over tokens that always run in
// token order for each parameter element; tasks are partitioned over
// parameter elements (or channel blocks), so no float is ever reduced across
// threads and no atomics are used.
#ifndef MHC_KERNELS_CPU_FAST_CPU_OPS_H_
#define MHC_KERNELS_CPU_FAST_CPU_OPS_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "cpu/fast/thread_pool.h"
#include "cpu/fast/vec.h"
#include "mhc/backend.h"

namespace mhc::cpu {

// Floats of one thread's scratch, carved in this order.
struct ThreadScratch {
  float* xs;       // [n][kBlock] stream-major staging of x
  float* xs2;      // [n][kBlock] second stream tensor (dx_next)
  float* os;       // [n][kBlock] stream-major outputs
  float* tmp;      // [n][kBlock] interleaved staging
  float* a1;       // [kBlock] f / y / dy
  float* a2;       // [kBlock]
  float* v;        // [kBlock] projection input
  float* vg;       // [kBlock] projection input times gamma
  float* small;    // per-token vectors, kSmallFloats(spec)
  float* hist;     // Sinkhorn history (backward only)
  float* t2;       // [n][kBlock] channel-block backward: dx staging
  float* v2;       // x of a group of kTokenGroup tokens (V2Floats)
  float* u2;       // [n][kBlock] per-stream dx terms
  float* acc;      // [N][kb] dphi' of one channel block (kb = n * channels)
  float* phi;      // [N][kb] phi of that block, contiguous
  float* gamma;    // [kb]
  float* vgroup;   // [kProjGroup][kBlock] projection inputs of a token group
  float* hgroup;   // [kProjGroup][N]
  float* msgroup;  // [kProjGroup]
};

// Tokens whose dphi' updates are applied together (same bits as one by one).
inline constexpr int kTokenGroup = 8;

// Everything an op needs besides its params.
struct OpContext {
  ThreadPool* pool = nullptr;
  char* scratch = nullptr;  // threads * per_thread_bytes
  size_t per_thread_bytes = 0;
  char* shared = nullptr;  // op-specific shared array
  const LayerSpec* spec = nullptr;
  OpKind op = OpKind::kAggregateForward;

  ThreadScratch Scratch(int thread) const;
};

struct WorkspaceLayout {
  size_t per_thread_bytes = 0;
  size_t shared_bytes = 0;
  size_t total(int threads) const {
    return per_thread_bytes * static_cast<size_t>(threads) + shared_bytes;
  }
};

WorkspaceLayout ComputeWorkspaceLayout(OpKind op, const LayerSpec& spec,
                                       int64_t tokens);

// Channels per block of ChannelBlockBackward: small enough that the block's
// dphi' accumulator [N][n * channels] stays in cache.
int64_t BackwardChannels(const LayerSpec& spec);

// Per-token record the fused backward ops keep between their token pass and
// their channel-block pass (offsets in floats).
struct FusedRecord {
  int64_t dh, dz, dms, h_pre, r, da, exponent, stride;
};
inline FusedRecord MakeFusedRecord(const LayerSpec& spec) {
  const int64_t big_n = spec.NumLogits();
  const int64_t n = spec.n;
  FusedRecord rec;
  rec.dh = 0;
  rec.dz = big_n;
  rec.dms = 2 * big_n;
  rec.h_pre = rec.dms + 1;
  rec.r = rec.h_pre + n;
  rec.da = rec.r + n * n;
  rec.exponent = rec.da + 3;  // RepairGroup's exponent, 0 when not repaired
  rec.stride = rec.exponent + 1;
  return rec;
}

// ----------------------------------------------------- per-token helpers --

// r = 1/sqrt(ms + eps) (INSIDE) or 1/(sqrt(ms) + eps) (OUTSIDE), and dr/dms
// (0 at ms = 0 for OUTSIDE, where v = 0 and the term vanishes anyway).
float RmsFactor(const LayerSpec& spec, float ms);
float RmsFactorDerivative(const LayerSpec& spec, float ms, float r);
// The alpha group of logit g: 0 pre, 1 post, 2 res (kHead: always 0).
inline int AlphaGroup(const LayerSpec& spec, int64_t g) {
  if (spec.kind == LayerKind::kHead || g < spec.n) return 0;
  return g < 2 * spec.n ? 1 : 2;
}

// Tokens projected together, so phi streams from memory once per group
// instead of once per token; each token's arithmetic is unchanged.
inline constexpr int kProjGroup = 16;

// h[t][N] and ms[t] of tokens m0 .. m0 + count - 1 (count <= kProjGroup).
void ProjectTokens(const LayerSpec& spec, DType dtype, const void* x,
                   int64_t m0, int count, const LayerWeights& w,
                   const ThreadScratch& s, float* h, float* ms);

// Overflow repair (docs/SPEC.md section 7). A token whose fp32 mean square
// exceeds kRepairMeanSquare or is not finite, or whose h is not finite, is
// recomputed from its x row in float64 and kept scaled: h = h_s 2^e,
// ms = ms_s 2^(2e), with ms_s near 1, so that r, dms and the products with
// x stay inside fp32 range. Up to the limit the fp32 path (and its dms,
// about r^3) is exact enough; tokens with a non-finite x are left to it, so
// their outputs turn non-finite.
inline constexpr float kRepairMeanSquare = 0x1p64f;
bool NeedsRepair(const LayerSpec& spec, const float* h, float ms);
// The power of two e that brings a large mean square near 1 as ms 2^(-2e);
// 0 for small ones, whose fp32 form never overflows.
int RepairExponent(double mean_square);
// The spec a repaired token's scale math runs with: eps_rms scaled as ms is
// (2^-2e INSIDE, 2^-e OUTSIDE), so r_s = r 2^e and h_s r_s = h r.
LayerSpec ScaledSpec(const LayerSpec& spec, int exponent);
// Repairs the tokens m0 .. m0 + count - 1 of a group whose h / ms need it:
// overwrites their h[t][N] and ms[t] with the scaled values and sets
// exponent[t] (0 for tokens left alone, whose values are unchanged).
void RepairGroup(const LayerSpec& spec, DType dtype, const void* x, int64_t m0,
                 int count, const LayerWeights& w, const ThreadScratch& s,
                 float* h, float* ms, int* exponent);
// The kept (unscaled fp32) projection of a repaired token: h_s 2^e and
// ms_s 2^(2e), infinite where the true value exceeds fp32.
void UnscaleProjection(const LayerSpec& spec, int exponent, const float* h_s,
                       float ms_s, float* h, float* ms);

// Logits and gates of one token. h/ms unused for static layers.
void ScaleToken(const LayerSpec& spec, const LayerWeights& w, const float* h,
                float ms, float* h_pre, float* h_post, float* logits);
// Reverse mode of ScaleToken: writes dz[N], da[NumAlpha] (the token's
// dalpha terms) and, for dynamic layers, dh[N] and *dms.
void ScaleBackwardToken(const LayerSpec& spec, const LayerWeights& w,
                        const float* h, float ms, const float* dh_pre,
                        const float* dh_post, const float* dlogits, float* dz,
                        float* da, float* dh, float* dms);
// ScaleBackwardToken of the scale op alone for a token whose mean square is
// finite and above kRepairMeanSquare (the fused ops repair such tokens from
// x): in the repair's scaled form, so dms stays in fp32 range.
void ScaledScaleBackwardToken(const LayerSpec& spec, const LayerWeights& w,
                              const float* h, float ms, const float* dh_pre,
                              const float* dh_post, const float* dlogits,
                              float* dz, float* da, float* dh, float* dms);
// grads.beta[g] += sum_m dz[m][g]; grads.alpha[p] += sum_m da[m][p], tokens
// in order; rows of `stride` floats, dz at offset 0, da at `da_offset`.
void ReduceScaleGrads(const LayerSpec& spec, int64_t tokens, const float* rows,
                      int64_t stride, int64_t da_offset,
                      const LayerGrads& grads);

// H_res = Sinkhorn(A). `history` (SinkhornHistoryFloats) may be null.
void SinkhornToken(const LayerSpec& spec, const float* a, float* p,
                   float* history);
// dA from dP, recomputing the forward into `history`; also returns P.
void SinkhornBackwardToken(const LayerSpec& spec, const float* a,
                           const float* dp, float* da, float* p,
                           float* history);
int64_t SinkhornHistoryFloats(const LayerSpec& spec);

// Stream-major fp32 staging of channels [c0, c0 + cb) of token m.
void LoadStreams(const LayerSpec& spec, DType dtype, const void* x, int64_t m,
                 int64_t c0, int64_t cb, float* xs, float* tmp);
void StoreStreams(const LayerSpec& spec, DType dtype, const float* xs,
                  int64_t m, int64_t c0, int64_t cb, float* tmp, void* x,
                  bool stream = false);
// Whether an op writing `elements` activations should stream its stores.
inline bool StreamOutput(DType dtype, int64_t elements) {
  return elements * static_cast<int64_t>(DTypeSize(dtype)) > kStreamBytes;
}

// y = sum_i h_pre[i] x[i] for token m.
void AggregateToken(const LayerSpec& spec, DType dtype, const void* x,
                    int64_t m, const float* h_pre, const ThreadScratch& s,
                    void* y, bool stream);
// out[i] = sum_c dy[c] x[i][c] for token m (fixed kBlock blocking).
void StreamDotsToken(const LayerSpec& spec, DType dtype, const void* x,
                     const void* dy, int64_t m, const ThreadScratch& s,
                     float* out);

// What the channel-block pass of a backward adds to dx besides the
// projection terms; all optional. R is oriented: dx[i] += sum_j R[i][j]
// dx_next[j].
struct BackwardExtras {
  const float* rows = nullptr;  // per-token records, `stride` floats
  int64_t stride = 0;
  int64_t dh_offset = -1;        // dh[N] (dynamic)
  int64_t dms_offset = -1;       // dms
  int64_t exponent_offset = -1;  // RepairGroup's exponent: dh, dms scaled
  int64_t h_pre_offset = -1;     // H_pre[n], with dy
  int64_t r_offset = -1;         // R[n][n], with dx_next
  const float* dh = nullptr;     // standalone projection backward: [M, N]
  const float* dms = nullptr;    // [M]
  const void* dy = nullptr;
  const void* dx_next = nullptr;
};

// dx of every token (one rounding) and the phi/gamma gradients, partitioned
// over channel blocks; each block sums its dphi' over tokens in order.
void ChannelBlockBackward(const OpContext& ctx, DType dtype, int64_t tokens,
                          const void* x, const LayerWeights& w,
                          const BackwardExtras& extras, void* dx,
                          const LayerGrads& grads);

// Splits [0, tokens) into contiguous chunks for token-parallel passes; the
// partition only affects speed.
int64_t TokenChunk(const OpContext& ctx, int64_t tokens);

// Runs fn(m, c0, cb, scratch) for every (token, kBlock channel block), in
// parallel; for ops whose every output element depends on one (m, c) only.
template <typename F>
void ForTokenBlocks(const OpContext& ctx, int64_t tokens, F&& fn) {
  const int64_t hidden = ctx.spec->hidden;
  const int64_t blocks = (hidden + kBlock - 1) / kBlock;
  const int64_t items = tokens * blocks;
  const int64_t chunk = TokenChunk(ctx, items);
  ctx.pool->Run((items + chunk - 1) / chunk, [&](int64_t task, int thread) {
    const ThreadScratch s = ctx.Scratch(thread);
    const int64_t end = std::min(items, (task + 1) * chunk);
    for (int64_t item = task * chunk; item < end; ++item) {
      const int64_t m = item / blocks;
      const int64_t c0 = (item % blocks) * kBlock;
      fn(m, c0, std::min(kBlock, hidden - c0), s);
    }
    FenceStreams();
  });
}

// Runs fn(m0, count, scratch) for groups of up to kProjGroup consecutive
// tokens, in parallel.
template <typename F>
void ForTokenGroups(const OpContext& ctx, int64_t tokens, F&& fn) {
  const int64_t chunk = TokenChunk(ctx, tokens);
  ctx.pool->Run((tokens + chunk - 1) / chunk, [&](int64_t task, int thread) {
    const ThreadScratch s = ctx.Scratch(thread);
    const int64_t end = std::min(tokens, (task + 1) * chunk);
    for (int64_t m0 = task * chunk; m0 < end; m0 += kProjGroup) {
      fn(m0, static_cast<int>(std::min<int64_t>(kProjGroup, end - m0)), s);
    }
    FenceStreams();
  });
}

// Runs fn(m, scratch) for every token, in parallel.
template <typename F>
void ForTokens(const OpContext& ctx, int64_t tokens, F&& fn) {
  const int64_t chunk = TokenChunk(ctx, tokens);
  ctx.pool->Run((tokens + chunk - 1) / chunk, [&](int64_t task, int thread) {
    const ThreadScratch s = ctx.Scratch(thread);
    const int64_t end = std::min(tokens, (task + 1) * chunk);
    for (int64_t m = task * chunk; m < end; ++m) fn(m, s);
    FenceStreams();
  });
}

// ------------------------------------------------------------------ ops --

absl::Status ProjectionForward(const OpContext& ctx,
                               const ProjectionForwardParams& p);
absl::Status ProjectionBackward(const OpContext& ctx,
                                const ProjectionBackwardParams& p);
absl::Status ScaleForward(const OpContext& ctx, const ScaleForwardParams& p);
absl::Status ScaleBackward(const OpContext& ctx, const ScaleBackwardParams& p);
absl::Status SinkhornForward(const OpContext& ctx,
                             const SinkhornForwardParams& p);
absl::Status SinkhornBackward(const OpContext& ctx,
                              const SinkhornBackwardParams& p);
absl::Status AggregateForward(const OpContext& ctx,
                              const AggregateForwardParams& p);
absl::Status AggregateBackward(const OpContext& ctx,
                               const AggregateBackwardParams& p);
absl::Status PostForward(const OpContext& ctx, const PostForwardParams& p);
absl::Status PostBackward(const OpContext& ctx, const PostBackwardParams& p);
absl::Status ExpandForward(const OpContext& ctx, const ExpandForwardParams& p);
absl::Status ExpandBackward(const OpContext& ctx,
                            const ExpandBackwardParams& p);
absl::Status PreForward(const OpContext& ctx, const PreForwardParams& p);
absl::Status PreBackward(const OpContext& ctx, const PreBackwardParams& p);
absl::Status HeadForward(const OpContext& ctx, const HeadForwardParams& p);
absl::Status HeadBackward(const OpContext& ctx, const HeadBackwardParams& p);

// The optimizer step (optimizer.cc); `ws` as Backend::OptimizerWorkspaceBytes.
absl::Status OptimizerStep(ThreadPool& pool, const OptimizerStepParams& p,
                           Workspace ws);

}  // namespace mhc::cpu

#endif  // MHC_KERNELS_CPU_FAST_CPU_OPS_H_
