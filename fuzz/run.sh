#!/usr/bin/env bash
# Builds the fuzz tree (clang, ASan + UBSan, libFuzzer; MHC_FUZZ=ON) and runs
# each harness for a fixed time, starting from its committed corpus in
# fuzz/corpus/<harness>. A finding fails the script, which prints the
# reproducer's path and the command that replays it. See docs/testing.md.
#
#   FUZZ_SECONDS     seconds per harness (default 45; 0 skips fuzzing)
#   FUZZ_BUILD_DIR   build directory (default: build-fuzz)
#   FUZZ_HARNESSES   harnesses to run (default: "rpc execute checkpoint")
#   JOBS             parallel build jobs (default: number of cores)
#
#   fuzz/run.sh --seeds   rewrites the seed corpora (write_fuzz_seeds) and
#                         fuzzes nothing
set -euo pipefail
cd "$(dirname "$0")/.."

FUZZ_SECONDS="${FUZZ_SECONDS:-45}"
FUZZ_BUILD_DIR="${FUZZ_BUILD_DIR:-build-fuzz}"
FUZZ_HARNESSES="${FUZZ_HARNESSES:-rpc execute checkpoint}"
JOBS="${JOBS:-$(nproc)}"
write_seeds=0
[[ "${1:-}" == "--seeds" ]] && write_seeds=1

if [[ ${write_seeds} -eq 0 && "${FUZZ_SECONDS}" == "0" ]]; then
  echo "fuzz: FUZZ_SECONDS=0, skipped"
  exit 0
fi

start=${SECONDS}
CC=clang CXX=clang++ cmake -S . -B "${FUZZ_BUILD_DIR}" -G Ninja \
  -DCMAKE_BUILD_TYPE=Debug -DMHC_CUDA=OFF -DMHC_FUZZ=ON \
  -DMHC_BUILD_TESTS=OFF -DMHC_BUILD_BENCH=OFF >/dev/null
cmake --build "${FUZZ_BUILD_DIR}" --target mhc_fuzzers -j "${JOBS}"
echo "fuzz: built in $((SECONDS - start)) s"

export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

if [[ ${write_seeds} -eq 1 ]]; then
  "${FUZZ_BUILD_DIR}/fuzz/write_fuzz_seeds" fuzz/corpus
  exit 0
fi

status=0
for harness in ${FUZZ_HARNESSES}; do
  binary="${FUZZ_BUILD_DIR}/fuzz/${harness}_fuzzer"
  # New inputs go to a scratch corpus: the committed one is only read.
  scratch="${FUZZ_BUILD_DIR}/fuzz-scratch/${harness}"
  artifacts="${FUZZ_BUILD_DIR}/fuzz-artifacts/${harness}"
  rm -rf "${artifacts}"
  mkdir -p "${scratch}" "${artifacts}"
  echo "fuzz: ${harness} for ${FUZZ_SECONDS} s"
  if ! "${binary}" -max_total_time="${FUZZ_SECONDS}" -timeout=10 \
    -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="${artifacts}/" "${scratch}" "fuzz/corpus/${harness}" \
    2>"${artifacts}/log"; then
    tail -n 60 "${artifacts}/log" >&2
    echo "fuzz: ${harness} FAILED; reproducer(s):" >&2
    for file in "${artifacts}"/*; do
      [[ "${file}" == "${artifacts}/log" ]] && continue
      echo "  ${file}" >&2
      echo "  replay: ${binary} ${file}" >&2
    done
    status=1
  else
    grep -E '^stat::(number_of_executed_units|new_units_added)' \
      "${artifacts}/log" | sed "s/^/fuzz: ${harness} /"
  fi
done
echo "fuzz: done in $((SECONDS - start)) s"
exit "${status}"
