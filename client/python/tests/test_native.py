"""The native call path (mhc_client._native) against the pure-Python one:
it is used when available, forced on or off as asked, sends the same
requests (bitwise equal outputs) and raises the same exceptions."""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Tuple

import numpy as np
import pytest

from mhc_client import Client, errors, native
from mhc_client.ops import op_def
from mhc_client.tensors import F32

HIDDEN, N = 16, 4
_regions = itertools.count()


def _need_native() -> None:
    """Skips without the extension, unless the run forces the native path
    (then its absence is a failure)."""
    reason = native.unavailable_reason()
    if reason is not None:
        if native.mode() == "on":
            pytest.fail(f"MHC_CLIENT_NATIVE=on but the extension does not load: {reason}")
        pytest.skip(f"mhc_client._native not built: {reason}")


@pytest.fixture
def both(daemon) -> Iterator[Tuple[Client, Client]]:
    """A pure-Python client and a native one to the same daemon."""
    _need_native()
    with Client(daemon.address, native=False) as pure, \
            Client(daemon.address, native=True) as fast:
        yield pure, fast


class Places:
    """Arrays in one region of `client`'s session, named as places."""

    def __init__(self, client: Client) -> None:
        self.region = client.open_session().create_region(
            f"io{next(_regions)}", 1 << 16)

    def put(self, array: np.ndarray) -> np.ndarray:
        return self.region.put(array.astype(np.float32))

    def tensor(self, field: str, array: np.ndarray) -> native.TensorPlace:
        return (field, F32, array.shape, self.region.name,
                self.offset(array), array.nbytes)

    def output(self, name: str, array: np.ndarray) -> native.OutputPlace:
        return (name, self.region.name, self.offset(array), array.nbytes)

    def offset(self, array: np.ndarray) -> int:
        return int(array.ctypes.data) - self.region.address


def _pre_backward(client: Client, layer: str, **flags: Any) -> np.ndarray:
    """PreBackward of fixed random inputs through compute_in_place."""
    places = Places(client)
    m = 5
    data = np.random.default_rng(7)
    x = places.put(data.standard_normal((m, N, HIDDEN)))
    dy = places.put(data.standard_normal((m, HIDDEN)))
    dh_post = places.put(data.standard_normal((m, N)))
    dh_res = places.put(data.standard_normal((m, N, N)))
    dx = places.region.alloc(np.float32, (m, N, HIDDEN))
    tensors = [places.tensor("x", x), places.tensor("dy", dy),
               places.tensor("dh_post", dh_post),
               places.tensor("dh_res", dh_res)]
    used_native = client.compute_in_place(
        op_def("pre_backward"), layer, tensors, [places.output("dx", dx)],
        flags, retry=False)
    assert used_native == (client.native is not None)
    return dx.copy()


def test_native_path_is_used_when_available(both, layer_name):
    pure, fast = both
    pure.create_layer(layer_name, HIDDEN, n=N, seed=3)
    assert pure.native is None and fast.native is not None
    fast.native.reset_stats()
    want = _pre_backward(pure, layer_name, skip_parameter_gradients=True)
    got = _pre_backward(fast, layer_name, skip_parameter_gradients=True)
    np.testing.assert_array_equal(got, want)
    stats = fast.native.stats()
    assert stats["calls"] == 1 and stats["failures"] == 0
    assert 0 < stats["largest_request_bytes"] < 1024


def test_repeated_flags_reach_the_daemon(both, layer_name):
    """Scale of a static layer takes lead_shape (a repeated field): the
    outputs' token shape must be the one sent."""
    pure, fast = both
    pure.create_layer(layer_name, HIDDEN, n=N, seed=3, dynamic=False)
    results = []
    for client in (pure, fast):
        places = Places(client)
        h_pre = places.region.alloc(np.float32, (2, 3, N))
        client.compute_in_place(op_def("scale"), layer_name, [],
                                [places.output("h_pre", h_pre)],
                                {"lead_shape": (2, 3)}, retry=True)
        results.append(h_pre.copy())
    np.testing.assert_array_equal(results[1], results[0])
    with pytest.raises(errors.InvalidArgument):  # a shape that does not match
        places = Places(fast)
        h_pre = places.region.alloc(np.float32, (2, 3, N))
        fast.compute_in_place(op_def("scale"), layer_name, [],
                              [places.output("h_pre", h_pre)],
                              {"lead_shape": [7]}, retry=True)


def _error_of(client: Client, call) -> errors.MhcError:
    with pytest.raises(errors.MhcError) as caught:
        call(client)
    return caught.value


@pytest.mark.parametrize("case", ["unknown_layer", "bad_shape",
                                  "unknown_region", "unknown_output"])
def test_daemon_errors_are_the_same_exceptions(both, layer_name, case):
    pure, fast = both
    pure.create_layer(layer_name, HIDDEN, n=N, seed=3)

    def call(client: Client) -> None:
        places = Places(client)
        x = places.put(np.ones((2, N, HIDDEN)))
        h_pre = places.put(np.ones((2, N)))
        y = places.region.alloc(np.float32, (2, HIDDEN))
        tensors = [places.tensor("x", x), places.tensor("h_pre", h_pre)]
        outputs = [places.output("y", y)]
        layer = layer_name
        if case == "unknown_layer":
            layer = layer_name + "-missing"
        elif case == "bad_shape":
            tensors[1] = ("h_pre", F32, (2, N + 1), places.region.name,
                          places.offset(h_pre), 2 * (N + 1) * 4)
        elif case == "unknown_region":
            tensors[0] = ("x",) + tensors[0][1:3] + ("no-such-region",) + tensors[0][4:]
        else:
            outputs = [("no_such_output",) + outputs[0][1:]]
        client.compute_in_place(op_def("aggregate"), layer, tensors, outputs,
                                {}, retry=True)

    want, got = _error_of(pure, call), _error_of(fast, call)
    assert type(got) is type(want)
    assert str(got) == str(want) and got.rpc == "Aggregate"
    assert fast.native.stats()["failures"] >= 1


def test_unavailable_is_retried_like_the_pure_path(tmp_path):
    _need_native()
    address = f"unix:{tmp_path}/nobody.sock"
    spec = op_def("aggregate")
    caught = []
    for use_native in (False, True):
        with Client(address, native=use_native, retries=3, timeout=5) as client:
            with pytest.raises(errors.Unavailable) as error:
                client.compute_in_place(spec, "l", [], [], {}, retry=True)
            caught.append(error.value)
            if use_native:
                assert client.native.stats()["retries"] == 2
    assert type(caught[0]) is type(caught[1]) and caught[1].rpc == "Aggregate"


def test_choice_of_path(daemon, monkeypatch):
    monkeypatch.delenv(native.ENV, raising=False)
    available = native.unavailable_reason() is None
    with Client(daemon.address) as client:  # auto, local daemon
        assert (client.native is not None) == available
    with Client("127.0.0.1:1") as remote:  # auto never takes it for TCP
        assert remote.native is None
    with Client(daemon.address, native=False) as client:
        assert client.native is None
    monkeypatch.setenv(native.ENV, "off")
    with Client(daemon.address) as client:
        assert client.native is None
    monkeypatch.setenv(native.ENV, "sometimes")
    with pytest.raises(errors.InvalidArgument, match=native.ENV):
        Client(daemon.address)


def test_forcing_a_missing_extension_fails(daemon, monkeypatch):
    monkeypatch.delenv(native.ENV, raising=False)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_import_error", ImportError("not built"))
    with pytest.raises(errors.FailedPrecondition, match="not built"):
        Client(daemon.address, native=True)
    with Client(daemon.address) as client:  # auto falls back
        assert client.native is None


@pytest.mark.parametrize("ring", ["on", "off"])
def test_call_ring_carries_the_compute_calls(daemon, layer_name, monkeypatch,
                                             ring):
    """With a session the native path's compute calls go through the call
    ring (shm.proto, "Call ring") unless MHC_CLIENT_CALL_RING=off; either
    way the outputs are the pure path's, bit for bit, and errors keep
    their type."""
    _need_native()
    monkeypatch.setenv(native.CALL_RING_ENV, ring)
    with Client(daemon.address, native=False) as pure, \
            Client(daemon.address, native=True) as fast:
        pure.create_layer(layer_name, HIDDEN, n=N, seed=5)
        want = _pre_backward(pure, layer_name, skip_parameter_gradients=True)
        for _ in range(3):
            got = _pre_backward(fast, layer_name,
                                skip_parameter_gradients=True)
            np.testing.assert_array_equal(got, want)
        with pytest.raises(errors.NotFound):
            _pre_backward(fast, "no-such-layer")
        stats = fast.native.stats()
        assert stats["calls"] == 4
        assert stats["ring_calls"] == (4 if ring == "on" else 0)
        # The ring ends with its session; the next session has its own.
        fast.open_session().close()
        got = _pre_backward(fast, layer_name, skip_parameter_gradients=True)
        np.testing.assert_array_equal(got, want)
        assert fast.native.stats()["ring_calls"] == (1 if ring == "on" else 0)
