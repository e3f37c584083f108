#!/usr/bin/env bash
# The Python client installs like a library: pip builds a wheel from a copy
# of client/python (no build directory, no protoc, no package index), the
# wheel carries the generated modules and py.typed but no native extension,
# `pip install DIR` works too, and the installed package, imported from
# outside the source tree, drives a CPU mhcd.
#
#   tests/install/python_install.sh PYTHON MHCD_BINARY
set -euo pipefail

python="${1:?usage: python_install.sh PYTHON MHCD_BINARY}"
mhcd="${2:?usage: python_install.sh PYTHON MHCD_BINARY}"
here="$(cd "$(dirname "$0")" && pwd)"
source_dir="$(cd "${here}/../../client/python" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/mhc-py-install.XXXXXX")"
trap 'rm -rf "${work}"' EXIT

# A clean copy: what a fresh checkout has (no egg-info, build/ or caches).
mkdir "${work}/src"
tar -C "${source_dir}" --exclude=build --exclude='*.egg-info' \
  --exclude=__pycache__ --exclude='_native*.so' -cf - . |
  tar -C "${work}/src" -xf -

"${python}" -m venv --system-site-packages "${work}/venv"
venv_python="${work}/venv/bin/python"
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
unset PYTHONPATH

"${venv_python}" -m pip wheel --quiet --no-build-isolation --no-deps \
  -w "${work}/wheels" "${work}/src"
wheel="$(ls "${work}"/wheels/mhc_client-*.whl)"
"${venv_python}" - "${wheel}" <<'PY'
import sys
import zipfile

names = set(zipfile.ZipFile(sys.argv[1]).namelist())
needed = {"mhc_client/__init__.py", "mhc_client/py.typed",
          "mhc_client/_daemon_tables.py",
          "mhc_client/_pb/__init__.py", "mhc_client/_pb/service_pb2.py",
          "mhc_client/_pb/service_pb2_grpc.py", "mhc_client/_pb/health_pb2.py"}
missing = sorted(needed - names)
native = sorted(name for name in names if "_native" in name and
                name.endswith(".so"))
if missing or native:
    sys.exit(f"wheel: missing {missing}, unexpected {native}")
print(f"python_install: wheel has {len(names)} files")
PY

# `pip install DIR` (the documented command), then the wheel over it.
"${venv_python}" -m pip install --quiet --no-build-isolation --no-deps \
  "${work}/src"
"${venv_python}" -m pip install --quiet --no-deps --force-reinstall "${wheel}"

cd "${work}"
rm -rf "${work}/src"
"${venv_python}" "${here}/python_install_check.py" "${mhcd}" \
  "${work}/venv"
