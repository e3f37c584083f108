// The GPU benchmark's command line (gpu_bench.cc): its flags, and the
// Options they ask for once checked.
#ifndef MHC_BENCH_GPU_OPTIONS_H_
#define MHC_BENCH_GPU_OPTIONS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "bench/bench_configs.h"
#include "bench/gpu_cases.h"
#include "bench/gpu_timing.h"
#include "mhc/types.h"

namespace mhc::bench {

// What a run varies besides (B, T, C): the layer and its activations.
struct Shape {
  int streams = 4;
  int64_t hidden = 0;  // 0: each config's own width
  DType act = DType::kBF16;
  Layout layout = Layout::kStreamMajor;
  MatmulPrecision precision = MatmulPrecision::kTf32;  // the preset's
};

// What the flags ask for, checked.
struct Options {
  std::vector<Config> configs;
  int reps = 0;
  std::vector<bool> cases = std::vector<bool>(kNumCases, true);
  Flush flush = Flush::kWrite;
  double head_start_us = 0.0;
  bool timeline = false;
  Shape shape;
  bool keep_projection = true;
  bool shapes = false;  // the named cases instead of configs and shape
};

// "write" or "read".
const char* FlushName(Flush f);
// "tf32" or "ieee", as --precision spells them.
const char* PrecisionName(MatmulPrecision p);

// The flags as Options, or an error naming the flag.
absl::Status ParseOptions(Options& flags);

}  // namespace mhc::bench

#endif  // MHC_BENCH_GPU_OPTIONS_H_
