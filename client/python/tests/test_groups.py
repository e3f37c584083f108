"""Data-parallel groups over NCCL.

On a CPU daemon groups are refused with the reason. With MHCD_BACKEND=cuda
and two GPUs: a group of two daemons (one GPU each) and of one daemon with
two devices, all-reduce exactness and determinism, broadcast, a data-parallel
step that equals single-GPU training on the concatenated batch, and a member
killed mid-group. MHCD_NCCL_LIBRARY names the NCCL library when the loader
cannot find libnccl.so.2 by itself.
"""

from __future__ import annotations

import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterator, List, Tuple

import numpy as np
import pytest

import mhc_client
from conftest import Daemon, _binary

HIDDEN, N = 256, 4


def _gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


TWO_GPUS = os.environ.get("MHCD_BACKEND") == "cuda" and _gpu_count() >= 2
needs_two_gpus = pytest.mark.skipif(
    not TWO_GPUS, reason="needs MHCD_BACKEND=cuda and two GPUs")


def test_cpu_daemon_refuses_groups_with_the_reason(
        client: mhc_client.Client) -> None:
    if client.server_info().backend == "cuda":
        pytest.skip("a CUDA daemon serves groups")
    client.create_layer("grp_l0", hidden=64, seed=1)
    try:
        with pytest.raises(mhc_client.FailedPrecondition,
                           match="groups are not available"):
            client.create_group("g", 1, {0: ("", ["grp_l0"])})
        with pytest.raises(mhc_client.FailedPrecondition,
                           match="groups are not available"):
            client.all_reduce_gradients("g")
    finally:
        client.delete_layer("grp_l0")


# ------------------------------------------------------------------ GPU


def _nccl_flags() -> List[str]:
    library = os.environ.get("MHCD_NCCL_LIBRARY", "")
    return [f"--nccl_library={library}"] if library else []


@pytest.fixture
def two_daemons() -> Iterator[Tuple[Daemon, Daemon]]:
    a = Daemon(_binary(), ["--devices=0", *_nccl_flags()])
    b = Daemon(_binary(), ["--devices=1", *_nccl_flags()])
    yield a, b
    a.stop()
    b.stop()


def _inputs(rng: np.random.Generator, tokens: int) -> Dict[str, np.ndarray]:
    return dict(
        x=rng.standard_normal((tokens, N, HIDDEN)).astype(np.float32),
        dy=rng.standard_normal((tokens, HIDDEN)).astype(np.float32),
        dh_post=rng.standard_normal((tokens, N)).astype(np.float32),
        dh_res=rng.standard_normal((tokens, N, N)).astype(np.float32))


def _backward(client: mhc_client.Client, layer: str,
              batch: Dict[str, np.ndarray]) -> None:
    """Adds the gradients of one Pre backward over `batch` to `layer`."""
    client.pre(layer, batch["x"])
    client.pre_backward(layer, batch["x"], batch["dy"], batch["dh_post"],
                        batch["dh_res"])


def _slice(batch: Dict[str, np.ndarray], part: slice) -> Dict[str, np.ndarray]:
    return {k: v[part] for k, v in batch.items()}


def _together(*calls: Callable[[], Any]) -> List[Any]:
    """Runs one collective call per daemon at once, as the group needs."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


def _form_pair(ca: mhc_client.Client, cb: mhc_client.Client, name: str,
               layers_a: List[str], layers_b: List[str],
               timeout: float = 60) -> None:
    info = ca.create_group(name, 2, {0: ("", layers_a)}, timeout=timeout)
    assert info.state in ("FORMING", "READY") and len(info.unique_id) == 128
    joined = cb.join_group(name, 2, info.unique_id, {1: ("", layers_b)},
                           timeout=timeout, wait=True)
    assert joined.state == "READY", joined.error
    deadline = time.monotonic() + timeout
    while ca.get_group(name).state == "FORMING" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ca.get_group(name).state == "READY", ca.get_group(name).error


@needs_two_gpus
def test_two_daemons_data_parallel_step_equals_one_gpu(
        two_daemons: Tuple[Daemon, Daemon]) -> None:
    a, b = two_daemons
    rng = np.random.default_rng(7)
    batch = _inputs(rng, 96)
    with mhc_client.Client(a.address) as ca, mhc_client.Client(b.address) as cb:
        for c in (ca, cb):
            for i in range(2):
                c.create_layer(f"l{i}", hidden=HIDDEN, n=N, seed=11 + i)
        ca.create_layer("whole0", hidden=HIDDEN, n=N, seed=11)
        _form_pair(ca, cb, "dp", ["l0", "l1"], ["l0", "l1"])

        # Each rank takes half the batch; the sum over ranks is the batch's.
        for c, part in ((ca, slice(0, 48)), (cb, slice(48, 96))):
            for layer in ("l0", "l1"):
                _backward(c, layer, _slice(batch, part))
        _backward(ca, "whole0", batch)
        result, _ = _together(lambda: ca.all_reduce_gradients("dp", "sum"),
                              lambda: cb.all_reduce_gradients("dp", "sum"))
        assert result.bytes > 0 and result.seconds > 0

        ga, gb = ca.get_gradients("l0"), cb.get_gradients("l0")
        whole = ca.get_gradients("whole0")
        for name in whole:
            # Every rank holds the same bits; the batch's sum up to rounding.
            np.testing.assert_array_equal(ga[name], gb[name])
            np.testing.assert_allclose(ga[name], whole[name], rtol=2e-5,
                                       atol=2e-5 * np.abs(whole[name]).max())

        for c, layer in ((ca, "l0"), (cb, "l0"), (ca, "whole0")):
            c.optimizer_step(layer, learning_rate=1e-2, algorithm="sgd",
                             momentum=0.9, zero_gradients=True)
        pa, pb = ca.get_parameters("l0"), cb.get_parameters("l0")
        pw = ca.get_parameters("whole0")
        for name in pw:
            np.testing.assert_array_equal(pa[name], pb[name])
            np.testing.assert_allclose(pa[name], pw[name], rtol=1e-5,
                                       atol=1e-6)

        # Same inputs again: the all-reduce gives the same bits again.
        first = None
        for _ in range(2):
            for c, part in ((ca, slice(0, 48)), (cb, slice(48, 96))):
                c.zero_gradients("l1")
                _backward(c, "l1", _slice(batch, part))
            _together(lambda: ca.all_reduce_gradients("dp", "mean"),
                      lambda: cb.all_reduce_gradients("dp", "mean"))
            g = ca.get_gradients("l1")
            if first is None:
                first = g
            else:
                for name in g:
                    np.testing.assert_array_equal(g[name], first[name])

        # Broadcast: rank 1's parameters everywhere.
        ca.set_parameters("l1", {k: v + 1 for k, v in
                                 ca.get_parameters("l1").items()})
        version = ca.get_layer("l1").parameters_version
        _together(lambda: ca.broadcast_parameters("dp", root_rank=1),
                  lambda: cb.broadcast_parameters("dp", root_rank=1))
        pa, pb = ca.get_parameters("l1"), cb.get_parameters("l1")
        for name in pb:
            np.testing.assert_array_equal(pa[name], pb[name])
        assert ca.get_layer("l1").parameters_version > version
        ca.leave_group("dp")
        cb.leave_group("dp")
        with pytest.raises(mhc_client.NotFound):
            ca.get_group("dp")


@needs_two_gpus
def test_one_daemon_two_devices(rng: np.random.Generator) -> None:
    d = Daemon(_binary(), ["--devices=0,1", *_nccl_flags()])
    try:
        with mhc_client.Client(d.address) as c:
            c.create_layer("r0", hidden=HIDDEN, n=N, seed=3, device="cuda:0")
            c.create_layer("r1", hidden=HIDDEN, n=N, seed=3, device="cuda:1")
            with pytest.raises(mhc_client.InvalidArgument, match="one rank per"):
                c.create_group("bad", 2, {0: ("cuda:0", ["r0"]),
                                          1: ("cuda:0", ["r0"])})
            with pytest.raises(mhc_client.FailedPrecondition, match="lives on"):
                c.create_group("bad", 2, {0: ("cuda:0", ["r1"]),
                                          1: ("cuda:1", ["r0"])})
            info = c.create_group("pair", 2, {0: ("cuda:0", ["r0"]),
                                              1: ("cuda:1", ["r1"])},
                                  wait=True, timeout=60)
            assert info.state == "READY", info.error
            batch = _inputs(rng, 40)
            _backward(c, "r0", _slice(batch, slice(0, 17)))
            _backward(c, "r1", _slice(batch, slice(17, 40)))
            g0, g1 = c.get_gradients("r0"), c.get_gradients("r1")
            c.all_reduce_gradients("pair", "sum")
            s0, s1 = c.get_gradients("r0"), c.get_gradients("r1")
            for name in s0:
                np.testing.assert_array_equal(s0[name], s1[name])
                # Two addends: the sum is exact whatever the order.
                np.testing.assert_array_equal(s0[name], g0[name] + g1[name])
            c.leave_group("pair")
    finally:
        d.stop()


@needs_two_gpus
def test_mismatched_layers_fail_formation(
        two_daemons: Tuple[Daemon, Daemon]) -> None:
    a, b = two_daemons
    with mhc_client.Client(a.address) as ca, mhc_client.Client(b.address) as cb:
        ca.create_layer("m", hidden=HIDDEN, n=N, seed=1)
        cb.create_layer("m", hidden=HIDDEN * 2, n=N, seed=1)
        info = ca.create_group("mm", 2, {0: ("", ["m"])}, timeout=60)
        joined = cb.join_group("mm", 2, info.unique_id, {1: ("", ["m"])},
                               wait=True, timeout=60)
        assert joined.state == "FAILED" and "differ" in joined.error
        with pytest.raises(mhc_client.FailedPrecondition, match="differ"):
            cb.all_reduce_gradients("mm")


@needs_two_gpus
def test_dead_member_fails_the_group_not_the_daemon(
        two_daemons: Tuple[Daemon, Daemon]) -> None:
    a, b = two_daemons
    with mhc_client.Client(a.address) as ca, mhc_client.Client(b.address) as cb:
        ca.create_layer("k", hidden=HIDDEN, n=N, seed=1)
        cb.create_layer("k", hidden=HIDDEN, n=N, seed=1)
        _form_pair(ca, cb, "doomed", ["k"], ["k"])
        _together(lambda: ca.all_reduce_gradients("doomed"),
                  lambda: cb.all_reduce_gradients("doomed"))
        b.proc.kill()
        b.proc.wait()
        start = time.monotonic()
        with pytest.raises((mhc_client.DeadlineExceeded,
                            mhc_client.Unavailable, mhc_client.Internal)):
            ca.all_reduce_gradients("doomed", timeout=5)
        assert time.monotonic() - start < 30
        assert ca.get_group("doomed").state == "FAILED"
        assert ca.health() == "SERVING"
        # The device still works for everything else.
        rng = np.random.default_rng(0)
        _backward(ca, "k", _inputs(rng, 8))
        ca.leave_group("doomed")


@needs_two_gpus
def test_join_validation(two_daemons: Tuple[Daemon, Daemon]) -> None:
    a, _ = two_daemons
    with mhc_client.Client(a.address) as ca:
        ca.create_layer("v", hidden=HIDDEN, n=N, seed=1)
        with pytest.raises(mhc_client.InvalidArgument, match="rank 0"):
            ca.create_group("v", 2, {1: ("", ["v"])})
        with pytest.raises(mhc_client.InvalidArgument, match="unique_id"):
            ca.join_group("v", 2, b"short", {1: ("", ["v"])})
        with pytest.raises(mhc_client.InvalidArgument, match="rank"):
            ca.create_group("v", 2, {5: ("", ["v"])})
        with pytest.raises(mhc_client.NotFound):
            ca.create_group("v", 1, {0: ("", ["nope"])})
        with pytest.raises(mhc_client.InvalidArgument, match="timeout"):
            ca.create_group("v", 1, {0: ("", ["v"])}, timeout=-1)
        # A group of one forms at once and its all-reduce is the identity.
        info = ca.create_group("solo", 1, {0: ("", ["v"])}, wait=True)
        assert info.state == "READY", info.error
        with pytest.raises(mhc_client.AlreadyExists):
            ca.create_group("solo", 1, {0: ("", ["v"])})
        before = ca.get_gradients("v")
        ca.all_reduce_gradients("solo", "mean")
        after = ca.get_gradients("v")
        for name in before:
            np.testing.assert_array_equal(before[name], after[name])
        ca.leave_group("solo")
