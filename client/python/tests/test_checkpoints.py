"""Checkpoints through the Python client, and the file read back with numpy
alone: a small safetensors reader that knows nothing of mhcd parses the
header, checks every tensor's CRC-32C and yields arrays equal bit for bit
to GetParameters / GetGradients.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Dict, Iterator, Tuple

import numpy as np
import pytest

import mhc_client
from conftest import Daemon, _binary


def _crc32c_table() -> np.ndarray:
    table = np.zeros(256, dtype=np.uint32)
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table[byte] = crc
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    table = _TABLE
    for byte in data:
        crc = int(table[(crc ^ byte) & 0xFF]) ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def read_safetensors(path: Path) -> Tuple[Dict[str, str], Dict[str, np.ndarray]]:
    """(metadata, tensors) of a safetensors file, checksums verified."""
    raw = path.read_bytes()
    (header_size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_size])
    data = raw[8 + header_size:]
    assert (8 + header_size) % 8 == 0, "tensor data must start aligned"
    metadata = header.pop("__metadata__")
    checksums = json.loads(metadata["checksums"])
    tensors = {}
    end_of_previous = 0
    for name, entry in sorted(header.items(), key=lambda e: e[1]["data_offsets"]):
        begin, end = entry["data_offsets"]
        assert begin == end_of_previous, "tensors must cover the data, no holes"
        end_of_previous = end
        assert entry["dtype"] == "F32"
        blob = data[begin:end]
        assert f"{crc32c(blob):08x}" == checksums[name], name
        tensors[name] = np.frombuffer(blob, dtype="<f4").reshape(entry["shape"])
    assert end_of_previous == len(data)
    return metadata, tensors


@pytest.fixture
def state_daemon() -> Iterator[Tuple[Daemon, Path]]:
    state = Path(tempfile.mkdtemp(prefix="mhcd-py-state-"))
    daemon = Daemon(_binary(), [f"--state_dir={state}"])
    yield daemon, state
    daemon.stop()
    shutil.rmtree(state, ignore_errors=True)


def test_file_reads_back_with_numpy_alone(state_daemon):
    daemon, state = state_daemon
    rng = np.random.default_rng(5)
    with mhc_client.Client(daemon.address) as client:
        client.wait_for_ready(30)
        client.create_layer("l0", 24, n=4, seed=3)
        client.create_layer("l1", 16, n=2, layout="stream_minor", seed=4)
        client.set_parameters("l1", {
            name: rng.standard_normal(value.shape).astype(np.float32)
            for name, value in client.get_parameters("l1").items()})
        # Non-zero gradients on l0 (n=4: 24 logits per token).
        f32 = np.float32
        client.scale_backward(
            "l0", rng.standard_normal((5, 4)).astype(f32),
            dh_post=rng.standard_normal((5, 4)).astype(f32),
            dlogits=rng.standard_normal((5, 4, 4)).astype(f32),
            h=rng.standard_normal((5, 24)).astype(f32),
            mean_square=rng.uniform(0.5, 2, 5).astype(f32))
        assert client.get_gradients("l0").tokens == 5
        saved = client.save_checkpoint("np", gradients=True)
        assert list(saved.layers) == ["l0", "l1"]
        assert saved.bytes == os.path.getsize(state / "np.safetensors")

        metadata, tensors = read_safetensors(state / "np.safetensors")
        assert metadata["format"] == "mhcd.checkpoint"
        assert metadata["format_version"] == "1"
        manifest = json.loads(metadata["layers"])
        assert [layer["name"] for layer in manifest["layers"]] == ["l0", "l1"]
        for layer in manifest["layers"]:
            info = client.get_layer(layer["name"])
            assert int(layer["spec"]["hidden"]) == info.spec.hidden
            assert layer["has_gradients"] is True
            assert int(layer["gradient_tokens"]) == info.gradient_tokens
            params = client.get_parameters(layer["name"])
            grads = client.get_gradients(layer["name"])
            assert sorted(params) == sorted(layer["parameters"])
            for name, value in params.items():
                got = tensors[f"{layer['name']}/param/{name}"]
                assert got.shape == value.shape
                assert got.tobytes() == value.astype("<f4").tobytes()
                assert tensors[f"{layer['name']}/grad/{name}"].tobytes() == \
                    grads[name].astype("<f4").tobytes()
        assert manifest["layers"][1]["spec"]["layout"] == "LAYOUT_STREAM_MINOR"
        assert np.any(tensors["l0/grad/alpha"] != 0)


def test_round_trip_and_errors(state_daemon):
    daemon, state = state_daemon
    with mhc_client.Client(daemon.address) as client:
        client.wait_for_ready(30)
        client.create_layer("a", 32, seed=1)
        want = client.get_parameters("a")
        client.save_checkpoint("ck")
        assert [c.name for c in client.list_checkpoints()] == ["ck"]
        with pytest.raises(mhc_client.AlreadyExists):
            client.load_checkpoint("ck")
        client.set_parameters("a", {k: v + 1 for k, v in want.items()})
        loaded = client.load_checkpoint("ck", replace=True)
        assert [info.name for info in loaded.layers] == ["a"]
        assert loaded.bytes == sum(v.nbytes for v in want.values())
        got = client.get_parameters("a")
        assert all(got[k].tobytes() == want[k].tobytes() for k in want)
        with pytest.raises(mhc_client.InvalidArgument):
            client.save_checkpoint("../outside")
        with pytest.raises(mhc_client.NotFound):
            client.load_checkpoint("missing")
        raw = bytearray((state / "ck.safetensors").read_bytes())
        raw[-1] ^= 0xFF
        (state / "bad.safetensors").write_bytes(bytes(raw))
        with pytest.raises(mhc_client.errors.DataLoss):
            client.load_checkpoint("bad", replace=True)
        assert client.get_parameters("a")["phi"].tobytes() == want["phi"].tobytes()


def test_without_state_dir_is_failed_precondition(client):
    with pytest.raises(mhc_client.FailedPrecondition, match="--state_dir"):
        client.save_checkpoint("x")
    with pytest.raises(mhc_client.FailedPrecondition):
        client.list_checkpoints()


def _backward(client, name, n, hidden, rng):
    """Adds one backward pass's gradients (phi included) to layer `name`."""
    x = rng.standard_normal((3, n, hidden)).astype(np.float32)
    y, _, h_post, h_res = client.pre(name, x)
    pb = client.post_backward(name, x, y, x, h_post, h_res, skip_dx=True)
    client.pre_backward(name, x, y, pb.dh_post, pb.dh_res, dx_next=x)


def test_optimizer_state_matches_a_float64_reference(state_daemon):
    """The file's optim/<slot>/<param> tensors hold what torch.optim's SGD
    (momentum_buffer) and AdamW (exp_avg, exp_avg_sq) keep after the same
    three steps, computed here in float64 from the daemon's own gradients."""
    daemon, state = state_daemon
    rng = np.random.default_rng(9)
    momentum, wd, beta1, beta2 = 0.9, 0.01, 0.8, 0.99
    layers = {"m": ("sgd", 4, 16), "w": ("adamw", 2, 24)}
    with mhc_client.Client(daemon.address) as client:
        client.wait_for_ready(30)
        for i, (name, (_, n, hidden)) in enumerate(layers.items()):
            client.create_layer(name, hidden, n=n, seed=11 + i)
        want: Dict[str, Dict[str, Dict[str, np.ndarray]]] = {
            "m": {"momentum_buffer": {}},
            "w": {"exp_avg": {}, "exp_avg_sq": {}}}
        for step in range(1, 4):
            for name, (algorithm, n, hidden) in layers.items():
                _backward(client, name, n, hidden, rng)
                grads = client.get_gradients(name)
                params = client.get_parameters(name)
                for key, grad in grads.items():
                    g = grad.astype(np.float64)
                    slots = want[name]
                    if algorithm == "sgd":
                        g = g + wd * params[key].astype(np.float64)
                        buf = slots["momentum_buffer"].get(key)
                        slots["momentum_buffer"][key] = (
                            g if buf is None else momentum * buf + g)
                    else:
                        m = slots["exp_avg"].get(key, 0.0)
                        v = slots["exp_avg_sq"].get(key, 0.0)
                        slots["exp_avg"][key] = beta1 * m + (1 - beta1) * g
                        slots["exp_avg_sq"][key] = (
                            beta2 * v + (1 - beta2) * g * g)
                if algorithm == "sgd":
                    client.optimizer_step(name, algorithm="sgd",
                                          learning_rate=0.05,
                                          momentum=momentum, weight_decay=wd,
                                          zero_gradients=True)
                else:
                    client.optimizer_step(name, algorithm="adamw",
                                          learning_rate=0.01,
                                          betas=(beta1, beta2),
                                          weight_decay=0.1,
                                          zero_gradients=True)
        client.save_checkpoint("optim")
        client.save_checkpoint("bare", optimizer_state=False)

        metadata, tensors = read_safetensors(state / "optim.safetensors")
        manifest = {layer["name"]: layer
                    for layer in json.loads(metadata["layers"])["layers"]}
        for name, (algorithm, _, _) in layers.items():
            optimizer = manifest[name]["optimizer"]
            assert optimizer["algorithm"] == algorithm
            assert int(optimizer["step"]) == 3
            assert optimizer["slots"] == list(want[name])
            for slot, per_param in want[name].items():
                assert sorted(per_param) == sorted(
                    manifest[name]["parameters"])
                for key, value in per_param.items():
                    got = tensors[f"{name}/optim/{slot}/{key}"]
                    assert got.shape == value.shape
                    assert np.any(value != 0), f"{name}.{slot}.{key}"
                    scale = float(np.max(np.abs(value)))
                    np.testing.assert_allclose(
                        got, value, rtol=2e-5, atol=1e-6 * scale,
                        err_msg=f"{name}/optim/{slot}/{key}")

        metadata, tensors = read_safetensors(state / "bare.safetensors")
        assert not any("/optim/" in key for key in tensors)
        assert all("optimizer" not in layer
                   for layer in json.loads(metadata["layers"])["layers"])

        # Loaded back and saved again: the same bytes.
        loaded = client.load_checkpoint("optim", replace=True)
        assert {(info.name, info.optimizer_algorithm, info.optimizer_step)
                for info in map(mhc_client.LayerInfo.from_proto,
                                loaded.layers)} == {("m", "sgd", 3),
                                                    ("w", "adamw", 3)}
        client.save_checkpoint("again")
        _, again = read_safetensors(state / "again.safetensors")
        _, first = read_safetensors(state / "optim.safetensors")
        for key, value in first.items():
            if "/optim/" in key:
                assert again[key].tobytes() == value.tobytes(), key
