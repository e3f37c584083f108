#!/usr/bin/env bash
# The release tarball: its checksum verifies, and, unpacked elsewhere, the
# binaries run without LD_LIBRARY_PATH, loading the packed libraries through
# their $ORIGIN run paths.
#
#   tests/install/release_check.sh BUILD_DIR PYTHON
set -euo pipefail

build="${1:?usage: release_check.sh BUILD_DIR PYTHON}"
export PYTHON="${2:?usage: release_check.sh BUILD_DIR PYTHON}"
repo="$(cd "$(dirname "$0")/../.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/mhc-release-check.XXXXXX")"
trap 'rm -rf "${work}"' EXIT
fail() {
  echo "release_check: $*" >&2
  exit 1
}

bash "${repo}/scripts/release.sh" "${build}" "${work}/dist" >"${work}/release.log" 2>&1 ||
  { cat "${work}/release.log" >&2; fail "release.sh failed"; }
tarball="$(ls "${work}"/dist/mhcd-*.tar.gz)"
(cd "${work}/dist" && sha256sum --quiet -c "$(basename "${tarball}").sha256") ||
  fail "checksum does not verify"

mkdir "${work}/unpacked"
tar -C "${work}/unpacked" -xzf "${tarball}"
root="$(ls -d "${work}"/unpacked/mhcd-*)"
for file in bin/mhcd bin/mhcctl MANIFEST doc/operations.md; do
  [[ -e "${root}/${file}" ]] || fail "${file} missing"
done
ls "${root}"/python/mhc_client-*.whl >/dev/null || fail "no Python wheel"
grep -q '^requires glibc: >= 2\.' "${root}/MANIFEST" ||
  fail "MANIFEST names no glibc: $(cat "${root}/MANIFEST")"
# The whole dynamic section first: grep -q would stop reading early and,
# under pipefail, fail the pipeline through readelf's SIGPIPE.
dynamic="$(readelf -d "${root}/bin/mhcd")"
# shellcheck disable=SC2016  # a literal $ORIGIN
grep -q 'R.*PATH.*\[\$ORIGIN/\.\./lib\]' <<<"${dynamic}" ||
  fail "mhcd has no \$ORIGIN/../lib run path"

unset LD_LIBRARY_PATH
# Every library that is not the C runtime resolves inside the bundle.
outside="$(ldd "${root}/bin/mhcd" | awk '$2 == "=>" {print $3}' |
  grep -v "^${root}/bin/../lib/" |
  grep -Ev '/(ld-linux[^/]*|lib(c|m|dl|rt|pthread|stdc\+\+|gcc_s))\.so' || true)"
[[ -z "${outside}" ]] || fail "mhcd loads libraries outside the bundle: ${outside}"
"${root}/bin/mhcd" --version | grep -q '^mhcd ' || fail "mhcd --version"
"${root}/bin/mhcctl" --help >/dev/null || fail "mhcctl --help"
echo "release_check: $(basename "${tarball}") verifies and runs from ${root}"
