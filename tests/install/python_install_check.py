"""Imports the installed mhc_client (not the source tree's) and drives a CPU
mhcd with it: server info, a layer, one forward op.

    python_install_check.py MHCD_BINARY VENV_DIR
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    mhcd, venv = sys.argv[1], Path(sys.argv[2]).resolve()
    import numpy as np

    import mhc_client
    from mhc_client import native

    location = Path(mhc_client.__file__).resolve()
    if venv not in location.parents:
        sys.exit(f"imported {location}, not the package installed in {venv}")
    if native.load() is not None:
        sys.exit("the wheel should not carry the native extension")
    if not (location.parent / "py.typed").exists():
        sys.exit("py.typed is not installed")

    with tempfile.TemporaryDirectory() as tmp:
        address = f"unix:{tmp}/mhcd.sock"
        daemon = subprocess.Popen(
            [mhcd, f"--listen={address}", "--metrics_listen=",
             "--backend=cpu", "--threads=2"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert daemon.stdout is not None
            for line in daemon.stdout:
                if line.startswith("mhcd: ready"):
                    break
            else:
                sys.exit("mhcd exited before it was ready")
            with mhc_client.Client(address, timeout=30) as client:
                info = client.server_info()
                client.create_layer("install", hidden=64, n=4, seed=1)
                x = np.random.default_rng(0).standard_normal(
                    (8, 4, 64)).astype(np.float32)
                y, _, _, _ = client.pre("install", x)
                if y.shape != (8, 64) or not np.isfinite(y).all():
                    sys.exit(f"unexpected pre output {y.shape}")
        finally:
            daemon.terminate()
            daemon.wait(30)
    print(f"python_install: mhc_client {mhc_client.__version__} from "
          f"{location.parent} talked to mhcd {info.version} ({info.backend})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
