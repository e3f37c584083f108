#!/usr/bin/env bash
# Builds everything and runs every test (ctest), then checks that all C++,
# CUDA and proto sources are clang-formatted. Exits non-zero on any failure.
#
#   BUILD_DIR   build directory (default: build)
#   JOBS        parallel build and test jobs (default: number of cores)
#   FUZZ_SECONDS  seconds each fuzz harness runs (fuzz/run.sh; 0 skips)
set -euo pipefail

cd "$(dirname "$0")/.."
bash scripts/install_deps.sh

BUILD_DIR="${BUILD_DIR:-build}"
JOBS="${JOBS:-$(nproc)}"

cmake -S . -B "${BUILD_DIR}" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DMHC_CUDA="${MHC_CUDA:-AUTO}" -DMHC_BUILD_TESTS=ON
cmake --build "${BUILD_DIR}" -j "${JOBS}"

status=0
# Formatting: every tracked or new (not ignored) C++/CUDA/proto file.
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t sources < <(git ls-files --cached --others --exclude-standard \
    '*.cc' '*.h' '*.cu' '*.cuh' '*.proto')
else
  mapfile -t sources < <(find . -path './build*' -prune -o -type f \
    \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \
    -o -name '*.proto' \) -print)
fi
unformatted=()
for file in "${sources[@]}"; do
  [[ -f "${file}" ]] || continue
  if ! clang-format --style=file "${file}" | cmp -s - "${file}"; then
    unformatted+=("${file}")
  fi
done
if [[ ${#unformatted[@]} -gt 0 ]]; then
  echo "test.sh: not clang-formatted (run clang-format -i):" >&2
  printf '  %s\n' "${unformatted[@]}" >&2
  status=1
else
  echo "test.sh: clang-format clean (${#sources[@]} files)"
fi

# The fuzz harnesses, sanitized, a fixed time each from the committed corpus
# (their own clang build tree, build-fuzz).
bash fuzz/run.sh || status=1

ctest --test-dir "${BUILD_DIR}" --output-on-failure -j "${JOBS}" || status=1

# ctest's summary stays the last thing printed on success.
[[ ${status} -eq 0 ]] || echo "test.sh: FAIL" >&2
exit "${status}"
