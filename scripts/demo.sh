#!/usr/bin/env bash
# The demo: installs what is missing, builds (Release, CUDA when nvcc is
# found) into build/, starts mhcd on the best backend on a unix socket,
# runs `mhcctl info` and `mhcctl run` (one mHC layer forward and backward
# checked against a float64 reference), stops the daemon with SIGTERM and
# exits with the demo's status.
#
#   BUILD_DIR   build directory (default: build)
#   DEMO_ARGS   extra flags for `mhcctl run` (e.g. "--tokens=4096 --hidden=4096")
set -euo pipefail

cd "$(dirname "$0")/.."
bash scripts/install_deps.sh

BUILD_DIR="${BUILD_DIR:-build}"
cmake -S . -B "${BUILD_DIR}" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DMHC_CUDA=AUTO
cmake --build "${BUILD_DIR}" -j "$(nproc)" --target mhcd mhcctl

workdir="$(mktemp -d "${TMPDIR:-/tmp}/mhcd-demo.XXXXXX")"
socket="unix:${workdir}/mhcd.sock"
daemon_pid=""
cleanup() {
  if [[ -n "${daemon_pid}" ]] && kill -0 "${daemon_pid}" 2>/dev/null; then
    kill -TERM "${daemon_pid}" 2>/dev/null || true
    wait "${daemon_pid}" 2>/dev/null || true
  fi
  rm -rf "${workdir}"
}
trap cleanup EXIT

"${BUILD_DIR}/server/mhcd" --listen="${socket}" --metrics_listen=127.0.0.1:0 \
  --backend=auto >"${workdir}/mhcd.log" 2>&1 &
daemon_pid=$!

for _ in $(seq 1 300); do
  if grep -q '^mhcd: ready' "${workdir}/mhcd.log"; then break; fi
  if ! kill -0 "${daemon_pid}" 2>/dev/null; then
    echo "demo: mhcd exited before it was ready:" >&2
    cat "${workdir}/mhcd.log" >&2
    exit 1
  fi
  sleep 0.1
done
if ! grep -q '^mhcd: ready' "${workdir}/mhcd.log"; then
  echo "demo: mhcd did not become ready in 30 s:" >&2
  cat "${workdir}/mhcd.log" >&2
  exit 1
fi
sed 's/^/  /' "${workdir}/mhcd.log"
echo

mhcctl=("${BUILD_DIR}/client/cpp/mhcctl" --address="${socket}")
status=0
"${mhcctl[@]}" info || status=1
echo
# shellcheck disable=SC2086  # DEMO_ARGS is a list of flags
"${mhcctl[@]}" run ${DEMO_ARGS:-} || status=1

kill -TERM "${daemon_pid}"
wait "${daemon_pid}" || status=1
daemon_pid=""
tail -n 1 "${workdir}/mhcd.log"
echo
if [[ ${status} -eq 0 ]]; then
  echo "demo: PASS"
else
  echo "demo: FAIL" >&2
fi
exit "${status}"
