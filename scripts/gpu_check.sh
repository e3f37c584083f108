#!/usr/bin/env bash
# Runs the GPU checks from a bundle made by scripts/bundle.sh on a machine with
# an NVIDIA GPU: the CUDA kernel tests, compute-sanitizer memcheck and
# racecheck on a subset, the CUDA IPC test across two processes, page-locked
# host shared memory (in process, and through mhcd --backend=cuda against
# inline and single ops), injected device faults (mhcd --fault_injection),
# the daemon on the GPU driven by mhcctl (inline and shared memory) and by
# the stream-ordered C++ example, and the inline/shared-memory RPC benchmark
# on the GPU with and without page locks.
# Logs go to LOG_DIR (default: the current directory); the exit code counts
# failures. PARTS (default all) picks, comma-separated, which parts run, so
# that the whole check can be split over runs with a time limit: tests (the
# kernel tests, CUDA IPC, page-locked shm, fault injection), memcheck and
# racecheck (compute-sanitizer), daemon (mhcctl, the stream-ordered client,
# the RPC benchmark).
#
#   scripts/gpu_check.sh BUNDLE_DIR [LOG_DIR] [PARTS]
set -uo pipefail

usage="usage: scripts/gpu_check.sh BUNDLE_DIR [LOG_DIR] [tests,memcheck,racecheck,daemon|all]"
bundle="$(cd "${1:?${usage}}" && pwd)"
logs="${2:-.}"
parts="${3:-all}"
for part in ${parts//,/ }; do
  case "${part}" in
    all | tests | memcheck | racecheck | daemon) ;;
    *) echo "gpu_check: unknown part '${part}'; ${usage}" >&2; exit 2 ;;
  esac
done
runs() { [[ ",${parts}," == *",all,"* || ",${parts}," == *",$1,"* ]]; }
mkdir -p "${logs}"
export LD_LIBRARY_PATH="${bundle}/lib${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
bin="${bundle}/bin"
failures=0

# shellcheck source=scripts/step.sh
source "$(dirname "${BASH_SOURCE[0]}")/step.sh"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if runs tests; then
  step cuda_ops_test "${bin}/cuda_ops_test" --gtest_brief=1
  step cuda_fused_test "${bin}/cuda_fused_test" --gtest_brief=1
  step cuda_projection_test "${bin}/cuda_projection_test" --gtest_brief=1
  step cuda_dispatch_test "${bin}/cuda_dispatch_test" --gtest_brief=1
  step cuda_overflow_test "${bin}/cuda_overflow_test" --gtest_brief=1
  step cuda_optimizer_test "${bin}/cuda_optimizer_test" --gtest_brief=1
  step cuda_hot_path_test "${bin}/cuda_hot_path_test" --gtest_brief=1
  step cuda_ipc "${bin}/server_shm_registry_test" \
    --gtest_filter='ShmRegistryTest.CudaIpc*'
  step cuda_pinned_shm "${bin}/server_shm_registry_test" \
    --gtest_filter='ShmRegistryTest.CudaPinner*'
  # The daemon under test is the bundle's, not the build machine's path.
  step cuda_daemon_shm env MHCD_PATH="${bin}/mhcd" \
    "${bin}/server_cuda_shm_test" --gtest_brief=1
  # A full device answered, a lost one ending the daemon (--fault_injection).
  step cuda_fault_injection env MHCD_PATH="${bin}/mhcd" \
    "${bin}/server_fault_injection_test" --gtest_brief=1
fi

if runs memcheck; then
  step memcheck compute-sanitizer --tool memcheck --leak-check full \
    --error-exitcode 1 "${bin}/cuda_fused_test" \
    --gtest_filter='*PreAndHead/deepseek_v4_bf16:*PreAndHead/megatron_f32:*Determinism*/1'
  # The whole overflow suite is too slow under memcheck: the n = 4 fused cases
  # of one preset at the widths that take different variants, and the single
  # ops' cases.
  step memcheck_overflow compute-sanitizer --tool memcheck --error-exitcode 1 \
    "${bin}/cuda_overflow_test" \
    --gtest_filter='StreamCount4/*/deepseek_v4_n4_*_C37:StreamCount4/*/deepseek_v4_n4_*_C1024:CudaOverflowTest.*'
  step memcheck_rows compute-sanitizer --tool memcheck --error-exitcode 1 \
    "${bin}/cuda_ops_test" \
    --gtest_filter='CudaRowAccessTest.*:*ElementwiseOps/deepseek_v4_bf16'
  step memcheck_projection compute-sanitizer --tool memcheck --error-exitcode 1 \
    "${bin}/cuda_projection_test"
fi

if runs racecheck; then
  step racecheck compute-sanitizer --tool racecheck --error-exitcode 1 \
    "${bin}/cuda_ops_test" --gtest_filter='*/deepseek_v4_bf16'
  # The projection tests but the forward and wide backward sweeps, whose
  # many shapes take minutes each under racecheck (memcheck runs them all);
  # the kernels they reach are raced at other shapes here.
  step racecheck_projection compute-sanitizer --tool racecheck \
    --error-exitcode 1 "${bin}/cuda_projection_test" \
    --gtest_filter='-*.MatchesReferenceAndIsBatchInvariant:*.WideBackwardMatchesReferenceAndIsDeterministic'
fi

if runs daemon; then
  # The daemon on the GPU, driven like a user would.
  work="$(mktemp -d)"
  "${bin}/mhcd" --backend=cuda --listen="unix:${work}/mhcd.sock" \
    --metrics_listen=127.0.0.1:0 --allow_shm >"${logs}/mhcd.log" 2>&1 &
  daemon=$!
  for _ in $(seq 1 100); do
    grep -q '^mhcd: ready' "${logs}/mhcd.log" && break
    sleep 0.2
  done
  ctl=("${bin}/mhcctl" --address="unix:${work}/mhcd.sock")
  step mhcctl_info "${ctl[@]}" info
  step run_bf16 "${ctl[@]}" run --tokens=4096 --hidden=4096
  step run_fp32_te "${ctl[@]}" run --tokens=1000 --hidden=1536 --dtype=fp32 \
    --preset=transformer_engine
  step run_megatron_odd "${ctl[@]}" run --tokens=137 --hidden=5129 \
    --preset=megatron --dtype=fp16
  step run_shm "${ctl[@]}" run --tokens=2048 --hidden=4096 --shm
  # Stream-ordered calls with the layer's memory mapped in place (C++ client).
  step stream_ordered_step "${bin}/stream_ordered_step" \
    --address="unix:${work}/mhcd.sock" --tokens=4096 --hidden=4096 --steps=10
  metrics="$(sed -n 's|^mhcd: metrics on \(http://[^ ]*\)|\1|p' "${logs}/mhcd.log")"
  if [[ -n "${metrics}" ]] && command -v curl >/dev/null; then
    curl -s "${metrics}" >"${logs}/metrics.txt"
  elif [[ -n "${metrics}" ]]; then
    python3 -c "import sys,urllib.request;sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())" \
      "${metrics}" >"${logs}/metrics.txt"
fi
kill -TERM "${daemon}"
wait "${daemon}"
echo "mhcd exit code $? ($(tail -n 1 "${logs}/mhcd.log"))"
rm -rf "${work}"

# Inline vs shared memory through a daemon on the GPU: page-locked regions
# (the default), pageable ones, and batches of 4 ops whose copies overlap
# compute. Tables in the logs.
bench=("${bin}/mhc_rpc_bench" --backend=cuda --max_mib=256)
step rpc_bench_pinned "${bench[@]}"
step rpc_bench_pageable "${bench[@]}" --shm_pin_host=false
step rpc_bench_pinned_batch4 "${bench[@]}" --batch=4
step rpc_bench_pageable_batch4 "${bench[@]}" --batch=4 --shm_pin_host=false
fi
echo "gpu_check: ${failures} failed"
exit "${failures}"
