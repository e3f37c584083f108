"""Shared-memory sessions: regions, numpy views, in-place outputs, cleanup."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from mhc_client import Client, errors
from mhc_client.shm import CALL_RING_REGION, SharedMemoryObject, unique_key


def _exists(key: str) -> bool:
    return os.path.exists(f"/dev/shm/{key}")


def _names(status) -> list:
    """The session's regions, less the call ring a native client keeps."""
    return [r.name for r in status.regions if r.name != CALL_RING_REGION]


def test_inputs_and_outputs_in_a_region(client, layer_name, rng):
    client.create_layer(layer_name, 16, n=4, seed=1)
    x = rng.standard_normal((6, 4, 16)).astype(np.float32)
    want = client.pre(layer_name, x)
    with client.open_session() as session:
        assert session.id and session.max_regions >= 1
        region = session.create_region("io", 1 << 16)
        xv = region.put(x)
        y_out = region.alloc(np.float32, (6, 16))
        out = client.compute("pre", layer_name, x=xv, out={"y": y_out})
        assert np.shares_memory(out["y"], y_out)
        np.testing.assert_array_equal(y_out, want.y)
        np.testing.assert_array_equal(out["h_res"], want.h_res)  # inline
        status = session.status()
        assert _names(status) == ["io"]
        # bf16 bits straight from the region.
        xb = region.put(x, "bf16")
        assert xb.dtype == np.uint16
        yb = client.pre(layer_name, xb).y
        assert yb.dtype != np.float32
    assert client.session is None


def test_close_unregisters_and_unlinks(client, daemon):
    session = client.open_session()
    region = session.create_region("tmp", 4096)
    key = region.object.key
    assert _exists(key)
    region.close()
    assert not _exists(key) and _names(session.status()) == []
    region2 = session.create_region("tmp2", 4096)
    key2 = region2.object.key
    view = region2.ndarray(np.float32, (8,))
    session.close()
    assert not _exists(key2)
    view[:] = 1.0  # a live view stays valid after close (unmapped with it)
    with Client(daemon.address) as other:
        other.open_session()
        assert _names(other.shared_memory_status()) == []


def test_garbage_collected_session_releases_everything(daemon):
    c = Client(daemon.address)
    key = c.open_session().create_region("gc", 4096).object.key
    assert _exists(key)
    c.close()
    gc.collect()
    assert not _exists(key)
    obj = SharedMemoryObject(unique_key(tag="gc2"), 128)
    key = obj.key
    del obj
    gc.collect()
    assert not _exists(key)


def test_regions_are_private_to_their_session(client, daemon, layer_name, rng):
    client.create_layer(layer_name, 8, n=4, seed=1)
    with client.open_session() as session:
        region = session.create_region("mine", 4096)
        xv = region.put(rng.standard_normal((2, 4, 8)).astype(np.float32))
        ref = session.tensor_ref(xv, "f32")
        with Client(daemon.address) as other:
            with pytest.raises(errors.FailedPrecondition):  # no session at all
                other.compute("pre", layer_name, x=ref)
            other.open_session()
            with pytest.raises((errors.PermissionDenied, errors.NotFound)):
                other.compute("pre", layer_name, x=ref)
        with pytest.raises(errors.AlreadyExists):
            session.create_region("mine", 4096)
        with pytest.raises(errors.InvalidArgument):
            client.register_system_shared_memory("bad", "../etc", 0, 16)
        with pytest.raises(errors.InvalidArgument):  # beyond the region
            region.ndarray(np.float32, (2048,))
        with pytest.raises(errors.InvalidArgument):  # out= must be a region view
            client.compute("pre", layer_name, x=xv, out={"y": np.zeros((2, 8), np.float32)})


def test_shm_refused_without_allow_shm(tmp_path):
    from conftest import Daemon, _binary

    d = Daemon(_binary(), [])
    try:
        with Client(d.address) as c:
            with pytest.raises(errors.FailedPrecondition):
                c.open_session().create_region("r", 64)
    finally:
        d.stop()
