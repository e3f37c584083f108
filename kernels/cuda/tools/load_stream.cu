// The load stream probe (mhc/cuda_tools.h): how fast persistent CTAs read a
// stream-major x (tokens x streams*C) from HBM by the tensor copies of the
// projection units (boxes of 8 KiB), as a function of how many threads per
// CTA ask for them, how many boxes each keeps in flight, the CTAs per SM and
// the order of a tile's boxes. A pre forward that holds a token tile on chip
// streams this way with one CTA per SM; nothing is computed here, so the
// figure bounds such a kernel.
//
// CTAs come in groups of group_ctas: a group takes every groups-th tile of
// box_tokens tokens, and CTA r of the group the r-th share of its channel
// blocks in all streams. Each producer (lane 0 of a warp) owns a ring of its
// own and every producers-th box of the CTA's list, asking for the next as
// soon as its oldest lands. Every box's first word goes into a checksum,
// which the host compares with the one of the boxes the tensor holds: each
// box read exactly once.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common.cuh"
#include "flushed_runs.cuh"
#include "mhc/cuda_tools.h"
#include "primitives/tensor_map.h"
#include "primitives/tma.cuh"
#include "primitives/wgmma.cuh"

namespace mhc {
namespace {

using cuda::MbarrierArriveExpectBytes;
using cuda::MbarrierInit;
using cuda::MbarrierWait;
using cuda::TmaLoadTile2d;

constexpr int kBoxBytes = 8192;
constexpr int kMaxProducers = 4;
constexpr int kMaxRing = 32;
constexpr size_t kFlushBytes = size_t{256} << 20;
constexpr uint32_t kWordHash = 0x9e3779b1u;

// Word i of x holds i * kWordHash: boxes at other places sum otherwise.
__global__ void fill_words_kernel(uint32_t* words, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    words[i] = static_cast<uint32_t>(i) * kWordHash;
  }
}

struct StreamArgs {
  int tiles;
  int streams;
  int blocks;  // channel blocks of box_channels per stream
  int box_channels;
  int box_tokens;
  int group_ctas;
  int ring;
  unsigned* checksum;
};

template <bool kStreamMajor>
__global__ void __launch_bounds__(32 * kMaxProducers)
    load_stream_kernel(const __grid_constant__ CUtensorMap map, StreamArgs a) {
  extern __shared__ __align__(128) char stream_smem[];
  __shared__ __align__(8) uint64_t landed[kMaxProducers][kMaxRing];
  const int producers = blockDim.x / 32;
  const int producer = threadIdx.x / 32;
  const int groups = gridDim.x / a.group_ctas;
  const int group = blockIdx.x / a.group_ctas;
  const int rank = blockIdx.x % a.group_ctas;
  if (group >= groups || threadIdx.x % 32 != 0) return;
  const int b0 = rank * a.blocks / a.group_ctas;
  const int owned = (rank + 1) * a.blocks / a.group_ctas - b0;
  const int per_tile = owned * a.streams;
  const int my_tiles =
      a.tiles > group ? (a.tiles - group + groups - 1) / groups : 0;
  const int64_t boxes = int64_t{my_tiles} * per_tile;
  const int64_t mine =
      boxes > producer ? (boxes - producer + producers - 1) / producers : 0;
  uint64_t* bars = landed[producer];
  char* ring = stream_smem + static_cast<size_t>(producer) * a.ring * kBoxBytes;
  for (int i = 0; i < a.ring; ++i) MbarrierInit(&bars[i], 1);
  cuda::FenceMbarrierInit();

  // Box j of this producer: the CTA's box j * producers + producer.
  auto ask = [&](int64_t j, int slot) {
    const int64_t box = j * producers + producer;
    const int64_t tile = box / per_tile;
    const int within = static_cast<int>(box - tile * per_tile);
    const int stream = kStreamMajor ? within / owned : within % a.streams;
    const int block = kStreamMajor ? within % owned : within / a.streams;
    const int channel = (stream * a.blocks + b0 + block) * a.box_channels;
    const int token = static_cast<int>((group + tile * groups) * a.box_tokens);
    MbarrierArriveExpectBytes(&bars[slot], kBoxBytes);
    TmaLoadTile2d(ring + slot * kBoxBytes, &map, channel, token, &bars[slot]);
  };
  const int ahead = static_cast<int>(std::min<int64_t>(a.ring, mine));
  for (int j = 0; j < ahead; ++j) ask(j, j);
  uint32_t sum = 0;
  int slot = 0;
  uint32_t parity = 0;
  for (int64_t j = 0; j < mine; ++j) {
    MbarrierWait(&bars[slot], parity);
    sum += *reinterpret_cast<volatile uint32_t*>(ring + slot * kBoxBytes);
    // The read before the slot's next tensor copy overwrites it.
    cuda::FenceProxyAsyncShared();
    if (j + a.ring < mine) ask(j + a.ring, slot);
    if (++slot == a.ring) {
      slot = 0;
      parity ^= 1;
    }
  }
  atomicAdd(a.checksum, sum);
}

struct StreamScratch {
  void* x = nullptr;
  void* flush = nullptr;
  unsigned* checksum = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  ~StreamScratch() {
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
    for (void* p : {x, flush, static_cast<void*>(checksum)}) {
      if (p != nullptr) cudaFree(p);
    }
  }
};

absl::Status CheckProbe(const LoadStreamProbe& p) {
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat("load stream probe: ", what));
  };
  if (p.box_channels != 64 && p.box_channels != 128 && p.box_channels != 256) {
    return bad(absl::StrCat("box_channels ", p.box_channels,
                            " must be 64, 128 or 256"));
  }
  const int box_tokens = p.BoxTokens();
  if (p.channels <= 0 || p.channels % p.box_channels != 0 || p.streams < 1 ||
      p.tokens < box_tokens || p.tokens % box_tokens != 0 ||
      p.tokens / box_tokens > (int64_t{1} << 30)) {
    return bad(absl::StrCat("tokens ", p.tokens, " and channels ", p.channels,
                            " must be positive multiples of the box (",
                            box_tokens, " x ", p.box_channels, ")"));
  }
  if (p.group_ctas < 1 || p.group_ctas > p.channels / p.box_channels) {
    return bad(absl::StrCat("group_ctas ", p.group_ctas,
                            " must be in [1, channel blocks]"));
  }
  if (p.ring < 1 || p.ring > kMaxRing || p.producers < 1 ||
      p.producers > kMaxProducers || p.ctas_per_sm < 1 || p.ctas_per_sm > 16) {
    return bad(absl::StrCat("ring ", p.ring, " (1-", kMaxRing, "), producers ",
                            p.producers, " (1-", kMaxProducers,
                            ") or ctas_per_sm ", p.ctas_per_sm, " (1-16)"));
  }
  return absl::OkStatus();
}

// The sum of the first words of all the tensor's boxes.
uint32_t ExpectedChecksum(const LoadStreamProbe& p) {
  const int64_t row = int64_t{p.streams} * p.channels;
  uint32_t sum = 0;
  for (int64_t token = 0; token < p.tokens; token += p.BoxTokens()) {
    for (int64_t channel = 0; channel < row; channel += p.box_channels) {
      sum += static_cast<uint32_t>((token * row + channel) / 2) * kWordHash;
    }
  }
  return sum;
}

}  // namespace

absl::StatusOr<std::vector<LoadStreamResult>> ProbeCudaLoadStream(
    int device, const std::vector<LoadStreamProbe>& probes, int repeats) {
  const std::string what = absl::StrCat("device ", device);
  constexpr const char* kOp = "load stream probe";
  if (repeats < 1) {
    return absl::InvalidArgumentError(
        "load stream probe: repeats must be >= 1");
  }
  size_t most_bytes = 0;
  for (const LoadStreamProbe& p : probes) {
    MHC_RETURN_IF_ERROR(CheckProbe(p));
    most_bytes = std::max(most_bytes, p.Bytes());
  }
  MHC_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), kOp, what);
  int sms = 0;
  MHC_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), kOp,
      what);
  StreamScratch s;
  MHC_CUDA_RETURN_IF_ERROR(cudaMalloc(&s.x, most_bytes), kOp, what);
  MHC_CUDA_RETURN_IF_ERROR(cudaMalloc(&s.flush, kFlushBytes), kOp, what);
  MHC_CUDA_RETURN_IF_ERROR(cudaMalloc(&s.checksum, sizeof(unsigned)), kOp,
                           what);
  fill_words_kernel<<<1024, 256>>>(static_cast<uint32_t*>(s.x),
                                   static_cast<int64_t>(most_bytes / 4));
  MHC_CUDA_CHECK_LAUNCH(kOp, what);
  MHC_CUDA_RETURN_IF_ERROR(cudaEventCreate(&s.start), kOp, what);
  MHC_CUDA_RETURN_IF_ERROR(cudaEventCreate(&s.stop), kOp, what);
  std::vector<LoadStreamResult> results;
  for (const LoadStreamProbe& p : probes) {
    const int box_tokens = p.BoxTokens();
    const int64_t dims[2] = {int64_t{p.streams} * p.channels, p.tokens};
    const int64_t strides[1] = {dims[0] * 2};
    const int box[2] = {p.box_channels, box_tokens};
    CUtensorMap map;
    if (!cuda::EncodeTiledMap(s.x, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, dims,
                              strides, box, CU_TENSOR_MAP_SWIZZLE_NONE, &map)) {
      return absl::InternalError(
          absl::StrCat("load stream probe: no tensor map on ", what));
    }
    StreamArgs a{};
    a.tiles = static_cast<int>(p.tokens / box_tokens);
    a.streams = p.streams;
    a.blocks = p.channels / p.box_channels;
    a.box_channels = p.box_channels;
    a.box_tokens = box_tokens;
    a.group_ctas = p.group_ctas;
    a.ring = p.ring;
    a.checksum = s.checksum;
    const size_t smem = size_t{kBoxBytes} * p.ring * p.producers;
    const int threads = 32 * p.producers;
    auto kernel =
        p.stream_major ? load_stream_kernel<true> : load_stream_kernel<false>;
    MHC_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel,
                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem)),
        kOp, what);
    int fit = 0;
    MHC_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                 &fit, kernel, threads, smem),
                             kOp, what);
    LoadStreamResult r;
    r.ctas_per_sm = std::min(p.ctas_per_sm, fit);
    if (r.ctas_per_sm == 0) {  // the rings take more than an SM's memory
      results.push_back(r);
      continue;
    }
    r.ctas = sms * r.ctas_per_sm / p.group_ctas * p.group_ctas;
    MHC_ASSIGN_OR_RETURN(
        r.median_us,
        cuda::MedianFlushedRunUs(
            s.flush, kFlushBytes, s.start, s.stop, repeats, kOp, what,
            [&]() -> absl::Status {
              MHC_CUDA_RETURN_IF_ERROR(
                  cudaMemsetAsync(s.checksum, 0, sizeof(unsigned)), kOp, what);
              return absl::OkStatus();
            },
            [&]() -> absl::Status {
              kernel<<<r.ctas, threads, smem>>>(map, a);
              MHC_CUDA_CHECK_LAUNCH(kOp, what);
              return absl::OkStatus();
            }));
    unsigned checksum = 0;
    MHC_CUDA_RETURN_IF_ERROR(cudaMemcpy(&checksum, s.checksum, sizeof(unsigned),
                                        cudaMemcpyDeviceToHost),
                             kOp, what);
    r.every_box_once = checksum == ExpectedChecksum(p);
    results.push_back(r);
  }
  return results;
}

}  // namespace mhc
