#!/usr/bin/env bash
# The clients link no CUDA and no kernels they do not use. Reads each
# client's link line from the build system (Ninja or Makefiles), and the
# built files themselves: ldd of mhcctl, and the symbols mhcctl and the
# client libraries define.
#
#   - mhcctl: the core and the float64 reference (mhcctl run checks results
#     with it); never mhc_cuda, mhc_cuda_tools, the CUDA runtime, the fast
#     CPU backend or the server.
#   - the Python extension (when built): the RPC layer only, no kernel
#     library at all.
#
#   tests/link/client_links.sh BUILD_DIR GENERATOR MAKE_PROGRAM MHCCTL
#                              LIBMHC_CLIENT LIBMHC_CLIENT_RPC [PY_NATIVE]
set -euo pipefail

usage="usage: client_links.sh BUILD_DIR GENERATOR MAKE_PROGRAM MHCCTL LIBMHC_CLIENT LIBMHC_CLIENT_RPC [PY_NATIVE]"
build="${1:?${usage}}"
generator="${2:?${usage}}"
make_program="${3:?${usage}}"
mhcctl="${4:?${usage}}"
libclient="${5:?${usage}}"
libclient_rpc="${6:?${usage}}"
py_native="${7:-}"

failures=0
fail() {
  echo "client_links: $*" >&2
  failures=$((failures + 1))
}

# The command that links `file` (a path under BUILD_DIR), one line.
link_line() {
  local file="$1" target="$2" relative
  relative="$(realpath --relative-to="${build}" "${file}")"
  case "${generator}" in
    Ninja*)
      "${make_program}" -C "${build}" -t commands "${relative}" |
        grep -F -- "-o ${relative} " | tail -n 1
      ;;
    *Makefiles*)
      cat "${build}/$(dirname "${relative}")/CMakeFiles/${target}.dir/link.txt"
      ;;
    *)
      echo "client_links: cannot read link lines of generator ${generator}" >&2
      exit 1
      ;;
  esac
}

# Fails when `line` (the link line of `what`) names any of the patterns.
refuse_in_line() {
  local what="$1" line="$2"
  shift 2
  if [[ -z "${line}" ]]; then
    fail "no link line found for ${what}"
    return
  fi
  local pattern
  for pattern in "$@"; do
    if grep -Eq -- "${pattern}" <<<"${line}"; then
      fail "${what} links ${pattern}: ${line}"
    fi
  done
}

# Libraries no client links.
cuda_and_server=('libmhc_cuda' 'cudart' 'libcuda\.' 'libmhc_cpu\.a'
                 'libmhc_server\.a')
refuse_in_line mhcctl "$(link_line "${mhcctl}" mhcctl)" "${cuda_and_server[@]}"
if [[ -n "${py_native}" ]]; then
  refuse_in_line "the Python extension" \
    "$(link_line "${py_native}" mhc_python_native)" "${cuda_and_server[@]}" \
    'libmhc_core\.a' 'libmhc_reference\.a' 'libmhc_client\.a'
fi

# What the files hold, whatever the build system said.
if ldd "${mhcctl}" | grep -Eq 'libcudart|libcuda\.so'; then
  fail "mhcctl loads the CUDA runtime or driver: $(ldd "${mhcctl}")"
fi
for file in "${mhcctl}" "${libclient}" "${libclient_rpc}"; do
  symbols="$(nm -C --defined-only "${file}" 2>/dev/null |
    grep -E ' (mhc::cuda::|mhc::(MakeCudaBackend|MakeCpuBackend|MakeCudaDeviceIpc)\(|cuda[A-Z][A-Za-z]*$|__cudaRegisterFatBinary)' |
    head -n 5 || true)"
  if [[ -n "${symbols}" ]]; then
    fail "$(basename "${file}") defines CUDA or fast CPU backend symbols:"$'\n'"${symbols}"
  fi
done

if [[ ${failures} -gt 0 ]]; then
  exit 1
fi
echo "client_links: mhcctl, mhc_client and mhc_client_rpc carry no CUDA"
