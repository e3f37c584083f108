#!/usr/bin/env bash
# Installs everything mhcd's build and tests need on Debian 12: Debian
# packages, Node.js (when no node/npm is on PATH) and the pinned npm tools of
# the deploy checks (deploy/tools/install.sh). Idempotent: when everything is
# already installed it changes nothing (and needs no network or root).
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git ca-certificates
  libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc
  libprotobuf-dev libabsl-dev prometheus-cpp-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  clang-format python3 python3-dev python3-numpy python3-grpcio python3-protobuf
  python3-pytest python3-torch curl openssl
  python3-venv python3-pip python3-setuptools python3-wheel patchelf
  prometheus python3-yaml python3-matplotlib
  # The fuzz harnesses (fuzz/run.sh): clang 14 and its sanitizer and
  # libFuzzer runtimes (only recommended by clang, so named here).
  clang libclang-rt-14-dev
)

missing=()
for package in "${PACKAGES[@]}"; do
  status="$(dpkg-query -W -f='${Status}' "${package}" 2>/dev/null || true)"
  if [[ "${status}" != "install ok installed" ]]; then
    missing+=("${package}")
  fi
done

# Node.js for deploy/tools: any node >= 18 with npm on PATH will do (Debian
# 12's nodejs and npm packages are 18.x).
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  missing+=(nodejs npm)
fi

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install_deps: all ${#PACKAGES[@]} packages present"
else
  echo "install_deps: installing ${missing[*]}"
  SUDO=()
  if [[ "$(id -u)" -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then
      SUDO=(sudo)
    else
      echo "install_deps: need root (or sudo) to install: ${missing[*]}" >&2
      exit 1
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${SUDO[@]}" apt-get update
  "${SUDO[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
fi

bash deploy/tools/install.sh
