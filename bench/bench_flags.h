// Command-line parsing shared by the benchmarks: absl flags, with --help
// listing the flags of the benchmark's own source file (absl's default is
// files named like the binary or main).
#ifndef MHC_BENCH_BENCH_FLAGS_H_
#define MHC_BENCH_BENCH_FLAGS_H_

#include <cstdio>
#include <string>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace mhc::bench {

// Parses argv into the absl flags; false (after a message) on positional
// arguments. `source` is the name of the file that defines the benchmark's
// flags, e.g. "cpu_bench.cc" or "gpu_options.cc".
inline bool ParseBenchFlags(int argc, char** argv, const char* source,
                            const char* usage) {
  static std::string own;
  own = source;
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, own);
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  absl::SetFlagsUsageConfig(config);
  absl::SetProgramUsageMessage(usage);
  if (absl::ParseCommandLine(argc, argv).size() > 1) {
    std::fprintf(stderr, "%s: takes no positional arguments (see --help)\n",
                 argv[0]);
    return false;
  }
  return true;
}

}  // namespace mhc::bench

#endif  // MHC_BENCH_BENCH_FLAGS_H_
