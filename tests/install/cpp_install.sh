#!/usr/bin/env bash
# The C++ client installs like a library: `cmake --install` (component
# client) into a fresh prefix, then tests/install_consumer, a project of its
# own, finds it with find_package(mhc CONFIG), builds against it and talks to
# a CPU mhcd. The prefix holds no kernel library, so the consumer's link
# proves the client needs none.
#
#   tests/install/cpp_install.sh BUILD_DIR MHCD_BINARY
set -euo pipefail

build="$(cd "${1:?usage: cpp_install.sh BUILD_DIR MHCD_BINARY}" && pwd)"
mhcd="${2:?usage: cpp_install.sh BUILD_DIR MHCD_BINARY}"
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/mhc-cpp-install.XXXXXX")"
daemon=""
cleanup() {
  if [[ -n "${daemon}" ]]; then
    kill "${daemon}" 2>/dev/null || true
    wait "${daemon}" 2>/dev/null || true
  fi
  rm -rf "${work}"
}
trap cleanup EXIT

prefix="${work}/prefix"
cmake --install "${build}" --prefix "${prefix}" --component client >/dev/null
for expected in include/mhc/client/client.h include/mhc/v1/service.grpc.pb.h \
  lib*/cmake/mhc/mhcConfig.cmake lib*/cmake/mhc/mhcConfigVersion.cmake; do
  # shellcheck disable=SC2086  # the pattern expands lib/lib64
  if ! ls ${prefix}/${expected} >/dev/null 2>&1; then
    echo "cpp_install: ${expected} not installed" >&2
    exit 1
  fi
done
kernel_files="$(find "${prefix}" -name '*kernels*' -o -name '*cuda*' \
  -o -name 'libmhc_core*' -o -name 'libmhc_reference*' -o -name 'libmhc_cpu*')"
if [[ -n "${kernel_files}" ]]; then
  echo "cpp_install: the client package carries kernel or CUDA files:" >&2
  echo "${kernel_files}" >&2
  exit 1
fi

# Quiet on success, the whole log on failure.
quietly() {
  if ! "$@" >"${work}/step.log" 2>&1; then
    echo "cpp_install: failed: $*" >&2
    cat "${work}/step.log" >&2
    exit 1
  fi
}
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
quietly cmake -S "${here}/../install_consumer" -B "${work}/consumer" \
  "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="${prefix}"
quietly cmake --build "${work}/consumer"

socket="unix:${work}/mhcd.sock"
"${mhcd}" --listen="${socket}" --metrics_listen= --backend=cpu --threads=1 \
  >"${work}/mhcd.log" 2>&1 &
daemon=$!
for _ in $(seq 300); do
  grep -q '^mhcd: ready' "${work}/mhcd.log" && break
  kill -0 "${daemon}" 2>/dev/null || break
  sleep 0.1
done
if ! grep -q '^mhcd: ready' "${work}/mhcd.log"; then
  echo "cpp_install: mhcd did not start:" >&2
  cat "${work}/mhcd.log" >&2
  exit 1
fi
"${work}/consumer/mhc_install_consumer" "${socket}"
