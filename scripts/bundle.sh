#!/usr/bin/env bash
# Packs built binaries, with the non-system shared libraries they load, into
# one relocatable folder: for running the daemon, mhcctl, the GPU tests and
# benchmarks on a GPU machine that has the NVIDIA driver but none of the
# build's libraries (gRPC, Abseil, protobuf, prometheus-cpp, GoogleTest).
# Binaries and libraries find OUT/lib through $ORIGIN-relative run paths, so
# they run from wherever the folder is, without LD_LIBRARY_PATH; Python
# clients add OUT/python (the native extension) to PYTHONPATH beside
# client/python. scripts/release.sh makes a tarball of one.
#
#   scripts/bundle.sh BUILD_DIR OUT_DIR [BINARY...]
#
# BINARY: paths under BUILD_DIR to pack (default: the daemon, mhcctl, the
# GPU tests and benchmarks that were built).
set -euo pipefail

usage="usage: scripts/bundle.sh BUILD_DIR OUT_DIR [BINARY...]"
build="${1:?${usage}}"
out="${2:?${usage}}"
shift 2
command -v patchelf >/dev/null ||
  { echo "bundle: needs patchelf (scripts/install_deps.sh)" >&2; exit 1; }
rm -rf "${out}"
mkdir -p "${out}/bin" "${out}/lib"

binaries=(
  server/mhcd
  client/cpp/mhcctl
  tests/cuda/cuda_ops_test
  tests/cuda/cuda_fused_test
  tests/cuda/cuda_projection_test
  tests/cuda/cuda_dispatch_test
  tests/cuda/cuda_overflow_test
  tests/cuda/cuda_optimizer_test
  tests/cuda/cuda_hot_path_test
  tests/server/server_shm_registry_test
  tests/server/server_cuda_shm_test
  tests/server/server_fault_injection_test
  bench/mhc_rpc_bench
  bench/mhc_gpu_bench
  bench/mhc_l2_reuse_bench
  bench/mhc_load_stream_bench
  client/cpp/stream_ordered_step
)
explicit=0
if [[ $# -gt 0 ]]; then
  binaries=("$@")
  explicit=1
fi
for binary in "${binaries[@]}"; do
  if [[ -x "${build}/${binary}" ]]; then
    cp "${build}/${binary}" "${out}/bin/"
  elif [[ ${explicit} -eq 1 ]]; then
    echo "bundle: ${build}/${binary} is not built" >&2
    exit 1
  fi
done

# Every library ldd resolves, except the C runtime and the driver, which the
# target machine provides (its own, newer, versions).
system='/(ld-linux[^/]*|lib(c|m|dl|rt|pthread|stdc\+\+|gcc_s|cuda))\.so'
for binary in "${out}"/bin/*; do
  ldd "${binary}" | awk '$2 == "=>" && $3 ~ /^\// {print $3}'
done | sort -u | grep -Ev "${system}" | while read -r library; do
  cp -L "${library}" "${out}/lib/"
done
# The Python client's native extension (stable ABI: any Python >= 3.10
# loads it) finds the libraries in OUT/lib through its rpath.
for module in "${build}"/client/python/mhc_client/_native*.so; do
  [[ -f "${module}" ]] || continue
  mkdir -p "${out}/python/mhc_client"
  cp "${module}" "${out}/python/mhc_client/"
  ldd "${module}" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
    grep -Ev "${system}" | while read -r library; do
    cp -L "${library}" "${out}/lib/"
  done
done
# Symbols only make the folder larger; backtraces keep function names.
strip --strip-unneeded "${out}"/bin/* "${out}"/lib/* 2>/dev/null || true
# Run paths after strip (strip can mangle what patchelf rewrote). A run path
# applies to the object's own dependencies only, so each library gets one
# too, for the libraries it loads in turn. $ORIGIN is for the loader, not
# the shell (hence single quotes; shellcheck SC2016 does not apply).
for binary in "${out}"/bin/*; do
  # shellcheck disable=SC2016
  patchelf --set-rpath '$ORIGIN/../lib' "${binary}"
done
for library in "${out}"/lib/*; do
  # shellcheck disable=SC2016
  patchelf --set-rpath '$ORIGIN' "${library}"
done
for module in "${out}"/python/mhc_client/_native*.so; do
  [[ -f "${module}" ]] || continue
  # shellcheck disable=SC2016
  patchelf --set-rpath '$ORIGIN/../../lib' "${module}"
done
echo "bundle: $(ls "${out}/bin" | wc -l) binaries, $(ls "${out}/lib" | wc -l) libraries, $(du -sh "${out}" | cut -f1)"
