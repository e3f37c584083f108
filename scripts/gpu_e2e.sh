#!/usr/bin/env bash
# The torch layer through the daemon on a GPU machine, end to end: starts the
# bundle's mhcd on the GPU (a unix socket for CUDA IPC, a loopback TCP port
# for inline tensors, metrics on loopback), runs the Python client's test
# suite, the layer's correctness check against the float64 reference, and
# bench/e2e_torch.py over both transports, all configs, n = 4 and 8; then
# stops the daemon with SIGTERM. Logs and the benchmark's JSON lines and
# table go to LOG_DIR (default: the current directory); the exit code counts
# failures.
#
#   scripts/gpu_e2e.sh BUNDLE_DIR [LOG_DIR]
#
# Needs python3 with torch, grpcio, protobuf and numpy (pytest for the
# suite, skipped without it). Run from a checkout: the client, its tests and
# the benchmark come from here (the generated protobuf/gRPC modules are
# committed, so the GPU machine needs no protoc); the native extension comes
# from BUNDLE_DIR/python. E2E_ARGS adds flags to the benchmark run (for
# example E2E_ARGS='--configs=0 --n=4' for a quick one), PYTEST_ARGS picks
# the tests (default: the whole suite; "none" skips it), and MHC_MPS=1 runs
# the daemon and the clients under a private CUDA MPS control daemon (its
# pipe directory lives in the run's temporary folder), so that their work
# shares the GPU without time slicing between processes.
set -uo pipefail

bundle="$(cd "${1:?usage: scripts/gpu_e2e.sh BUNDLE_DIR [LOG_DIR]}" && pwd)"
logs="${2:-.}"
mkdir -p "${logs}"
logs="$(cd "${logs}" && pwd)"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export LD_LIBRARY_PATH="${bundle}/lib${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
export PYTHONPATH="${repo}/client/python:${bundle}/python:${repo}/bench${PYTHONPATH:+:${PYTHONPATH}}"
# NVLink SHARP multicast stays off on the lent machines.
export NCCL_NVLS_ENABLE=0
python="${PYTHON:-python3}"
bin="${bundle}/bin"
failures=0

# shellcheck source=scripts/step.sh
source "$(dirname "${BASH_SOURCE[0]}")/step.sh"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"${python}" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
if ! "${python}" -c 'import mhc_client._pb' 2>"${logs}/stubs.log"; then
  echo "FAIL stubs: mhc_client._pb not importable (committed under client/python)"
  cat "${logs}/stubs.log"
  exit 1
fi

work="$(mktemp -d)"
sock="unix:${work}/mhcd.sock"
mps=""
if [[ "${MHC_MPS:-0}" == 1 ]]; then
  mps="$(command -v nvidia-cuda-mps-control ||
    ls /usr/local/nvidia/bin/nvidia-cuda-mps-control 2>/dev/null)"
  if [[ -z "${mps}" ]]; then
    echo "FAIL MHC_MPS=1 but nvidia-cuda-mps-control is not installed"
    exit 1
  fi
  export CUDA_MPS_PIPE_DIRECTORY="${work}/mps" CUDA_MPS_LOG_DIRECTORY="${work}/mps"
  mkdir -p "${CUDA_MPS_PIPE_DIRECTORY}"
  "${mps}" -d
  echo "CUDA MPS control daemon started (${CUDA_MPS_PIPE_DIRECTORY})"
fi
"${bin}/mhcd" --backend=cuda --listen="${sock},127.0.0.1:0" \
  --metrics_listen=127.0.0.1:0 --allow_shm >"${logs}/mhcd.log" 2>&1 &
daemon=$!
for _ in $(seq 1 150); do
  grep -q '^mhcd: ready' "${logs}/mhcd.log" && break
  kill -0 "${daemon}" 2>/dev/null || break
  sleep 0.2
done
if ! grep -q '^mhcd: ready' "${logs}/mhcd.log"; then
  echo "FAIL mhcd did not start: tail of mhcd.log"
  tail -n 15 "${logs}/mhcd.log"
  kill -TERM "${daemon}" 2>/dev/null
  rm -rf "${work}"
  exit 1
fi
# Port 0 is resolved in the daemon's "listening on" line.
tcp="$(sed -n 's|^mhcd: listening on \(127\.0\.0\.1:[0-9]*\)$|\1|p' "${logs}/mhcd.log" | head -n 1)"
metrics="$(sed -n 's|^mhcd: metrics on \(http://[^ ]*\)|\1|p' "${logs}/mhcd.log")"
echo "mhcd on ${sock} and ${tcp:-?}, metrics ${metrics:-?}"

# (a) The client's suite. Its conftest starts a daemon of its own from
# MHCD_BINARY (MHCD_ADDRESS is for a conftest that can use this one).
if [[ "${PYTEST_ARGS:-}" == none ]]; then
  echo "SKIP client_pytest (PYTEST_ARGS=none)"
elif "${python}" -c 'import pytest' 2>/dev/null; then
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
  step client_pytest env MHCD_BINARY="${bin}/mhcd" MHCD_BACKEND=cuda \
    MHCD_ADDRESS="${sock}" "${python}" -m pytest -q -p no:cacheprovider \
    ${PYTEST_ARGS:-"${repo}/client/python/tests"}
else
  echo "SKIP client_pytest (no pytest for ${python})"
fi

# (b) The layer against the float64 reference, then the benchmark (which
# checks again and times only paths that pass).
e2e=("${python}" "${repo}/bench/e2e_torch.py" --unix="${sock}"
  --tcp="${tcp}" --metrics="${metrics}" "--n=4,8" "--transports=ipc,inline")
step e2e_check "${e2e[@]}" --check
rm -f "${logs}/e2e_torch.jsonl"
# shellcheck disable=SC2086  # E2E_ARGS is a list of flags
step e2e_bench "${e2e[@]}" --configs=all --out="${logs}/e2e_torch.jsonl" \
  --table="${logs}/e2e_torch.md" ${E2E_ARGS:-}
[[ -f "${logs}/e2e_torch.md" ]] && cat "${logs}/e2e_torch.md"

# (c) Stop the daemon; a drain that fails is a failure too.
if [[ -n "${metrics}" ]]; then
  "${python}" -c "import sys,urllib.request;sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())" \
    "${metrics}" >"${logs}/metrics.txt" 2>&1
fi
kill -TERM "${daemon}"
wait "${daemon}"
code=$?
echo "mhcd exit code ${code} ($(tail -n 1 "${logs}/mhcd.log"))"
[[ ${code} -eq 0 ]] || failures=$((failures + 1))
[[ -n "${mps}" ]] && echo quit | "${mps}"
rm -rf "${work}"
echo "gpu_e2e: ${failures} failed"
exit "${failures}"
