#!/usr/bin/env bash
# Makes the release tarball of a build: mhcd and mhcctl with the shared
# libraries they load ($ORIGIN run paths, see bundle.sh), the Python client
# as a wheel, the docs (docs/ as doc/), and a MANIFEST naming the
# version, commit and the oldest glibc and libstdc++ the binaries need; then
# a sha256 checksum file next to the tarball.
#
#   scripts/release.sh BUILD_DIR [OUT_DIR]     (OUT_DIR default: dist)
#
# Output: OUT_DIR/mhcd-VERSION-linux-ARCH.tar.gz and .tar.gz.sha256; check
# it with `sha256sum -c mhcd-VERSION-linux-ARCH.tar.gz.sha256`.
set -euo pipefail

usage="usage: scripts/release.sh BUILD_DIR [OUT_DIR]"
build="$(cd "${1:?${usage}}" && pwd)"
out="${2:-dist}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"

version="$(sed -n 's/^CMAKE_PROJECT_VERSION:STATIC=//p' "${build}/CMakeCache.txt")"
if [[ -z "${version}" ]]; then
  echo "release: no project version in ${build}/CMakeCache.txt" >&2
  exit 1
fi
name="mhcd-${version}-linux-$(uname -m)"
mkdir -p "${out}"
out="$(cd "${out}" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/mhc-release.XXXXXX")"
trap 'rm -rf "${work}"' EXIT
stage="${work}/${name}"

bash "${repo}/scripts/bundle.sh" "${build}" "${stage}" \
  server/mhcd client/cpp/mhcctl

# The Python client: a pure wheel (its generated modules are committed).
cp -r "${repo}/client/python" "${work}/python-src"
rm -rf "${work}/python-src/build" "${work}"/python-src/*.egg-info
mkdir -p "${stage}/python"
"${python}" -m pip wheel --quiet --no-deps --no-build-isolation \
  --no-index -w "${stage}/python" "${work}/python-src"

mkdir -p "${stage}/doc"
cp "${repo}/README.md" "${repo}/CHANGELOG.md" "${repo}/LICENSE" "${stage}/"
cp "${repo}"/docs/*.md "${stage}/doc/"
cp -r "${repo}/docs/img" "${stage}/doc/"

# The newest symbol versions the packed files use: the target needs at
# least this glibc and libstdc++ (both come from the target system).
newest() {
  objdump -T "${stage}"/bin/* "${stage}"/lib/* 2>/dev/null |
    grep -o "${1}_[0-9][0-9.]*" | sed "s/^${1}_//" | sort -V | tail -n 1
}
commit="$(git -C "${repo}" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
cat >"${stage}/MANIFEST" <<MANIFEST
name: ${name}
version: ${version}
commit: ${commit}
requires glibc: >= $(newest GLIBC)
requires libstdc++: GLIBCXX >= $(newest GLIBCXX)
MANIFEST

# Reproducible for one build: fixed order, owners and times.
mtime="$(git -C "${repo}" log -1 --format=%ct 2>/dev/null || date +%s)"
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@${mtime}" \
  -C "${work}" -cf - "${name}" | gzip -n >"${out}/${name}.tar.gz"
(cd "${out}" && sha256sum "${name}.tar.gz" >"${name}.tar.gz.sha256")
cat "${stage}/MANIFEST"
echo "release: ${out}/${name}.tar.gz ($(du -h "${out}/${name}.tar.gz" | cut -f1))"
