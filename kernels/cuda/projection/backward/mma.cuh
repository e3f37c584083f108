// Tensor-core projection backward: dx = dh phi' + dms 2 v / K (+ the fused
// pre backward's aggregate and residual terms) and the per-chunk partial
// sums of dphi = dh^T v, from one read of x.
//
// A CTA owns the channels [c0, c0 + 128 / n) of every stream (128 columns
// of K) and one fixed chunk of kTokenChunk tokens, which it walks in stages
// of kStageTokens tokens through a cp.async pipeline, or for the n = 4
// layer's 16-bit rows a ring of tensor copies: a box per tile where rows sit
// on 16 bytes, a box per stream and row residue where they do not
// (projection/run_maps.h). Small batches run dx and dphi apart
// (LaunchTyped). Owning whole channels keeps the residual
// term's reads of dx_next (all streams of a channel) inside the CTA's own
// tile. Each warp owns 16 of the columns and runs two
// mma.m16n8k8 tf32 products per stage on the staged tile:
//   dx tile [tokens x 16 cols] = dh [tokens x N] . phi' [N x 16 cols]
//   dphi^T [16 cols x N]      += x^T [16 cols x tokens] . dh [tokens x N]
// phi' stays in registers for the whole CTA; x reaches the dphi mma through
// ldmatrix.trans, which hands each lane tokens 2u and 2u + 1: the mma's
// k slots u and u + 4 are mapped to those tokens for both operands.
//
// dh is rounded to tf32 once per stage, straight into the mma fragment
// layouts, so each warp's operands are single vector loads. A stage's dx
// goes over the warp's own columns of the staged x tile and leaves in whole
// rows: 16-byte stores, or for rows off the 16-byte boundary (odd C, offset
// tensors, staged through primitives/staged_slots.cuh, still asynchronous) two
// rows of element stores per instruction (RowCopy). Every mode computes the
// same bits.
//
// Numerics: 16-bit x converts to tf32 exactly. dh and phi' are rounded to
// tf32 (MATMUL_PRECISION_TF32) or split into tf32 high and low parts with the
// three-product correction (IEEE, ~2^-21 relative, fp32 x split as well).
// dphi accumulates each stage in fresh mma registers and adds the stage into
// fp32 with rounded adds, as the forward does.
//
// Determinism / batch invariance: a token's dx is a dot product over g in the
// mma's fixed order plus per-element terms, independent of M and of the
// token's slot in the tile. dphi partials are per (chunk, column), tokens in
// order within the chunk, reduced over chunks in order by
// LaunchPhiGradReduce. No atomics.
//
// This header holds the kernel; mma_stage.cuh its per-stage steps that
// take their operands as arguments, mma_tiles.cuh / mma_run_maps.cuh its
// tile geometry and copies; mma_launch.cuh its launch, which mma_bf16 /
// _f16 / _f32.cu build once per activation dtype, so the three builds (the
// largest of the library) compile in parallel.
#ifndef MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MMA_CUH_
#define MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MMA_CUH_

#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "dispatch.cuh"
#include "primitives/kernel_fit.h"
#include "primitives/staged_slots.cuh"
#include "primitives/tma.cuh"
#include "primitives/wgmma.cuh"
#include "projection/backward/mma_run_maps.cuh"
#include "projection/backward/mma_stage.cuh"
#include "projection/backward/mma_tiles.cuh"
#include "projection/backward/ms_term.cuh"
#include "projection/forward/mma.cuh"
#include "projection/geometry.h"

namespace mhc::cuda::dx_mma {

// kVectorRows: built for RowCopy::kVector alone, so the aligned path carries
// none of the other modes' registers or checks. kTerms: built with the pre
// backward's aggregate and residual terms, each switched on where the request
// has it. The vector kernels fit either way and are built with them only;
// the other modes build the plain projection backward apart, since the
// terms' registers would otherwise spill into their copy loops.
// kSummedTerms: built for proj::DxSumsTerms alone (n = 4, stream major,
// both terms); every thread sums a run of a stage's terms once for all four
// streams before the epilogue (SumStageTerms), which adds them from shared
// memory. kTensorCopies: the summed build's 16-bit vector-row form whose
// stages land by tensor copies into swizzled tiles (mma_tiles.cuh), one
// thread issuing them on the ring's barriers. kRunMaps: the summed build's
// 16-bit rows off 16 bytes, landed by the run maps of each row residue
// (mma_run_maps.cuh) and x shifted into one dense tile per stage.
template <typename T, int NT, bool kIeee, bool kVectorRows, bool kTerms,
          bool kSummedTerms, bool kTensorCopies, bool kRunMaps = false>
__global__ void __launch_bounds__(kThreads, NT <= 3 ? 2 : 1)
    dx_dphi_mma_kernel(DevSpec s, int64_t tokens, const T* __restrict__ x,
                       MmaDxDev a,
                       const __grid_constant__
                           std::conditional_t<kRunMaps, DxRunMaps, DxTensorMaps>
                               maps) {
  static_assert(!kSummedTerms || (NT == 3 && kTerms),
                "terms summed ahead: n = 4 layers");
  static_assert(
      !kTensorCopies || (kSummedTerms && kVectorRows && sizeof(T) == 2),
      "tensor copies: the summed build's 16-bit vector rows");
  static_assert(!kRunMaps || (kSummedTerms && !kVectorRows && !kTensorCopies &&
                              sizeof(T) == 2),
                "run maps: the summed build's 16-bit rows off 16 bytes");
  // Either copy build: swizzled dense tiles on the ring's barriers.
  constexpr bool kTma = kTensorCopies || kRunMaps;
  WaitForPrerequisiteGrid();  // dh and dms; apart, dphi's reads of x
  extern __shared__ __align__(16) char smem_raw[];
  char* smem = kTma ? AtomAligned(smem_raw) : smem_raw;
  constexpr int RS = RowStride<T>(NT);
  // Elements of one staged activation tile, and between its rows r and
  // r + 8 (which share their swizzle).
  constexpr int kTileElems = kStageTokens * (kTma ? kCols : RS);
  constexpr int kRowElems = kTma ? kCols / 4 : RS;
  auto tile_at = [](int row, int j) { return TileOffset<kTma, RS>(row, j); };
  constexpr int kVecElems = 16 / sizeof(T);
  constexpr int kStages = proj::DxStages(kSummedTerms, kRunMaps);
  constexpr int kDhAFloats = DhAFloats(NT);
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int grp = lane >> 2;
  const int quad = lane & 3;
  const int n = s.n;
  const int log_n = __ffs(n) - 1;
  const int wc = kCols >> log_n;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * wc;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * a.token_chunk;
  // int, so that the per-stage counts never go through 64-bit math.
  const int chunk_tokens = static_cast<int>(
      min(tokens - begin, static_cast<int64_t>(a.token_chunk)));
  const int stages = (chunk_tokens + kStageTokens - 1) / kStageTokens;
  const bool aggregate = kTerms && a.h_pre != nullptr;
  const bool residual = kTerms && a.r != nullptr;
  const bool want_dphi = a.dphi_partial != nullptr;
  // The summed build's logit count is fixed, so its dh offsets fold into
  // constants.
  const int num_logits = kSummedTerms ? kSummedLogits : s.N;
  const SmemPlan plan = PlanSmem<T, kSummedTerms, kTensorCopies, kRunMaps>(
      n, s.N, kIeee, aggregate, residual);
  T* xs = reinterpret_cast<T*>(smem + plan.x);
  T* dxns = reinterpret_cast<T*>(smem + plan.dxn);
  T* dys = reinterpret_cast<T*>(smem + plan.dy);
  float* dh_raw = reinterpret_cast<float*>(smem + plan.dh_raw);
  float* dh_a = reinterpret_cast<float*>(smem + plan.dh_a);
  float* dh_b = reinterpret_cast<float*>(smem + plan.dh_b);
  float* dmss = reinterpret_cast<float*>(smem + plan.dms);
  float* hps = reinterpret_cast<float*>(smem + plan.hp);
  float* rs = reinterpret_cast<float*>(smem + plan.r);
  float* terms_s = reinterpret_cast<float*>(smem + plan.terms);
  CopyRing<kStages> ring{reinterpret_cast<uint64_t*>(smem + plan.bars)};
  // The run maps' boxes of a stage, worked out once (mma_run_maps.cuh).
  [[maybe_unused]] RunBox* run_boxes = nullptr;
  [[maybe_unused]] int run_box_count = 0;
  if constexpr (kRunMaps) {
    __shared__ RunBox boxes[kMaxRunBoxes];
    run_boxes = boxes;
    const int gx = proj::DxRowGroup(s.K), gy = proj::DxRowGroup(s.C);
    run_box_count = RunBoxCount(gx, gy);
    if (tid < run_box_count) {
      run_boxes[tid] = RunBoxOf(tid, gx, gy, s.K, s.C, c0);
    }
  }
  if constexpr (kTma) {
    if (tid == 0) ring.Init();
    __syncthreads();
  }
  // The run maps' landed rows of stage slot buf: x, dx_next, dy.
  auto landed = [&](int buf, int tile) {
    return reinterpret_cast<const T*>(smem + plan.land +
                                      buf * proj::kDxLandStageBytes +
                                      tile * proj::kDxLandTileBytes);
  };
  // The stage's x tile: one for the run maps, which shift x into it.
  auto x_tile = [&](int buf) { return xs + (kRunMaps ? 0 : buf * kTileElems); };
  const RowCopy copy = kVectorRows ? RowCopy::kVector : a.copy;
  const T* dy = static_cast<const T*>(a.dy);
  const T* dx_next = static_cast<const T*>(a.dx_next);
  T* dx = static_cast<T*>(a.dx);

  // This thread's 16-byte vector of every activation row it copies: the
  // same columns at every stage.
  constexpr int kPerRow = kCols / kVecElems;
  constexpr int kRowStep = kThreads / kPerRow;
  const int vec_j = (tid % kPerRow) * kVecElems;
  const int vec_k = ColumnOf(s, log_n, c0, vec_j).k;
  // The same columns as a slot (RowCopy::kSlots): a run is one stream's
  // channels of the tile (stream major) or the whole tile row (minor).
  SlotColumns x_slot;
  if (s.minor) {
    const int64_t k = c0 * n + vec_j;
    x_slot = MakeSlotColumns<T>(
        k, min(static_cast<int64_t>(kCols - vec_j), s.K - k), kCols);
  } else {
    const int stream = vec_j >> (7 - log_n);
    const int chan = vec_j & (wc - 1);
    const int64_t left = min(static_cast<int64_t>(wc - chan), s.C - c0 - chan);
    x_slot = MakeSlotColumns<T>(left > 0 ? stream * s.C + c0 + chan : 0, left,
                                kCols + 2 * stream);
  }
  // Walks this thread's slots of one [kStageTokens x 128 columns] activation
  // tile (x or dx_next) whose first `rows` rows hold tokens: f(i, staged row,
  // global row, row holds a token) for its i-th row.
  constexpr int kRowsPerThread = kStageTokens / kRowStep;
  static_assert(kRowsPerThread <= kSlotPlanRows, "a plan word per tensor");
  const int row0 = tid / kPerRow;
  const int row0_offset = row0 * static_cast<int>(s.K);
  const int row_step_offset = kRowStep * static_cast<int>(s.K);
  auto for_row_slots = [&](const T* src, T* dst, int64_t m0, int rows,
                           auto&& f) {
    const T* tile = src + m0 * s.K + row0_offset;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int row = row0 + i * kRowStep;
      const bool ok = row < rows;
      f(i, dst + row * RS, ok ? tile + i * row_step_offset : src, ok);
    }
  };
  auto row_plans = [&](const T* tensor) {
    uint32_t plans = 0;
    for (int i = 0; i < kRowsPerThread && copy == RowCopy::kSlots; ++i) {
      const int64_t row = row0 + i * kRowStep;
      plans |= SlotPlanOf(tensor + row * s.K + x_slot.k, x_slot)
               << (kSlotPlanBits * i);
    }
    return plans;
  };
  const uint32_t x_plans = row_plans(x);
  const uint32_t xn_plans = residual ? row_plans(dx_next) : 0;
  // Copies one activation tile.
  auto load_rows = [&](const T* src, T* dst, int64_t m0, int rows,
                       uint32_t plans) {
    if (copy == RowCopy::kVector) {
      for_row_slots(src, dst, m0, rows,
                    [&](int, T* drow, const T* srow, bool ok) {
                      const bool in = ok && vec_k >= 0;
                      CpAsync<16>(drow + vec_j, in ? srow + vec_k : src, in);
                    });
      return;
    }
    if (copy == RowCopy::kSlots) {
      for_row_slots(src, dst, m0, rows,
                    [&](int i, T* drow, const T* srow, bool ok) {
                      IssueSlot(drow, vec_j, srow, x_slot, ok,
                                RowPlan(plans, i), src + tokens * s.K);
                    });
      return;
    }
    for (int v = tid; v < kStageTokens * kPerRow; v += kThreads) {
      const int row = v / kPerRow;
      const int j = (v % kPerRow) * kVecElems;
      T* d = dst + row * RS + j;
      // Unaligned rows: element copies, each column checked (odd C).
      for (int e = 0; e < kVecElems; ++e) {
        const Column ce = ColumnOf(s, log_n, c0, j + e);
        d[e] = row < rows && ce.k >= 0 ? src[(m0 + row) * s.K + ce.k]
                                       : FromFloat<T>(0.0f);
      }
    }
  };
  // This thread's slot of the dy rows ([kStageTokens x wc channels] of an
  // [M, C] tensor, wc / kVecElems slots per row: a divisor of 32), counted
  // from thread FirstThread::kDy.
  const int dy_per_row = wc / kVecElems;
  const int dy_tid = (tid - FirstThread::kDy) & (kThreads - 1);
  const int dy_c = (dy_tid % dy_per_row) * kVecElems;
  const int dy_row0 = dy_tid / dy_per_row;
  const int dy_row_step = kThreads / dy_per_row;
  const SlotColumns dy_slot = MakeSlotColumns<T>(
      c0 + dy_c, min(static_cast<int64_t>(wc - dy_c), s.C - c0 - dy_c), wc);
  auto for_dy_slots = [&](T* dst, int64_t m0, int rows, auto&& f) {
    int i = 0;
    for (int row = dy_row0; row < kStageTokens; row += dy_row_step, ++i) {
      const bool ok = row < rows;
      f(i, dst + row * plan.dy_row, ok ? dy + (m0 + row) * s.C : dy, ok);
    }
  };
  uint32_t dy_plans = 0;
  if (aggregate && copy == RowCopy::kSlots) {
    // Plans from the rows' own offsets (a stage's global rows stop at M).
    for_dy_slots(dys, 0, kStageTokens, [&](int i, T*, const T*, bool) {
      const int64_t row = dy_row0 + i * dy_row_step;
      dy_plans |= SlotPlanOf(dy + row * s.C + dy_slot.k, dy_slot)
                  << (kSlotPlanBits * i);
    });
  }
  // First token and valid tokens of stage st.
  auto first_token = [&](int st) {
    return begin + static_cast<int64_t>(st) * kStageTokens;
  };
  auto rows_of = [&](int st) {
    return min(chunk_tokens - st * kStageTokens, kStageTokens);
  };
  auto load_run = [&](float* dst, const float* base, int width, int64_t m0,
                      int rows, int first) {
    LoadStageRun(dst, base, width, m0, rows, tid, first, a.runs16);
  };
  // The terms' tensors as the TermsTag has them (stage_dx below).
  auto load_stage = [&](int st, auto terms_tag) {
    using Terms = decltype(terms_tag);
    constexpr int kTermsN = Terms::value;
    if (st >= stages) return;
    const int buf = st % kStages;
    const int64_t m0 = first_token(st);
    const int rows = rows_of(st);
    load_rows(x, xs + buf * kTileElems, m0, rows, x_plans);
    load_run(dh_raw + buf * kStageTokens * num_logits, a.dh, num_logits, m0,
             rows, FirstThread::kDh);
    load_run(dmss + buf * kStageTokens, a.dms, 1, m0, rows, FirstThread::kDms);
    if constexpr (kTermsN == 0) return;
    const int tn = kTermsN > 0 ? kTermsN : n;
    if (Terms::Residual(residual)) {
      load_rows(dx_next, dxns + buf * kTileElems, m0, rows, xn_plans);
      load_run(rs + buf * kStageTokens * tn * tn, a.r, tn * tn, m0, rows,
               FirstThread::kR);
    }
    T* dy_dst = dys + buf * kStageTokens * plan.dy_row;
    if (copy == RowCopy::kElements) {
      for (int v = tid; v < kStageTokens * wc; v += kThreads) {
        const int row = v / wc;
        const int c = v % wc;
        dy_dst[row * plan.dy_row + c] = row < rows && c0 + c < s.C
                                            ? dy[(m0 + row) * s.C + c0 + c]
                                            : FromFloat<T>(0.0f);
      }
    } else {
      for_dy_slots(dy_dst, m0, rows,
                   [&](int i, T* drow, const T* srow, bool ok) {
                     if (copy == RowCopy::kVector) {
                       const bool in = ok && dy_slot.valid > 0;
                       CpAsync<16>(drow + dy_c, in ? srow + dy_slot.k : dy, in);
                     } else {
                       IssueSlot(drow, dy_c, srow, dy_slot, ok,
                                 RowPlan(dy_plans, i), dy + tokens * s.C);
                     }
                   });
    }
    load_run(hps + buf * kStageTokens * tn, a.h_pre, tn, m0, rows,
             FirstThread::kHPre);
  };

  // Realigns this thread's unaligned 16-bit slots of a landed stage.
  auto realign_stage = [&](int st) {
    if (sizeof(T) == 4 || copy != RowCopy::kSlots) return;
    const int buf = st % kStages;
    const int64_t m0 = first_token(st);
    const int rows = rows_of(st);
    auto realign_rows = [&](T* tile, uint32_t plans) {
      // Only the staged rows matter here; x stands in for the global rows.
      for_row_slots(x, tile, m0, rows, [&](int i, T* drow, const T*, bool ok) {
        RealignSlot(drow, vec_j, x_slot, ok, RowPlan(plans, i));
      });
    };
    realign_rows(xs + buf * kTileElems, x_plans);
    if (residual) realign_rows(dxns + buf * kTileElems, xn_plans);
    if (aggregate) {
      for_dy_slots(dys + buf * kStageTokens * plan.dy_row, m0, rows,
                   [&](int i, T* drow, const T*, bool ok) {
                     RealignSlot(drow, dy_c, dy_slot, ok, RowPlan(dy_plans, i));
                   });
    }
  };

  // Stage st's tiles and runs by tensor copies (kTensorCopies), all on the
  // barrier of its slot: rows past the tensor land as zeros.
  auto issue_stage = [&](int st) {
    if constexpr (kTensorCopies) {
      if (st >= stages || tid != 0) return;
      const int buf = st % kStages;
      const int m0 = static_cast<int>(first_token(st));
      const int cx = static_cast<int>(c0);
      // x, dx_next, dy, then the runs of dh, dms, H_pre and R.
      constexpr int kStageBytes =
          kStageTokens * (2 * kCols * sizeof(T) + kCols / 4 * sizeof(T) +
                          (kSummedLogits + 1 + 4 + 16) * 4);
      uint64_t* bar = ring.Barrier(st);
      MbarrierArriveExpectBytes(bar, kStageBytes);
      TmaLoadTile3d(xs + buf * kTileElems, &maps.x, cx, m0, 0, bar);
      TmaLoadTile3d(dxns + buf * kTileElems, &maps.dx_next, cx, m0, 0, bar);
      TmaLoadTile2d(dys + buf * kStageTokens * plan.dy_row, &maps.dy, cx, m0,
                    bar);
      TmaLoadTile2d(dh_raw + buf * kStageTokens * num_logits, &maps.dh, 0, m0,
                    bar);
      TmaLoadTile1d(dmss + buf * kStageTokens, &maps.dms, m0, bar);
      TmaLoadTile2d(hps + buf * kStageTokens * 4, &maps.h_pre, 0, m0, bar);
      TmaLoadTile2d(rs + buf * kStageTokens * 16, &maps.r, 0, m0, bar);
    } else if constexpr (kRunMaps) {
      // Warp 0 asks for the stage's boxes a lane each (up to 24 row boxes,
      // then the four runs on the last lanes), so no lane walks them in turn.
      static_assert(kMaxRunBoxes + 4 <= 32, "a box per lane");
      if (st >= stages || warp != 0) return;
      const int buf = st % kStages;
      const int m0 = static_cast<int>(first_token(st));
      // Every box lands whole: x and dx_next 4 x 32 rows of kDxLandElems,
      // dy 32 rows, then the runs of dh, dms, H_pre and R.
      constexpr int kStageBytes =
          kStageTokens * ((2 * 4 + 1) * proj::kDxLandElems * sizeof(T) +
                          (kSummedLogits + 1 + 4 + 16) * 4);
      uint64_t* bar = ring.Barrier(st);
      if (lane == 0) MbarrierArriveExpectBytes(bar, kStageBytes);
      __syncwarp();
      if (lane < run_box_count) {
        IssueRunBox(run_boxes[lane], maps,
                    smem + plan.land + buf * proj::kDxLandStageBytes, m0, bar);
      } else if (lane == 28) {
        TmaLoadTile2d(dh_raw + buf * kStageTokens * num_logits, &maps.dh, 0, m0,
                      bar);
      } else if (lane == 29) {
        TmaLoadTile1d(dmss + buf * kStageTokens, &maps.dms, m0, bar);
      } else if (lane == 30) {
        TmaLoadTile2d(hps + buf * kStageTokens * 4, &maps.h_pre, 0, m0, bar);
      } else if (lane == 31) {
        TmaLoadTile2d(rs + buf * kStageTokens * 16, &maps.r, 0, m0, bar);
      }
    }
  };

  // This thread's run of summed terms (kSummedTerms): a half-warp takes two
  // tokens whose staged runs fall on disjoint banks: four rows apart in the
  // padded tiles (16-bit rows 16 bytes apart mod 128), rows a and a ^ 5 in
  // the swizzled ones (their dense 64-byte dy rows and their dx_next runs
  // in opposite halves of the banks).
  static_assert(kStageTokens * (kCols / 16) == kThreads,
                "a run of four channels of every stream per thread");
  [[maybe_unused]] const int sum_row_first = tid / 16 / 4 * 8 + tid / 16 % 4;
  [[maybe_unused]] const int sum_row = kTma ? sum_row_first ^ (tid / 8 % 2 * 5)
                                            : sum_row_first + tid / 8 % 2 * 4;
  [[maybe_unused]] const int sum_c = tid % 8 * 4;
  // The run maps' shift of x and where the terms' rows landed.
  [[maybe_unused]] XShift x_shift;
  [[maybe_unused]] TermsLanding terms_landing;
  if constexpr (kRunMaps) {
    x_shift = XShiftOf(warp, lane, proj::DxRowGroup(s.K), s.K, s.C, c0);
    terms_landing = TermsLandingOf(sum_row, sum_c, s.K, s.C, c0);
  }

  // This warp's 16 columns: j0 .. j0 + 15.
  const int j0 = warp * 16;
  // phi' fragments (B of the dx product): rows g = 8 kt + quad (+4), column
  // j0 + 8 nt + grp.
  uint32_t ph_hi[NT][2][2];
  [[maybe_unused]] uint32_t ph_lo[NT][2][2];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const Column col = ColumnOf(s, log_n, c0, j0 + 8 * nt + grp);
    const float gm = a.gamma != nullptr && col.k >= 0 ? a.gamma[col.k] : 1.0f;
#pragma unroll
    for (int kt = 0; kt < NT; ++kt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int g = 8 * kt + quad + 4 * h;
        const float v =
            col.k >= 0 && g < s.N ? a.phi[g * s.K + col.k] * gm : 0.0f;
        SplitTf32<kIeee>(v, ph_hi[kt][nt][h], ph_lo[kt][nt][h]);
      }
    }
  }
  const float ms_scale = 2.0f / static_cast<float>(s.K);
  // This lane's part of storing the warp's dx rows (16 columns each), every
  // kStoreRows rows from store_row: with vector rows 16 bytes (kStoreLanes
  // lanes per row; each quarter warp reads rows kStoreLanes apart, which sit
  // in distinct banks), else one element (16 lanes per row).
  constexpr int kStoreLanes = kVectorRows ? 16 / kVecElems : 16;
  constexpr int kStoreRows = 32 / kStoreLanes;
  const int quarter = lane >> 3;
  // Swizzled tiles: a quarter's rows {0, 1, 4, 5} (+ 2, 8, 10), whose
  // chunk pairs fill all eight 16-byte bank groups.
  const int store_row =
      kTensorCopies ? (lane & 7) / 2 % 2 + (lane & 7) / 4 * 4 +
                          quarter % 2 * 2 + quarter / 2 * 8
      : kVectorRows ? (lane & 7) / kStoreLanes * kStoreLanes +
                          quarter % kStoreLanes + quarter / kStoreLanes * 8
                    : lane >> 4;
  const int store_j =
      j0 + (kVectorRows ? lane % kStoreLanes * kVecElems : lane & 15);
  const int store_k = ColumnOf(s, log_n, c0, store_j).k;
  const int store_step = kStoreRows * static_cast<int>(s.K);

  float dphi[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dphi[nt][e] = 0.0f;
  }

  // dx for the stage's tokens and this warp's columns, stored to global
  // (out: this lane's first store row of the stage, which the summed build's
  // caller steps and the others work out here). Rows past the stage's tokens
  // compute (zero-filled, finite) values too, so the epilogue runs without
  // branches; only the stores below skip them. any_scaled (always true
  // outside the summed build): some token of the stage takes the scaled
  // mean-square term; the others' terms are the same fma either way, so a
  // stage without one skips the scaling.
  // terms_tag: a TermsTag, each a separate copy of the stage loop so none
  // carries another's checks. The lane's staged rows are set once per
  // stage: every pair below is them plus compile-time offsets.
  auto stage_dx = [&](int buf, int64_t m0, int rows, T* out, bool any_scaled,
                      auto terms_tag) {
    using Terms = decltype(terms_tag);
    constexpr int kTermsN = Terms::value;
    T* xt = x_tile(buf);
    const int lane_row = buf * kStageTokens + grp;
    T* x_pairs = xt + tile_at(grp, j0 + 2 * quad);
    // The pair 8 columns right: the next chunk, which the swizzle puts one
    // chunk left or right.
    const int nt_step = tile_at(grp, j0 + 8) - tile_at(grp, j0);
    const float* dms_rows = dmss + lane_row;
    [[maybe_unused]] const float* terms_pairs =
        terms_s + grp * kTermsStride + j0 + 2 * quad;
    [[maybe_unused]] TermLane<T> terms;
    if constexpr (kTermsN > 0) {
      terms = TermLaneOf<T, kTermsN, RS>(Terms::Minor(s.minor), j0, quad,
                                         lane_row, dxns, dys, hps, rs);
    }
    // The stage's dx goes over this warp's own columns of the x tile, which
    // the other lanes' ldmatrix reads must have left. All products, then all
    // terms, then all stores: a store into the x tile may alias any staged
    // operand as far as the compiler knows, so a load after it would wait
    // for it.
    __syncwarp();
    constexpr int kMt = kStageTokens / 16;
    float d[kMt][2][4];
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) d[mt][nt][e] = 0.0f;
      }
#pragma unroll
      for (int kt = 0; kt < NT; ++kt) {
        // Logits 8 kt + quad (+4) of tokens 16 mt + grp (+8).
        const float* p = dh_a + ((mt * NT + kt) * 32 + lane) * 4;
        float hi[4];
        [[maybe_unused]] float lo[4];
        LoadVec<float, 4>(p, hi);
        if constexpr (kIeee) LoadVec<float, 4>(p + kDhAFloats, lo);
        uint32_t ah[4];
        [[maybe_unused]] uint32_t al[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          ah[e] = __float_as_uint(hi[e]);
          if constexpr (kIeee) al[e] = __float_as_uint(lo[e]);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          Mma1688(d[mt][nt], ah, __uint_as_float(ph_hi[kt][nt][0]),
                  __uint_as_float(ph_hi[kt][nt][1]));
          if constexpr (kIeee) {
            Mma1688(d[mt][nt], al, __uint_as_float(ph_hi[kt][nt][0]),
                    __uint_as_float(ph_hi[kt][nt][1]));
            Mma1688(d[mt][nt], ah, __uint_as_float(ph_lo[kt][nt][0]),
                    __uint_as_float(ph_lo[kt][nt][1]));
          }
        }
      }
    }
    // The lane's output pair of rows dt and the 8 nt columns right of its
    // first: d[mt][nt][2 h], d[mt][nt][2 h + 1] with dt = 16 mt + 8 h.
    auto add_terms = [&](auto scaled_tag) {
      constexpr bool kScaled = decltype(scaled_tag)::value;
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int dt = mt * 16 + 8 * h;  // rows below the lane's first
          const float dms = dms_rows[dt];
          [[maybe_unused]] MsTerm dm;
          if constexpr (kScaled) dm = MsTermOf(dms, ms_scale);
          const float dm_unscaled = dms * ms_scale;
          auto add_ms = [&](float v, float acc) {
            return kScaled ? dm.Add(v, acc) : fmaf(dm_unscaled, v, acc);
          };
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            const float2 v = LoadPair(x_pairs + dt * kRowElems + nt * nt_step);
            float out[2] = {add_ms(v.x, d[mt][nt][2 * h]),
                            add_ms(v.y, d[mt][nt][2 * h + 1])};
            if constexpr (kSummedTerms) {
              const float2 t = *reinterpret_cast<const float2*>(
                  terms_pairs + dt * kTermsStride + 8 * nt);
              out[0] += t.x;
              out[1] += t.y;
            } else if constexpr (kTermsN > 0) {
              AddTerms<T, kTermsN, RS>(Terms::Minor(s.minor),
                                       Terms::Residual(residual), terms, dt, nt,
                                       out);
            } else if constexpr (kTermsN < 0) {
              const int row = lane_row + dt;
              AddGenericTerms(s, log_n, c0, j0 + 8 * nt + 2 * quad,
                              dxns + row * RS, dys + row * plan.dy_row,
                              hps + row * n, rs + row * n * n, residual, out);
            }
            d[mt][nt][2 * h] = out[0];
            d[mt][nt][2 * h + 1] = out[1];
          }
        }
      }
    };
    if (any_scaled) {
      add_terms(std::true_type{});
    } else if constexpr (kSummedTerms) {
      add_terms(std::false_type{});
    }
    // Into the x slots whose last reads were above; to dx below.
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float out[2] = {d[mt][nt][2 * h], d[mt][nt][2 * h + 1]};
          StoreVec<T, 2>(x_pairs + (mt * 16 + 8 * h) * kRowElems + nt * nt_step,
                         out);
        }
      }
    }
    __syncwarp();
    if constexpr (kRunMaps) {
      const int half = lane >> 4;  // rows b + half, b even
      StoreDxElements(xt + tile_at(half, store_j), store_j,
                      dx + (m0 + half) * s.K + store_k, s.K, rows - half,
                      store_k >= 0);
      return;
    }
    // Whole rows of the warp's columns per instruction, so each writes whole
    // sectors (vector rows) or at least never pairs of 2-byte halves.
    if constexpr (!kSummedTerms) out = dx + (m0 + store_row) * s.K + store_k;
    static_assert(kStoreRows % 8 == 0 || !kTensorCopies, "rows keep swizzle");
    const T* staged = xt + tile_at(store_row, store_j);
#pragma unroll
    for (int i = 0; i < kStageTokens / kStoreRows; ++i) {
      const int t = store_row + i * kStoreRows;
      if (t < rows && store_k >= 0) {
        if constexpr (kVectorRows) {
          *reinterpret_cast<uint4*>(out + i * store_step) =
              *reinterpret_cast<const uint4*>(staged +
                                              i * kStoreRows * kRowElems);
        } else {
          out[i * store_step] = staged[i * kStoreRows * kRowElems];
        }
      }
    }
    // The slot's next tensor copies follow these generic accesses.
    if constexpr (kTensorCopies) FenceProxyAsyncShared();
  };

  // This lane's first dx store row of each stage: the summed build moves it
  // a stage further each time, the others work it out per stage.
  const int64_t dx_stage_step = int64_t{kStageTokens} * s.K;
  auto run_stages = [&](auto terms_tag) {
    T* dx_stage = nullptr;
    if (kSummedTerms && !a.skip_dx) {
      dx_stage = dx + (begin + store_row) * s.K + store_k;
    }
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if constexpr (kTma) {
        issue_stage(st);
      } else {
        load_stage(st, terms_tag);
        CpAsyncCommit();
      }
    }
    for (int st = 0; st < stages; ++st) {
      if constexpr (kTma) {
        // Every thread is past stage st - 1, whose slot the copies refill
        // (and, with run maps, whose x tile the shift rewrites).
        __syncthreads();
        issue_stage(st + kStages - 1);
        ring.Wait(st);
        if constexpr (kRunMaps) ShiftRuns(x_shift, landed(st % kStages, 0), xs);
      } else {
        CpAsyncWait<kStages - 2>();
        realign_stage(st);
        __syncthreads();
        load_stage(st + kStages - 1, terms_tag);
        CpAsyncCommit();
      }
      const int buf = st % kStages;
      ConvertDhFragments<NT, kIeee>(dh_raw + buf * kStageTokens * num_logits,
                                    num_logits, dh_a, dh_b, tid, !a.skip_dx,
                                    want_dphi);
      if constexpr (kRunMaps) {
        SumLandedTerms(terms_landing, sum_row, sum_c, landed(buf, 1),
                       landed(buf, 2), hps + buf * kStageTokens * 4,
                       rs + buf * kStageTokens * 16,
                       terms_s + sum_row * kTermsStride);
      } else if constexpr (kSummedTerms) {
        // The stage's terms landed before its first barrier: 32 tokens x 8
        // runs of four channels, a run per thread.
        SumStageTerms<T, kTensorCopies, RS,
                      kTensorCopies ? kCols / 4 : DyRow<T>(4)>(
            sum_row, sum_c, dxns + buf * kTileElems,
            dys + buf * kStageTokens * plan.dy_row,
            hps + buf * kStageTokens * 4, rs + buf * kStageTokens * 16,
            terms_s + sum_row * kTermsStride);
      }
      // The stage's terms and dh fragments are in place past this barrier,
      // which in the summed build also tells every thread whether a token's
      // mean-square term is scaled.
      bool any_scaled = true;
      if constexpr (kSummedTerms) {
        any_scaled = __syncthreads_or(
            tid < kStageTokens &&
            MsTermScaled(dmss[buf * kStageTokens + tid], ms_scale));
      } else {
        __syncthreads();
      }
      if (want_dphi) {
        StageDphiProducts<T, NT, kIeee, kTma, RS>(x_tile(buf), dh_b, lane, j0,
                                                  dphi);
      }
      if (!a.skip_dx) {
        stage_dx(buf, first_token(st), rows_of(st), dx_stage, any_scaled,
                 terms_tag);
        if constexpr (kSummedTerms) dx_stage += dx_stage_step;
      }
    }
  };
  // The residual term comes only with the aggregate one (the fused pre
  // backward), so !aggregate is the plain projection backward.
  if constexpr (kSummedTerms) {
    run_stages(TermsTag<4, 0, 1>{});
  } else if (!aggregate) {
    run_stages(TermsTag<0>{});
  } else if constexpr (kTerms) {
    // n = 4 layers have 24 logits (NT = 3), n = 8 layers 80; heads of n = 4
    // and 8 up to 8 (NT = 1), and no residual term. Vector rows fix the
    // layout and the residual flag per stage loop; the slot and element
    // copies read them at run time (built fixed, their pre backward ran many
    // times slower: docs/decisions.md).
    auto with_flags = [&](auto n_tag) {
      constexpr int kN = decltype(n_tag)::value;
      auto with_layout = [&](auto minor_tag) {
        constexpr int kMinor = decltype(minor_tag)::value;
        if (!residual) {
          run_stages(TermsTag<kN, kMinor, 0>{});
        } else if constexpr (NT != 1) {
          run_stages(TermsTag<kN, kMinor, 1>{});
        } else {
          run_stages(TermsTag<kN>{});
        }
      };
      if constexpr (!kVectorRows) {
        run_stages(TermsTag<kN>{});
      } else if (s.minor) {
        with_layout(IntTag<1>{});
      } else {
        with_layout(IntTag<0>{});
      }
    };
    if (n == 4 && NT != kMaxTiles) {
      with_flags(IntTag<4>{});
    } else if (n == 8 && NT != 3) {
      with_flags(IntTag<8>{});
    } else {
      run_stages(TermsTag<-1>{});
    }
  }
  CpAsyncWait<0>();
  if (!want_dphi) return;
  StoreDphiPartial(s, log_n, c0, j0, lane, dphi,
                   a.dphi_partial + blockIdx.y * s.N * s.K);
}

}  // namespace mhc::cuda::dx_mma

#endif  // MHC_KERNELS_CUDA_PROJECTION_BACKWARD_MMA_CUH_
