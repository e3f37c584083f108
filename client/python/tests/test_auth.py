"""Bearer tokens and TLS from the Python client against a daemon that
requires them (the daemon's docs/security.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from typing import Iterator

import numpy as np
import pytest

import mhc_client
from mhc_client import Client, errors, native
from mhc_client._proto import shm_pb2
from mhc_client.client import SESSION_METADATA_KEY
from mhc_client.ops import op_def
from mhc_client.tensors import F32

from conftest import Daemon, _binary  # noqa: E402

READ = "read-token-0123456789abcdef"
COMPUTE = "compute-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"


def _not_me() -> int:
    """A uid other than this process's, so that only tokens give roles."""
    return 65534 if os.getuid() != 65534 else 65533


@pytest.fixture(scope="module")
def tokens_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="mhcd-tokens-")
    tokens = os.path.join(path, "tokens")
    with open(tokens, "w", encoding="utf-8") as f:
        f.write(f"{READ} read reader\n{COMPUTE} compute trainer\n"
                f"{ADMIN} admin operator\n")
    os.chmod(tokens, 0o600)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def guarded(tokens_dir: str) -> Iterator[Daemon]:
    d = Daemon(_binary(), [f"--auth_tokens={tokens_dir}/tokens",
                           f"--unix_peer_roles={_not_me()}:read",
                           "--allow_shm"])
    yield d
    d.stop()


def test_no_token_is_unauthenticated(guarded):
    with Client(guarded.address, retries=1) as anonymous:
        with pytest.raises(errors.Unauthenticated):
            anonymous.server_info()
        # Probes stay open.
        assert anonymous.health() == "SERVING"


def test_roles_decide_what_a_token_may_do(guarded):
    name = f"auth-{os.getpid()}"
    with Client(guarded.address, token=READ) as reader, \
            Client(guarded.address, token=ADMIN) as operator:
        assert reader.server_info().version
        with pytest.raises(mhc_client.PermissionDenied,
                           match="CreateLayer needs the admin role; "
                                 "token 'reader' has read"):
            reader.create_layer(name, 64, n=4)
        operator.create_layer(name, 64, n=4)
        assert reader.get_layer(name).name == name
        operator.delete_layer(name)


def test_token_file_from_the_environment(guarded, tokens_dir, monkeypatch):
    path = os.path.join(tokens_dir, "mine")
    with open(path, "w", encoding="utf-8") as f:
        f.write(READ + "\n")
    monkeypatch.setenv("MHC_TOKEN_FILE", path)
    with Client(guarded.address) as reader:
        assert reader.server_info().version


def test_sessions_and_native_calls_carry_the_token(guarded):
    """Shared memory needs the compute role; the session stream and the
    native call path (when built) must both send the token."""
    name = f"auth-native-{os.getpid()}"
    n, hidden, m = 4, 64, 3
    with Client(guarded.address, token=ADMIN) as operator:
        operator.create_layer(name, hidden, n=n, seed=1)
    try:
        with Client(guarded.address, token=COMPUTE) as trainer:
            region = trainer.open_session().create_region("io", 1 << 16)
            data = np.random.default_rng(3)

            def put(shape):
                return region.put(data.standard_normal(shape).astype(np.float32))

            def place(field, array):
                return (field, F32, array.shape, region.name,
                        int(array.ctypes.data) - region.address, array.nbytes)

            x, dy = put((m, n, hidden)), put((m, hidden))
            dh_post, dh_res = put((m, n)), put((m, n, n))
            dx = region.alloc(np.float32, (m, n, hidden))
            used_native = trainer.compute_in_place(
                op_def("pre_backward"), name,
                [place("x", x), place("dy", dy), place("dh_post", dh_post),
                 place("dh_res", dh_res)],
                [("dx", region.name, int(dx.ctypes.data) - region.address,
                  dx.nbytes)],
                {"skip_parameter_gradients": True}, retry=False)
            assert used_native == (trainer.native is not None)
            if native.mode() != "off" and native.unavailable_reason() is None:
                assert used_native  # the token reached the native path too
            assert np.isfinite(dx).all() and np.abs(dx).sum() > 0
    finally:
        with Client(guarded.address, token=ADMIN) as operator:
            operator.delete_layer(name)


def test_a_session_answers_only_to_the_token_that_opened_it(guarded):
    """Another caller presenting a session's id is refused, whatever its
    role; the same token on another connection is the same caller."""
    with Client(guarded.address, token=COMPUTE) as trainer, \
            Client(guarded.address, token=COMPUTE) as same, \
            Client(guarded.address, token=ADMIN) as operator:
        session_id = trainer.open_session().id
        borrowed = [(SESSION_METADATA_KEY, session_id)]
        same._call("SharedMemoryStatus", shm_pb2.SharedMemoryStatusRequest(),
                   metadata=borrowed)
        with pytest.raises(mhc_client.PermissionDenied,
                           match="belongs to another caller"):
            operator._call("SharedMemoryStatus",
                           shm_pb2.SharedMemoryStatusRequest(),
                           metadata=borrowed)


def _openssl(*args: str, cwd: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def certificates() -> Iterator[str]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    path = tempfile.mkdtemp(prefix="mhcd-tls-")
    key = ["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
           "-nodes"]
    _openssl(*key, "-x509", "-days", "2", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=path)
    for name, ext in (("server", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
                      ("client", "extendedKeyUsage=clientAuth")):
        with open(os.path.join(path, f"{name}.ext"), "w") as f:
            f.write(ext + "\n")
        _openssl(*key, "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=path)
        _openssl("x509", "-req", "-days", "2", "-in", f"{name}.csr",
                 "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _tcp_address(daemon: Daemon) -> str:
    for line in daemon.log:
        if line.startswith("mhcd: listening on 127.0.0.1:"):
            return line.split()[-1]
    raise AssertionError("no TCP listener in:\n" + "".join(daemon.log))


def test_mutual_tls_with_a_token(certificates, tokens_dir):
    c = certificates
    d = Daemon(_binary(), ["--listen=127.0.0.1:0",
                           f"--tls_cert={c}/server.pem",
                           f"--tls_key={c}/server.key",
                           f"--tls_client_ca={c}/ca.pem",
                           f"--auth_tokens={tokens_dir}/tokens"])
    try:
        address = _tcp_address(d)
        ca = _read(f"{c}/ca.pem")
        with Client(address, root_certificates=ca,
                    private_key=_read(f"{c}/client.key"),
                    certificate_chain=_read(f"{c}/client.pem"),
                    token=READ) as reader:
            assert reader.server_info().version
        with Client(address, root_certificates=ca,
                    private_key=_read(f"{c}/client.key"),
                    certificate_chain=_read(f"{c}/client.pem"),
                    tls_server_name="localhost", retries=1) as anonymous:
            with pytest.raises(errors.Unauthenticated):
                anonymous.server_info()
        with Client(address, root_certificates=ca, token=READ, retries=1,
                    timeout=5) as no_certificate:
            with pytest.raises(mhc_client.MhcError):
                no_certificate.server_info()
    finally:
        d.stop()


def test_tls_settings_are_checked():
    with pytest.raises(mhc_client.InvalidArgument):
        Client("unix:/tmp/x.sock", tls=True)
    with pytest.raises(mhc_client.InvalidArgument):
        Client("127.0.0.1:1", private_key=b"key")
    with pytest.raises(mhc_client.InvalidArgument):
        Client("127.0.0.1:1", token="has space")
