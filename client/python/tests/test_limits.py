"""Layers larger than one gRPC message: get_parameters and get_gradients
switch to the daemon's streamed pieces and return the same bits, and
set_parameters sends them in pieces, all or nothing."""

from __future__ import annotations

import numpy as np
import pytest

import mhc_client
from mhc_client._proto import layer_pb2

N = 4
# phi alone is 4 * 2048 * 24 floats (768 KiB), several pieces of a 256 KiB
# message.
HIDDEN = 2048
SMALL_MESSAGE_BYTES = 256 << 10


@pytest.fixture
def small_client(daemon):
    with mhc_client.Client(daemon.address, timeout=60,
                           max_message_bytes=SMALL_MESSAGE_BYTES) as c:
        c.wait_for_ready(30)
        yield c


def test_large_layer_round_trips_through_the_stream(client, small_client,
                                                    layer_name, rng):
    client.create_layer(layer_name, HIDDEN, n=N, seed=3)
    values = {name: rng.uniform(-1, 1, size=array.shape).astype(np.float32)
              for name, array in client.get_parameters(layer_name).items()}
    client.set_parameters(layer_name, values)

    # One message cannot hold the layer for this client.
    with pytest.raises(mhc_client.ResourceExhausted):
        small_client._call("GetParameters",
                           layer_pb2.GetParametersRequest(layer=layer_name))
    got = small_client.get_parameters(layer_name)
    assert sorted(got) == sorted(values)
    for name, array in values.items():
        assert got[name].dtype == np.float32
        assert got[name].tobytes() == array.tobytes(), name
    phi = small_client.get_parameters(layer_name, ["phi"])
    assert list(phi) == ["phi"]

    tokens = 3
    x = rng.uniform(-1, 1, size=(tokens, N, HIDDEN)).astype(np.float32)
    dh = rng.uniform(-1, 1, size=(tokens, N * N + 2 * N)).astype(np.float32)
    dms = rng.uniform(-1, 1, size=(tokens,)).astype(np.float32)
    client.projection_backward(layer_name, x, dh, dmean_square=dms)
    expected = client.get_gradients(layer_name)
    streamed = small_client.get_gradients(layer_name)
    assert streamed.tokens == expected.tokens
    assert np.any(expected["phi"] != 0)
    for name, array in expected.items():
        assert streamed[name].tobytes() == array.tobytes(), name


def test_large_values_go_in_through_the_stream(client, small_client,
                                              layer_name, rng):
    from mhc_client.client import _parameters_proto
    info = client.create_layer(layer_name, HIDDEN, n=N, seed=3)
    values = {name: rng.uniform(-1, 1, size=array.shape).astype(np.float32)
              for name, array in client.get_parameters(layer_name).items()}
    # One message cannot hold them for this client.
    with pytest.raises(mhc_client.ResourceExhausted):
        small_client._call("SetParameters", layer_pb2.SetParametersRequest(
            layer=layer_name, parameters=_parameters_proto(values)))
    version = small_client.set_parameters(layer_name, values).parameters_version
    assert version == info.parameters_version + 1
    got = client.get_parameters(layer_name)
    for name, array in values.items():
        assert got[name].tobytes() == array.tobytes(), name

    # One tensor of the wrong shape, sorted after the others: none is
    # applied.
    broken = {name: array + 1 for name, array in values.items()}
    broken["phi"] = broken["phi"][:-1]
    with pytest.raises(mhc_client.InvalidArgument, match="phi"):
        small_client.set_parameters(layer_name, broken)
    assert client.get_layer(layer_name).parameters_version == version
    got = client.get_parameters(layer_name)
    for name, array in values.items():
        assert got[name].tobytes() == array.tobytes(), name


def test_parameter_chunks_cover_every_byte_once():
    from mhc_client import transfer
    from mhc_client.client import _parameters_proto
    values = {"b": np.arange(5, dtype=np.float32),
              "a": np.zeros((0,), dtype=np.float32)}
    pieces = list(transfer.parameter_chunks(
        "l", _parameters_proto(values), chunk_bytes=8))
    assert [(p.layer, p.name, p.offset, len(p.data)) for p in pieces] == [
        ("l", "a", 0, 0), ("", "b", 0, 8), ("", "b", 8, 8), ("", "b", 16, 4)]
    assert b"".join(p.data for p in pieces) == values["b"].tobytes()


def test_missing_layer_and_tensor_errors_come_through(small_client,
                                                      layer_name):
    small_client.create_layer(layer_name, HIDDEN, n=N, seed=3)
    with pytest.raises(mhc_client.InvalidArgument):
        small_client._stream_tensors(
            "StreamParameters",
            layer_pb2.GetParametersRequest(layer=layer_name, names=["nope"]))
    with pytest.raises(mhc_client.NotFound):
        small_client.get_parameters(layer_name + "-missing")


def _chunk(name, shape, offset, data):
    return layer_pb2.TensorChunk(name=name, shape=shape, offset=offset,
                                 data=data)


def test_assemble_refuses_gaps_and_short_tensors():
    from mhc_client import transfer
    whole = np.arange(6, dtype=np.float32).tobytes()
    tensors, _ = transfer.assemble([_chunk("a", [2, 3], 0, whole[:8]),
                                    _chunk("a", [2, 3], 8, whole[8:]),
                                    _chunk("b", [0], 0, b"")])
    assert tensors["a"].tobytes() == whole
    assert tensors["b"].shape == (0,)
    with pytest.raises(mhc_client.errors.DataLoss, match="does not continue"):
        transfer.assemble([_chunk("a", [2, 3], 0, whole[:8]),
                           _chunk("a", [2, 3], 12, whole[12:])])
    with pytest.raises(mhc_client.errors.DataLoss, match="ended after 8"):
        transfer.assemble([_chunk("a", [2, 3], 0, whole[:8])])
