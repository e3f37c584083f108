// Device measurements beside the CUDA backend (kernels/cuda/tools, library
// mhc_cuda_tools): the daemon's copy bandwidth probe and the GPU
// benchmark's timing kernels, a probe of how far L2 holds a streamed
// tensor for a second read and one of how fast tensor copies stream it. Built
// only when CUDA is enabled.
#ifndef MHC_CUDA_TOOLS_H_
#define MHC_CUDA_TOOLS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "mhc/backend.h"

namespace mhc {

// Bytes read plus written per second by a 256 MiB device-to-device copy on
// `device`, best of a few: the roofline denominator. Takes tens of ms.
absl::StatusOr<double> MeasureCudaCopyBandwidth(int device);

// Benchmark support, enqueued on the stream of a backend made by
// MakeCudaBackend (FAILED_PRECONDITION for any other backend).
// An empty one-block kernel: what an event-timed repetition measures when
// the op itself costs nothing.
absl::Status EnqueueCudaEmptyKernel(Backend& cuda_backend);
// One thread that spins for `microseconds` of the GPU's global timer: queued
// before a timed run, it keeps the GPU busy while the host enqueues the
// run, so the events time the GPU's work and not the host's launches.
absl::Status EnqueueCudaSpin(Backend& cuda_backend, double microseconds);
// Reads `bytes` of that backend's device memory at `buffer` and writes
// nothing: an L2 flush that leaves only clean lines behind, so the timed op
// never pays for evicting the flush's dirty lines.
absl::Status EnqueueCudaReadFlush(Backend& cuda_backend, const void* buffer,
                                  size_t bytes);

// One configuration of the L2 reuse probe (kernels/cuda/tools/l2_reuse.cu):
// CTAs take units of a tensor in order and read each from HBM by bulk
// tensor-engine copies; then, with `reread`, each reads again the unit
// lag_bytes before it (modulo the tensor) by 16-byte loads, and with
// `writes` writes a quarter of those bytes to another buffer. `hints` marks
// the first read evict_last and the re-read and writes evict_first in L2.
struct L2ReuseProbe {
  int64_t unit_bytes = 32 << 10;  // a multiple of 16 KiB
  int64_t lag_bytes = 0;          // a multiple of unit_bytes
  bool reread = true;
  bool writes = false;
  bool hints = false;
  int ctas_per_sm = 4;
};

// The median event time in microseconds of each probe over `repeats` runs
// on an x_bytes tensor of `device`, each run after a write flush of L2.
// Allocates x_bytes * 5 / 4 plus 256 MiB of device memory while it runs.
absl::StatusOr<std::vector<double>> ProbeCudaL2Reuse(
    int device, size_t x_bytes, const std::vector<L2ReuseProbe>& probes,
    int repeats);

// One configuration of the load stream probe (kernels/cuda/tools/
// load_stream.cu): persistent CTAs read a bf16 tensor of tokens x
// streams * channels by tensor copies of 8 KiB boxes (box_channels wide),
// nothing computed. CTAs come in groups of group_ctas that split a tile's
// channel blocks; in a CTA, `producers` threads each keep `ring` boxes in
// flight; stream_major walks a tile's boxes stream by stream, else channel
// block by block.
struct LoadStreamProbe {
  int64_t tokens = 32768;
  int channels = 4096;
  int streams = 4;
  int group_ctas = 1;
  int ring = 8;
  int ctas_per_sm = 1;  // at most what fits the rings
  int producers = 1;    // 1 to 4
  bool stream_major = true;
  int box_channels = 64;                                 // 64, 128 or 256
  int BoxTokens() const { return 4096 / box_channels; }  // 8 KiB of bf16
  size_t Bytes() const {
    return static_cast<size_t>(tokens) * streams * channels * 2;
  }
};

struct LoadStreamResult {
  double median_us = 0;
  int ctas_per_sm = 0;  // as launched; 0: the rings do not fit an SM
  int ctas = 0;
  bool every_box_once = false;  // the boxes' checksum, of the last run
};

// The median event time of each probe over `repeats` runs on `device`, each
// after a write flush of L2, and whether the last run read every box of the
// tensor once. Allocates the largest probe's bytes plus 256 MiB of device
// memory while it runs.
absl::StatusOr<std::vector<LoadStreamResult>> ProbeCudaLoadStream(
    int device, const std::vector<LoadStreamProbe>& probes, int repeats);

}  // namespace mhc

#endif  // MHC_CUDA_TOOLS_H_
