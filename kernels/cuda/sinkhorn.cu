// Sinkhorn-Knopp forward and exact reverse mode (LINEAR and LOG), fp32.
// The Sinkhorn plan (plans/sinkhorn.h) picks the kernel: LINEAR with n = 4,
// eps_sk >= FLT_MIN runs one thread per token (sinkhorn4.cuh; T <= 20 for
// the reverse mode); other LINEAR n from 2 to 16 with T <= 20 run lanes per
// token (sinkhorn_lanes.cuh: shuffles stay inside the token's lanes, fixed
// orders); everything else runs one thread per token with the matrix in
// registers (n = 4) or thread-local arrays and recomputes the forward from
// in-thread checkpoints.
// Determinism / batch invariance: the path depends on the spec alone, and
// the n = 4 kernels use the same per-token code whether their rows are read
// as vectors or (unaligned pointers) as scalars, so a token's bits depend on
// that token alone. Nothing per token beyond the outputs reaches global
// memory.
#include "common.cuh"
#include "dispatch.cuh"
#include "launch.h"
#include "mix.cuh"
#include "plans/sinkhorn.h"
#include "sinkhorn4.cuh"
#include "sinkhorn_lanes.cuh"

namespace mhc::cuda {
namespace {

constexpr int kTokenThreads = 64;
constexpr int kLaneThreads = 128;

// ---------------------------------------------------------------- n = 4 --
//
// One thread per token, one warp per 32 consecutive tokens (2 KB of logits).
// With kVec (every pointer 16-byte aligned) the warp moves its 2 KB with
// fully coalesced 16-byte accesses and redistributes them through a 2 KB
// shared tile, instead of each thread touching 64 scattered bytes, which
// costs one L2 sector request per thread per 4-byte access (16 per token
// each way). Without kVec each thread loads / stores its own 16 floats; the
// math is the same code, so both give the same bits.
constexpr int kSk4Threads = 128;    // forward block: 4 warps
constexpr int kSk4BwdThreads = 64;  // backward: 40 KB of kept denominators

// A warp's tile holds 128 float4: quarter k of token t is float4 q = 4t + k.
// Two access patterns: the coalesced pass (lane reads global float4 q = 32k
// + lane) and the per-token pass (lane reads q = 4 lane + k). Storing q at
// q ^ ((q >> 3) & 3) makes both conflict free: each 8-lane phase of a
// 16-byte access then hits the 8 distinct 16-byte bank groups.
__device__ __forceinline__ int TileSlot(int q) { return q ^ ((q >> 3) & 3); }

// The 16 floats of token m0 + lane as the warp fetched them: with kVec the
// coalesced float4s q = 32 k + lane (not yet this lane's token), else this
// lane's own row.
struct Fetched {
  float4 q[4];
};

template <bool kVec>
__device__ __forceinline__ void FetchTile(const float* src, int64_t m0,
                                          int64_t tokens, int lane,
                                          Fetched& f) {
  const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (kVec) {
    const float4* base = reinterpret_cast<const float4*>(src + m0 * 16);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int q = 32 * k + lane;
      f.q[k] = m0 + q / 4 < tokens ? __ldg(base + q) : zero;
    }
  } else {
    const int64_t m = m0 + lane;
    const float* row = src + m * 16;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f.q[k] = m < tokens ? make_float4(row[4 * k], row[4 * k + 1],
                                        row[4 * k + 2], row[4 * k + 3])
                          : zero;
    }
  }
}

// This lane's token from what FetchTile returned. With kVec the tile is
// written and read by the whole warp: the caller has the warp converged and
// every lane done with its previous reads of the tile.
template <bool kVec>
__device__ __forceinline__ void SpreadTile(const Fetched& f, float4* tile,
                                           int lane, float (&v)[16]) {
  float4 mine[4];
  if (kVec) {
#pragma unroll
    for (int k = 0; k < 4; ++k) tile[TileSlot(32 * k + lane)] = f.q[k];
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 4; ++k) mine[k] = tile[TileSlot(4 * lane + k)];
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) mine[k] = f.q[k];
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[4 * k] = mine[k].x;
    v[4 * k + 1] = mine[k].y;
    v[4 * k + 2] = mine[k].z;
    v[4 * k + 3] = mine[k].w;
  }
}

template <bool kVec>
__device__ __forceinline__ void StoreTile(const float (&v)[16], float4* tile,
                                          float* dst, int64_t m0,
                                          int64_t tokens, int lane) {
  float4 mine[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    mine[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
  }
  if (kVec) {
    // Each lane overwrites only its own token's slots, which only it read.
#pragma unroll
    for (int k = 0; k < 4; ++k) tile[TileSlot(4 * lane + k)] = mine[k];
    __syncwarp();
    float4* base = reinterpret_cast<float4*>(dst + m0 * 16);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int q = 32 * k + lane;
      if (m0 + q / 4 < tokens) base[q] = tile[TileSlot(q)];
    }
  } else {
    const int64_t m = m0 + lane;
    if (m >= tokens) return;
    float* row = dst + m * 16;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      row[4 * k] = mine[k].x;
      row[4 * k + 1] = mine[k].y;
      row[4 * k + 2] = mine[k].z;
      row[4 * k + 3] = mine[k].w;
    }
  }
}

template <bool kVec>
__global__ void __launch_bounds__(kSk4Threads)
    sinkhorn4_forward_kernel(int iterations, float eps, int64_t tokens,
                             const float* logits, float* h_res) {
  WaitForPrerequisiteGrid();  // the logits
  __shared__ float4 tiles[kSk4Threads / 32][128];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t m0 =
      (static_cast<int64_t>(blockIdx.x) * (kSk4Threads / 32) + warp) * 32;
  if (m0 >= tokens) return;  // whole warps only: the tile needs all lanes
  float4* tile = tiles[warp];
  Fetched f;
  FetchTile<kVec>(logits, m0, tokens, lane, f);
  float a[16], p0[16], p[16];
  SpreadTile<kVec>(f, tile, lane, a);
  // Lanes past the last token compute on zeros and store nothing.
  sk4::Forward(iterations, eps, a, p0, p, sk4::NoKeep{});
  StoreTile<kVec>(p, tile, h_res, m0, tokens, lane);
}

template <bool kVec>
__global__ void __launch_bounds__(kSk4BwdThreads)
    sinkhorn4_backward_kernel(int iterations, float eps, int64_t tokens,
                              const float* logits, const float* dh_res,
                              float* dlogits) {
  WaitForPrerequisiteGrid();  // the logits and dh_res
  __shared__ float4 kept[2 * kLaneMaxIterations * kSk4BwdThreads];
  __shared__ float4 tiles[kSk4BwdThreads / 32][128];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t m0 =
      (static_cast<int64_t>(blockIdx.x) * (kSk4BwdThreads / 32) + warp) * 32;
  if (m0 >= tokens) return;
  float4* tile = tiles[warp];
  // Both inputs are requested up front; dh_res waits in registers while the
  // forward runs, so its latency is hidden.
  Fetched fa, fg;
  FetchTile<kVec>(logits, m0, tokens, lane, fa);
  FetchTile<kVec>(dh_res, m0, tokens, lane, fg);
  float a[16], p0[16], y[16];
  SpreadTile<kVec>(fa, tile, lane, a);
  const sk4::SharedKeep<kSk4BwdThreads> keep{kept,
                                             static_cast<int>(threadIdx.x)};
  sk4::Forward(iterations, eps, a, p0, y, keep);
  float g[16];
  __syncwarp();  // every lane has read its logits from the tile
  SpreadTile<kVec>(fg, tile, lane, g);
  sk4::Backward(iterations, p0, y, g, keep, a);
  StoreTile<kVec>(a, tile, dlogits, m0, tokens, lane);
}

// Lane kernels: token m = global thread / L; a lane past the last token
// computes on zeros (it still takes part in its warp's shuffles) and stores
// nothing. A token's n x n matrix (n = N unless kPadded) fills the top-left
// of the lanes' N x N block; the rest loads as zeros and is never stored.
template <int N, int L, bool kPadded>
using LaneExtent = typename SinkhornLanes<N, L, kPadded>::Extent;

template <int N, int L, bool kPadded>
__device__ __forceinline__ void LoadRows(const float* src, int64_t m, bool live,
                                         const LaneExtent<N, L, kPadded>& ext,
                                         float (&v)[N / L][N]) {
  const int nr = ext.Stride();
  const float* row = src + m * nr * nr + ext.row0 * nr;
#pragma unroll
  for (int r = 0; r < N / L; ++r) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      v[r][j] = live && ext.Holds(r, j) ? row[r * nr + j] : 0.0f;
    }
  }
}

template <int N, int L, bool kPadded>
__device__ __forceinline__ void StoreRows(float* dst, int64_t m, bool live,
                                          const LaneExtent<N, L, kPadded>& ext,
                                          const float (&v)[N / L][N]) {
  if (!live) return;
  const int nr = ext.Stride();
  float* row = dst + m * nr * nr + ext.row0 * nr;
#pragma unroll
  for (int r = 0; r < N / L; ++r) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if (ext.Holds(r, j)) row[r * nr + j] = v[r][j];
    }
  }
}

template <int N, int L, bool kPadded>
__global__ void __launch_bounds__(kLaneThreads)
    sinkhorn_lanes_forward_kernel(int n, int iterations, float eps,
                                  int64_t tokens, const float* logits,
                                  float* h_res) {
  WaitForPrerequisiteGrid();  // the logits
  using S = SinkhornLanes<N, L, kPadded>;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t m = g / L;
  const int lane = static_cast<int>(g % L);
  const bool live = m < tokens;
  const typename S::Extent ext{n, lane * S::kRows};
  float a[S::kRows][N], p[S::kRows][N];
  LoadRows<N, L, kPadded>(logits, live ? m : 0, live, ext, a);
  S::template Forward<false>(iterations, eps, ext, a, p, typename S::Keep{});
  StoreRows<N, L, kPadded>(h_res, m, live, ext, p);
}

// The lane's rows of H_res as R in source-rows form: as stored, or
// transposed under DEST_ROWS.
template <int N, int L, bool kPadded>
__device__ __forceinline__ void StoreSourceRows(
    float* dst, int64_t m, bool live, const LaneExtent<N, L, kPadded>& ext,
    bool dest_rows, const float (&v)[N / L][N]) {
  if (!dest_rows) {
    StoreRows<N, L, kPadded>(dst, m, live, ext, v);
    return;
  }
  if (!live) return;
  const int nr = ext.Stride();
  float* block = dst + m * nr * nr + ext.row0;
#pragma unroll
  for (int r = 0; r < N / L; ++r) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if (ext.Holds(r, j)) block[j * nr + r] = v[r][j];
    }
  }
}

// r (optional): the forward's H_res in source-rows form, for the fused
// backward's residual term.
template <int N, int L, bool kPadded>
__global__ void __launch_bounds__(kLaneThreads)
    sinkhorn_lanes_backward_kernel(int n, int iterations, float eps,
                                   int64_t tokens, const float* logits,
                                   const float* dh_res, float* dlogits,
                                   float* r, bool dest_rows) {
  WaitForPrerequisiteGrid();  // the logits and dh_res
  using S = SinkhornLanes<N, L, kPadded>;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t m = g / L;
  const int lane = static_cast<int>(g % L);
  const bool live = m < tokens;
  const typename S::Extent ext{n, lane * S::kRows};
  float a[S::kRows][N], y[S::kRows][N], dy[S::kRows][N];
  LoadRows<N, L, kPadded>(logits, live ? m : 0, live, ext, a);
  __shared__ float kept[kLaneMaxIterations * S::kSlots * kLaneThreads];
  const typename S::Keep keep{kept, kLaneThreads, static_cast<int>(threadIdx.x),
                              lane};
  S::template Forward<true>(iterations, eps, ext, a, y, keep);
  if (r != nullptr) {
    StoreSourceRows<N, L, kPadded>(r, m, live, ext, dest_rows, y);
  }
  LoadRows<N, L, kPadded>(dh_res, live ? m : 0, live, ext, dy);
  S::Backward(iterations, eps, ext, a, y, dy, keep, a);
  StoreRows<N, L, kPadded>(dlogits, m, live, ext, a);
}

// f(IntTag<N>, IntTag<L>, BoolTag<kPadded>) for the plan's block of the
// lane kernels.
template <typename F>
void DispatchLanes(const SinkhornPlan& plan, F&& f) {
  DispatchBool(plan.padded, [&](auto padded_tag) {
    switch (plan.block) {
      case 2:
        f(IntTag<2>{}, IntTag<SinkhornLanesPerToken(2)>{}, padded_tag);
        return;
      case 4:
        f(IntTag<4>{}, IntTag<SinkhornLanesPerToken(4)>{}, padded_tag);
        return;
      case 8:
        f(IntTag<8>{}, IntTag<SinkhornLanesPerToken(8)>{}, padded_tag);
        return;
      case 16:
        f(IntTag<16>{}, IntTag<SinkhornLanesPerToken(16)>{}, padded_tag);
        return;
    }
  });
}

// One warp per 32 tokens.
unsigned Sk4Grid(int64_t tokens, int threads) {
  const int64_t warps = (tokens + 31) / 32;
  const int64_t per_block = threads / 32;
  return GridSize((warps + per_block - 1) / per_block);
}

unsigned LaneGrid(int64_t tokens, int lanes) {
  return GridSize((tokens * lanes + kLaneThreads - 1) / kLaneThreads);
}

// The lane kernels' reverse mode (with R when r is given).
cudaError_t LaunchLanesBackward(const DevSpec& s, const SinkhornPlan& plan,
                                int64_t tokens, const float* logits,
                                const float* dh_res, float* dlogits, float* r,
                                cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  DispatchLanes(plan, [&](auto nt, auto lt, auto pt) {
    constexpr int kN = decltype(nt)::value, kL = decltype(lt)::value;
    err = LaunchAfterPrevious(
        sinkhorn_lanes_backward_kernel<kN, kL, decltype(pt)::value>,
        dim3(LaneGrid(tokens, kL)), dim3(kLaneThreads), 0, stream, s.n,
        s.iterations, s.eps_sk, tokens, logits, dh_res, dlogits, r,
        s.dest_rows);
  });
  return err;
}

template <int NT>
__global__ void __launch_bounds__(kTokenThreads)
    sinkhorn_forward_kernel(DevSpec s, int64_t tokens, const float* logits,
                            float* h_res) {
  WaitForPrerequisiteGrid();  // the logits
  const int64_t m = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (m >= tokens) return;
  const int nn = StreamCount<NT>(s) * StreamCount<NT>(s);
  float a[NT * NT], p[NT * NT];
#pragma unroll
  for (int e = 0; e < NT * NT; ++e) a[e] = e < nn ? logits[m * nn + e] : 0.0f;
  SinkhornForwardToken<NT>(s, a, p);
#pragma unroll
  for (int e = 0; e < NT * NT; ++e) {
    if (e >= nn) break;
    h_res[m * nn + e] = p[e];
  }
}

template <int NT>
__global__ void __launch_bounds__(kTokenThreads)
    sinkhorn_backward_kernel(DevSpec s, int64_t tokens, const float* logits,
                             const float* dh_res, float* dlogits) {
  WaitForPrerequisiteGrid();  // the logits and dh_res
  const int64_t m = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (m >= tokens) return;
  const int nn = StreamCount<NT>(s) * StreamCount<NT>(s);
  float a[NT * NT], dp[NT * NT], da[NT * NT];
#pragma unroll
  for (int e = 0; e < NT * NT; ++e) {
    a[e] = e < nn ? logits[m * nn + e] : 0.0f;
    dp[e] = e < nn ? dh_res[m * nn + e] : 0.0f;
  }
  SinkhornBackwardToken<NT>(s, a, dp, da);
#pragma unroll
  for (int e = 0; e < NT * NT; ++e) {
    if (e >= nn) break;
    dlogits[m * nn + e] = da[e];
  }
}

}  // namespace

SinkhornPlan PlanOf(const SinkhornForwardParams& p) {
  return PlanSinkhornForward(*p.spec, LeastAlignment({p.logits, p.h_res}));
}

SinkhornPlan PlanOf(const SinkhornBackwardParams& p) {
  return PlanSinkhornBackward(*p.spec,
                              LeastAlignment({p.logits, p.dh_res, p.dlogits}));
}

absl::Status LaunchSinkhornForward(const SinkhornForwardParams& p,
                                   cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*p.spec);
  if (p.tokens == 0) return absl::OkStatus();
  const SinkhornPlan plan = PlanOf(p);
  cudaError_t err = cudaSuccess;
  switch (plan.variant) {
    case SinkhornVariant::kN4: {
      const unsigned grid = Sk4Grid(p.tokens, kSk4Threads);
      if (plan.vector_rows) {
        err = LaunchAfterPrevious(sinkhorn4_forward_kernel<true>, dim3(grid),
                                  dim3(kSk4Threads), 0, stream, s.iterations,
                                  s.eps_sk, p.tokens, p.logits, p.h_res);
      } else {
        err = LaunchAfterPrevious(sinkhorn4_forward_kernel<false>, dim3(grid),
                                  dim3(kSk4Threads), 0, stream, s.iterations,
                                  s.eps_sk, p.tokens, p.logits, p.h_res);
      }
      break;
    }
    case SinkhornVariant::kLanes:
      DispatchLanes(plan, [&](auto nt, auto lt, auto pt) {
        constexpr int kN = decltype(nt)::value, kL = decltype(lt)::value;
        err = LaunchAfterPrevious(
            sinkhorn_lanes_forward_kernel<kN, kL, decltype(pt)::value>,
            dim3(LaneGrid(p.tokens, kL)), dim3(kLaneThreads), 0, stream, s.n,
            s.iterations, s.eps_sk, p.tokens, p.logits, p.h_res);
      });
      break;
    case SinkhornVariant::kThread: {
      const unsigned grid =
          GridSize((p.tokens + kTokenThreads - 1) / kTokenThreads);
      DispatchMix(plan.streams, [&](auto nt) {
        err = LaunchAfterPrevious(sinkhorn_forward_kernel<decltype(nt)::value>,
                                  dim3(grid), dim3(kTokenThreads), 0, stream, s,
                                  p.tokens, p.logits, p.h_res);
      });
      break;
    }
  }
  MHC_CUDA_RETURN_IF_ERROR(err, "sinkhorn forward",
                           LaunchShape(*p.spec, p.tokens, DType::kF32));
  MHC_CUDA_CHECK_LAUNCH("sinkhorn forward",
                        LaunchShape(*p.spec, p.tokens, DType::kF32));
  return absl::OkStatus();
}

absl::Status LaunchSinkhornBackward(const SinkhornBackwardParams& p,
                                    cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(*p.spec);
  if (p.tokens == 0) return absl::OkStatus();
  const SinkhornPlan plan = PlanOf(p);
  cudaError_t err = cudaSuccess;
  switch (plan.variant) {
    case SinkhornVariant::kN4: {
      const unsigned grid = Sk4Grid(p.tokens, kSk4BwdThreads);
      if (plan.vector_rows) {
        err = LaunchAfterPrevious(sinkhorn4_backward_kernel<true>, dim3(grid),
                                  dim3(kSk4BwdThreads), 0, stream, s.iterations,
                                  s.eps_sk, p.tokens, p.logits, p.dh_res,
                                  p.dlogits);
      } else {
        err = LaunchAfterPrevious(sinkhorn4_backward_kernel<false>, dim3(grid),
                                  dim3(kSk4BwdThreads), 0, stream, s.iterations,
                                  s.eps_sk, p.tokens, p.logits, p.dh_res,
                                  p.dlogits);
      }
      break;
    }
    case SinkhornVariant::kLanes:
      err = LaunchLanesBackward(s, plan, p.tokens, p.logits, p.dh_res,
                                p.dlogits, /*r=*/nullptr, stream);
      break;
    case SinkhornVariant::kThread: {
      const unsigned grid =
          GridSize((p.tokens + kTokenThreads - 1) / kTokenThreads);
      DispatchMix(plan.streams, [&](auto nt) {
        err = LaunchAfterPrevious(sinkhorn_backward_kernel<decltype(nt)::value>,
                                  dim3(grid), dim3(kTokenThreads), 0, stream, s,
                                  p.tokens, p.logits, p.dh_res, p.dlogits);
      });
      break;
    }
  }
  MHC_CUDA_RETURN_IF_ERROR(err, "sinkhorn backward",
                           LaunchShape(*p.spec, p.tokens, DType::kF32));
  MHC_CUDA_CHECK_LAUNCH("sinkhorn backward",
                        LaunchShape(*p.spec, p.tokens, DType::kF32));
  return absl::OkStatus();
}

absl::Status LaunchSinkhornLanesBackward(const LayerSpec& spec, int64_t tokens,
                                         const float* logits,
                                         const float* dh_res, float* dlogits,
                                         float* r, cudaStream_t stream) {
  const DevSpec s = MakeDevSpec(spec);
  if (tokens == 0) return absl::OkStatus();
  const SinkhornPlan plan =
      PlanSinkhornBackward(spec, LeastAlignment({logits, dh_res, dlogits}));
  if (plan.variant != SinkhornVariant::kLanes) {
    return absl::InternalError(
        absl::StrCat("cuda sinkhorn backward (lanes) ",
                     ShapeText(LaunchShape(spec, tokens, DType::kF32)),
                     ": the Sinkhorn plan picks ", ToString(plan.variant),
                     " for this layer, not the lane kernels"));
  }
  MHC_CUDA_RETURN_IF_ERROR(
      LaunchLanesBackward(s, plan, tokens, logits, dh_res, dlogits, r, stream),
      "sinkhorn backward (lanes)", LaunchShape(spec, tokens, DType::kF32));
  MHC_CUDA_CHECK_LAUNCH("sinkhorn backward (lanes)",
                        LaunchShape(spec, tokens, DType::kF32));
  return absl::OkStatus();
}

}  // namespace mhc::cuda
