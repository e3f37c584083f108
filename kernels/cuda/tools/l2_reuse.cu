// The L2 reuse probe (mhc/cuda_tools.h): how much of a tensor streamed from
// HBM a second read still finds in L2, as a function of how many bytes the
// GPU streamed in between. A pre forward that reads x once from HBM would
// re-read each token tile's x from L2 after its projection and mixing; this
// measures that budget with the access pattern of the kernels involved.
//
// Each CTA takes units in order from a counter. A unit's first read is the
// projection units' pattern: bulk tensor-engine copies of 8 KiB pieces
// through a ring of three, completed on mbarriers. Then the CTA re-reads
// the unit `lag` units back the aggregate's way (modulo the tensor: the
// first units' re-reads find units not read yet, a small share of a
// tensor many times L2, and the same at every hint setting): 16-byte
// loads by every thread, eight in flight each, optionally writing a quarter
// of those bytes as the aggregate writes y. With hints, the first read asks
// L2 to keep its lines (evict_last) and the re-read and the writes to drop
// theirs first (evict_first).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common.cuh"
#include "flushed_runs.cuh"
#include "mhc/cuda_tools.h"
#include "primitives/tma.cuh"

namespace mhc {
namespace {

using cuda::CopyRing;
using cuda::SharedAddress;

constexpr int kPieceBytes = 8192;  // one projection unit stage of x
constexpr int kRing = 3;
constexpr int kThreads = 128;
constexpr int kLoadsInFlight = 8;  // 16-byte loads per thread per step
constexpr int64_t kRereadStepBytes = int64_t{kThreads} * kLoadsInFlight * 16;
constexpr size_t kFlushBytes = size_t{256} << 20;

__device__ __forceinline__ uint64_t L2EvictLast() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
}

__device__ __forceinline__ uint64_t L2EvictFirst() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;"
               : "=l"(p));
  return p;
}

template <bool kHints>
__device__ __forceinline__ void CopyPiece(void* dst, const void* src,
                                          uint64_t* bar, uint64_t policy) {
  cuda::MbarrierArriveExpectBytes(bar, kPieceBytes);
  if constexpr (kHints) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes."
        "L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(SharedAddress(dst)),
        "l"(src), "r"(kPieceBytes), "r"(SharedAddress(bar)), "l"(policy)
        : "memory");
  } else {
    cuda::BulkLoad(dst, src, kPieceBytes, bar);
  }
}

template <bool kHints>
__device__ __forceinline__ uint4 Load16(const uint4* p, uint64_t policy) {
  uint4 v;
  if constexpr (kHints) {
    asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(policy));
  } else {
    v = *p;
  }
  return v;
}

template <bool kHints>
__device__ __forceinline__ void Store16(uint4* p, uint4 v, uint64_t policy) {
  if constexpr (kHints) {
    asm volatile(
        "st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p),
        "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(policy)
        : "memory");
  } else {
    *p = v;
  }
}

__device__ __forceinline__ uint4 Xor(uint4 a, uint4 b) {
  return make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w);
}

struct ProbeArgs {
  const char* x;
  int64_t units;
  int64_t unit_bytes;  // a multiple of kPieceBytes and kRereadStepBytes
  int64_t lag_units;   // in [0, units)
  bool reread;
  char* y;  // [x bytes / 4] or null: no writes
  unsigned* next_unit;
  unsigned* sink;
};

template <bool kHints>
__global__ void __launch_bounds__(kThreads) l2_reuse_kernel(ProbeArgs a) {
  __shared__ alignas(128) char ring[kRing][kPieceBytes];
  __shared__ uint64_t bars[kRing];
  __shared__ int64_t unit_s;
  const int tid = static_cast<int>(threadIdx.x);
  const uint64_t keep = kHints ? L2EvictLast() : 0;
  const uint64_t drop = kHints ? L2EvictFirst() : 0;
  CopyRing<kRing> copies{bars};
  if (tid == 0) copies.Init();
  __syncthreads();
  const int pieces = static_cast<int>(a.unit_bytes / kPieceBytes);
  int stage = 0;
  unsigned acc = 0;
  for (;;) {
    if (tid == 0) unit_s = atomicAdd(a.next_unit, 1u);
    __syncthreads();
    const int64_t u = unit_s;
    if (u >= a.units) break;
    const char* src = a.x + u * a.unit_bytes;
    if (tid == 0) {
      for (int p = 0; p < (pieces < kRing ? pieces : kRing); ++p) {
        CopyPiece<kHints>(ring[(stage + p) % kRing], src + p * kPieceBytes,
                          copies.Barrier(stage + p), keep);
      }
    }
    for (int p = 0; p < pieces; ++p) {
      copies.Wait(stage + p);
      acc ^= reinterpret_cast<const unsigned*>(ring[(stage + p) % kRing])[tid];
      __syncthreads();  // the slot is read before it is refilled
      if (tid == 0 && p + kRing < pieces) {
        CopyPiece<kHints>(ring[(stage + p) % kRing],
                          src + (p + kRing) * kPieceBytes,
                          copies.Barrier(stage + p + kRing), keep);
      }
    }
    stage += pieces;
    if (!a.reread) continue;
    const int64_t r = (u + a.units - a.lag_units) % a.units;
    const uint4* back = reinterpret_cast<const uint4*>(a.x + r * a.unit_bytes);
    uint4* out = a.y == nullptr
                     ? nullptr
                     : reinterpret_cast<uint4*>(a.y + r * (a.unit_bytes / 4));
    const int64_t words = a.unit_bytes / 16;
    for (int64_t w0 = 0; w0 < words; w0 += kThreads * kLoadsInFlight) {
      uint4 v[kLoadsInFlight];
#pragma unroll
      for (int i = 0; i < kLoadsInFlight; ++i) {
        v[i] = Load16<kHints>(back + w0 + i * kThreads + tid, drop);
      }
#pragma unroll
      for (int i = 0; i < kLoadsInFlight; ++i) acc ^= v[i].x ^ v[i].w;
      if (out != nullptr) {
#pragma unroll
        for (int i = 0; i < kLoadsInFlight / 4; ++i) {
          const uint4 q =
              Xor(Xor(v[4 * i], v[4 * i + 1]), Xor(v[4 * i + 2], v[4 * i + 3]));
          Store16<kHints>(out + w0 / 4 + i * kThreads + tid, q, drop);
        }
      }
    }
  }
  // Never true for the probe's fill, but the compiler cannot know it.
  if (acc == 0x9e3779b9u) *a.sink = acc;
}

// Frees what it holds on every path.
struct ProbeScratch {
  void* x = nullptr;
  void* y = nullptr;
  void* flush = nullptr;
  unsigned* counters = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  ~ProbeScratch() {
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
    for (void* p : {x, y, flush, static_cast<void*>(counters)}) {
      if (p != nullptr) cudaFree(p);
    }
  }
};

absl::Status CheckProbe(const L2ReuseProbe& p, size_t x_bytes) {
  const int64_t step = std::max<int64_t>(kPieceBytes, kRereadStepBytes);
  if (p.unit_bytes <= 0 || p.unit_bytes % step != 0 ||
      static_cast<size_t>(p.unit_bytes) > x_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("L2 reuse probe: unit_bytes ", p.unit_bytes,
                     " must be a positive multiple of ", step, " within ",
                     x_bytes, " bytes"));
  }
  if (p.lag_bytes < 0 || static_cast<size_t>(p.lag_bytes) >= x_bytes ||
      p.lag_bytes % p.unit_bytes != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("L2 reuse probe: lag_bytes ", p.lag_bytes,
                     " must be a multiple of unit_bytes below ", x_bytes));
  }
  if (p.ctas_per_sm < 1 || p.ctas_per_sm > 16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "L2 reuse probe: ctas_per_sm ", p.ctas_per_sm, " not in [1, 16]"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<double>> ProbeCudaL2Reuse(
    int device, size_t x_bytes, const std::vector<L2ReuseProbe>& probes,
    int repeats) {
  const std::string what = absl::StrCat("device ", device);
  constexpr const char* kOp = "L2 reuse probe";
  if (repeats < 1) {
    return absl::InvalidArgumentError("L2 reuse probe: repeats must be >= 1");
  }
  for (const L2ReuseProbe& p : probes)
    MHC_RETURN_IF_ERROR(CheckProbe(p, x_bytes));
  MHC_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), kOp, what);
  int sms = 0;
  MHC_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), kOp,
      what);
  ProbeScratch s;
  MHC_CUDA_RETURN_IF_ERROR(cudaMalloc(&s.x, x_bytes), kOp, what);
  MHC_CUDA_RETURN_IF_ERROR(cudaMalloc(&s.y, x_bytes / 4), kOp, what);
  MHC_CUDA_RETURN_IF_ERROR(cudaMalloc(&s.flush, kFlushBytes), kOp, what);
  MHC_CUDA_RETURN_IF_ERROR(cudaMalloc(&s.counters, 2 * sizeof(unsigned)), kOp,
                           what);
  MHC_CUDA_RETURN_IF_ERROR(cudaMemset(s.x, 0x5a, x_bytes), kOp, what);
  MHC_CUDA_RETURN_IF_ERROR(cudaEventCreate(&s.start), kOp, what);
  MHC_CUDA_RETURN_IF_ERROR(cudaEventCreate(&s.stop), kOp, what);
  std::vector<double> medians;
  for (const L2ReuseProbe& p : probes) {
    ProbeArgs a{};
    a.x = static_cast<const char*>(s.x);
    a.unit_bytes = p.unit_bytes;
    a.units = static_cast<int64_t>(x_bytes) / p.unit_bytes;
    a.lag_units = p.lag_bytes / p.unit_bytes;
    a.reread = p.reread;
    a.y = p.reread && p.writes ? static_cast<char*>(s.y) : nullptr;
    a.next_unit = s.counters;
    a.sink = s.counters + 1;
    const dim3 grid(static_cast<unsigned>(sms * p.ctas_per_sm));
    MHC_ASSIGN_OR_RETURN(
        const double us,
        cuda::MedianFlushedRunUs(
            s.flush, kFlushBytes, s.start, s.stop, repeats, kOp, what,
            [&]() -> absl::Status {
              MHC_CUDA_RETURN_IF_ERROR(
                  cudaMemsetAsync(s.counters, 0, sizeof(unsigned)), kOp, what);
              return absl::OkStatus();
            },
            [&]() -> absl::Status {
              if (p.hints) {
                l2_reuse_kernel<true><<<grid, kThreads>>>(a);
              } else {
                l2_reuse_kernel<false><<<grid, kThreads>>>(a);
              }
              MHC_CUDA_CHECK_LAUNCH(kOp, what);
              return absl::OkStatus();
            }));
    medians.push_back(us);
  }
  return medians;
}

}  // namespace mhc
