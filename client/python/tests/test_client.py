"""Server info, layer management, parameters and typed errors."""

from __future__ import annotations

import os
import time
from concurrent import futures

import grpc
import numpy as np
import pytest

import mhc_client
from mhc_client import Batch, Client, LayerSpec, errors
from mhc_client._proto import service_pb2, service_pb2_grpc


def test_health_and_server_info(client):
    assert client.health() == "SERVING"
    info = client.server_info()
    backend = os.environ.get("MHCD_BACKEND", "cpu")  # the test daemon's (conftest)
    assert info.backend == backend
    assert info.has_cuda == (backend == "cuda")
    if backend == "cpu":
        assert info.devices[0].name == "cpu"
    assert set(mhc_client.PRESETS) <= set(info.presets)
    assert {"f32", "f16", "bf16"} <= set(info.dtypes)
    assert info.limits["max_streams"] >= 4 and not info.draining


def test_layer_lifecycle(client, layer_name):
    info = client.create_layer(layer_name, 32, n=2, preset="tilekernels", seed=9,
                               sinkhorn_iterations=7, has_gamma=True)
    assert info.preset == "tilekernels" and info.spec.sinkhorn_iterations == 7
    assert info.spec.post_mult == 1.0 and info.spec.has_gamma
    assert info.spec.logits == 8 and info.spec.width == 64
    assert layer_name in [l.name for l in client.list_layers()]
    assert client.get_layer(layer_name).spec == info.spec
    params = client.get_parameters(layer_name)
    assert {k: v.shape for k, v in params.items()} == {
        "phi": (8, 64), "alpha": (3,), "beta": (8,), "gamma": (64,)}
    assert all(v.dtype == np.float32 for v in params.values())
    new_beta = np.arange(8, dtype=np.float32)
    version = client.set_parameters(layer_name, {"beta": new_beta}).parameters_version
    assert version > info.parameters_version
    np.testing.assert_array_equal(client.get_parameters(layer_name, ["beta"])["beta"], new_beta)
    minor = client.convert_layout(layer_name, "stream_minor")
    assert minor.spec.layout == "stream_minor"
    phi_minor = client.get_parameters(layer_name, ["phi"])["phi"]
    # phi_minor[g, c*n+i] = phi_major[g, i*C+c]
    np.testing.assert_array_equal(
        phi_minor, params["phi"].reshape(8, 2, 32).transpose(0, 2, 1).reshape(8, 64))
    client.delete_layer(layer_name)
    with pytest.raises(errors.NotFound):
        client.get_layer(layer_name)


def test_explicit_parameters_and_spec_object(client, layer_name, rng):
    spec = LayerSpec(hidden=4, n=2, sinkhorn_mode="log", eps_placement="outside")
    params = {"phi": rng.standard_normal((8, 8)), "alpha": np.ones(3),
              "beta": np.zeros(8)}
    info = client.create_layer(layer_name, spec=spec, parameters=params)
    assert info.spec.sinkhorn_mode == "log" and info.spec.eps_placement == "outside"
    np.testing.assert_array_equal(client.get_parameters(layer_name)["phi"],
                                  params["phi"].astype(np.float32))


def test_gradients_accumulate_and_zero(client, layer_name, rng):
    client.create_layer(layer_name, 8, n=4, seed=1)
    x = rng.standard_normal((4, 4, 8)).astype(np.float32)
    y, _, h_post, h_res = client.pre(layer_name, x)
    pb = client.post_backward(layer_name, x, y, x, h_post, h_res, skip_dx=True)
    client.pre_backward(layer_name, x, y, pb.dh_post, pb.dh_res, dx_next=x)
    once = client.get_gradients(layer_name)
    client.pre_backward(layer_name, x, y, pb.dh_post, pb.dh_res, dx_next=x,
                        skip_parameter_gradients=True)
    assert client.get_gradients(layer_name).tokens == once.tokens == 4
    client.post_backward(layer_name, x, y, x, h_post, h_res, skip_dx=True)
    client.pre_backward(layer_name, x, y, pb.dh_post, pb.dh_res, dx_next=x)
    twice = client.get_gradients(layer_name)
    assert twice.tokens == 8
    np.testing.assert_allclose(twice["phi"], 2 * once["phi"], rtol=1e-5, atol=1e-6)
    client.zero_gradients(layer_name)
    zeroed = client.get_gradients(layer_name)
    assert zeroed.tokens == 0 and not np.any(zeroed["phi"])


def test_errors_are_typed(client, layer_name, rng):
    with pytest.raises(errors.NotFound) as caught:
        client.pre("no-such-layer", np.zeros((1, 4, 8), np.float32))
    assert caught.value.code.name == "NOT_FOUND" and caught.value.rpc == "Pre"
    assert "no-such-layer" in caught.value.message
    client.create_layer(layer_name, 8, n=4, seed=1)
    with pytest.raises(errors.AlreadyExists):
        client.create_layer(layer_name, 8, n=4)
    with pytest.raises(errors.InvalidArgument):  # wrong stream count
        client.pre(layer_name, np.zeros((2, 3, 8), np.float32))
    with pytest.raises(errors.InvalidArgument):  # T out of range
        client.create_layer(layer_name + "x", 8, sinkhorn_iterations=0)
    with pytest.raises(errors.InvalidArgument):
        client.set_parameters(layer_name, {"phi": np.zeros((3, 3))})
    with pytest.raises(errors.FailedPrecondition):  # head op on an MHC layer
        client.head(layer_name, np.zeros((1, 4, 8), np.float32))
    with pytest.raises(errors.InvalidArgument):  # client-side enum check
        client.convert_layout(layer_name, "diagonal")
    assert isinstance(errors.error_for(errors.grpc.StatusCode.INTERNAL, "m"), errors.Internal)


def test_unreachable_daemon_and_addresses(client, tmp_path):
    with Client(f"unix:{tmp_path}/absent.sock", timeout=10, retries=2) as c:
        with pytest.raises(errors.Unavailable):
            c.server_info()
        with pytest.raises(errors.Unavailable):
            c.wait_for_ready(0.3)
    with pytest.raises(errors.InvalidArgument):
        mhc_client.normalize_address("localhost")
    assert mhc_client.normalize_address("127.0.0.1:5") == "127.0.0.1:5"


def test_benchmark(client, layer_name):
    client.create_layer(layer_name, 64, n=4, seed=1)
    result = client.benchmark(layer_name, "pre_backward", tokens=8, iterations=4, warmup=1)
    assert len(result.latencies_ms) == 4 and result.min_ms > 0
    assert result.median_ms >= result.min_ms and result.bytes_sent > 8 * 4 * 64 * 2
    assert client.get_gradients(layer_name).tokens == 0  # backward skipped grads


class _FlakyServicer(service_pb2_grpc.MhcServicer):
    """Answers UNAVAILABLE a set number of times, or too slowly."""

    def __init__(self, failures: int, delay: float = 0.0) -> None:
        self.failures = failures
        self.delay = delay
        self.calls = {"GetServerInfo": 0, "Execute": 0}

    def _maybe_fail(self, rpc: str, context: grpc.ServicerContext) -> None:
        self.calls[rpc] += 1
        if self.delay:
            time.sleep(self.delay)
        if self.calls[rpc] <= self.failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, "try again")

    def GetServerInfo(self, request, context):
        self._maybe_fail("GetServerInfo", context)
        return service_pb2.GetServerInfoResponse(version="fake")

    def Execute(self, request, context):
        self._maybe_fail("Execute", context)
        return service_pb2.ExecuteResponse()


def _fake_server(tmp_path, servicer):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    service_pb2_grpc.add_MhcServicer_to_server(servicer, server)
    address = f"unix:{tmp_path}/fake.sock"
    server.add_insecure_port(address)
    server.start()
    return server, address


def test_retries_only_calls_that_are_safe_to_repeat(tmp_path):
    servicer = _FlakyServicer(failures=2)
    server, address = _fake_server(tmp_path, servicer)
    try:
        with Client(address, retries=3) as c:
            assert c.server_info().version == "fake"
            assert servicer.calls["GetServerInfo"] == 3
            with pytest.raises(errors.Unavailable):
                c.execute(Batch())
            assert servicer.calls["Execute"] == 1
    finally:
        server.stop(None)


def test_deadline_exceeded(tmp_path):
    server, address = _fake_server(tmp_path, _FlakyServicer(failures=0, delay=2.0))
    try:
        with Client(address, timeout=0.2) as c:
            with pytest.raises(errors.DeadlineExceeded):
                c.server_info()
    finally:
        server.stop(None)
