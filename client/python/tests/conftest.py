"""Fixtures: one mhcd per test session, on a private unix socket (backend
from MHCD_BACKEND, default cpu).

The daemon binary comes from MHCD_BINARY (set by ctest); the generated
modules must be importable (PYTHONPATH, see docs/user-guide.md).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import zlib
from pathlib import Path
from typing import Iterator, List

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mhc_client  # noqa: E402

_names = itertools.count()


class Daemon:
    """A running mhcd and the address it listens on."""

    def __init__(self, binary: str, extra: List[str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="mhcd-py-")
        self.address = f"unix:{self.dir}/mhcd.sock"
        self.proc = subprocess.Popen(
            [binary, f"--listen={self.address}", "--metrics_listen=",
             f"--backend={os.environ.get('MHCD_BACKEND', 'cpu')}", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: List[str] = []
        ready = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log.append(line)
                if line.startswith("mhcd: ready"):
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(60) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("mhcd did not start:\n" + "".join(self.log))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _binary() -> str:
    binary = os.environ.get("MHCD_BINARY", "")
    if not binary or not os.access(binary, os.X_OK):
        raise pytest.UsageError(
            "set MHCD_BINARY to the mhcd executable (ctest does this)")
    return binary


@pytest.fixture(scope="session")
def daemon() -> Iterator[Daemon]:
    d = Daemon(_binary(), ["--allow_shm"])
    yield d
    d.stop()


@pytest.fixture(scope="session")
def client(daemon: Daemon) -> Iterator[mhc_client.Client]:
    with mhc_client.Client(daemon.address, timeout=60) as c:
        c.wait_for_ready(30)
        yield c


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """Fresh random data per test (seeded by the test's name: reproducible)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def layer_name(client: mhc_client.Client) -> Iterator[str]:
    """A unique layer name, deleted after the test if it was created."""
    name = f"py-{os.getpid()}-{next(_names)}"
    yield name
    try:
        client.delete_layer(name)
    except mhc_client.NotFound:
        pass
