"""The torch layer's local CUDA path against a CUDA daemon: parameters in
place, stream-ordered calls with no host synchronisation, bounded regions,
reallocated segments, and a client killed mid-step.

Needs a GPU and a test daemon serving CUDA (MHCD_BACKEND=cuda); skipped
otherwise.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import weakref
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

from mhc_client import Client, cuda_ipc, eager, errors
from mhc_client import torch as mhc_torch
from mhc_client.shm import CALL_RING_REGION
from mhc_client.torch import MhcLayer, mhc_pre

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

HIDDEN, N = 64, 4


@pytest.fixture
def cuda_client(daemon):
    """A client of its own (so its session's regions are this test's)."""
    with Client(daemon.address, timeout=120) as client:
        client.wait_for_ready(30)
        if not client.server_info().has_cuda:
            pytest.skip("the test daemon serves no CUDA device (MHCD_BACKEND=cuda)")
        yield client


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / (scale if scale > 0 else 1.0)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target.to(out.dtype)).square().mean()


def _make_stack(client: Client, count: int) -> List[MhcLayer]:
    presets = [("deepseek_v4", {}), ("liger", {"has_post_bias": True}),
               ("transformer_engine", {"has_gamma": True}), ("deepseek_v4", {})]
    layers = []
    for i in range(count):
        preset, extra = presets[i % len(presets)]
        # One layout for the whole stack, so that layers chain.
        layers.append(MhcLayer(client, HIDDEN, n=N, preset=preset, seed=20 + i,
                               sublayer=nn.Linear(HIDDEN, HIDDEN).cuda(),
                               matmul_precision="ieee", layout="stream_major",
                               **extra))
    return layers


def _check_aliasing(layer: MhcLayer) -> None:
    assert layer.parameters_in_place, f"{layer.layer_name}: parameters not in place"
    for key in layer.param_names:
        p = getattr(layer, key)
        assert p.is_cuda and p.data_ptr() == layer._param_views[key].data_ptr(), \
            f"{layer.layer_name}.{key} does not alias the daemon's parameter"
        if p.grad is not None:
            assert p.grad.data_ptr() == layer._grad_views[key].data_ptr(), \
                f"{layer.layer_name}.{key}.grad is not the daemon's accumulator"


def _snapshot(layers: List[MhcLayer]) -> List[Dict[str, torch.Tensor]]:
    """Stream-ordered copies of the parameters and sublayer weights."""
    out = []
    for layer in layers:
        values = {k: getattr(layer, k).detach().clone() for k in layer.param_names}
        values.update({f"sub.{k}": v.detach().clone()
                       for k, v in layer.sublayer.state_dict().items()})
        out.append(values)
    return out


def _eager_step(layers: List[MhcLayer], snapshot: List[Dict[str, torch.Tensor]],
                x: torch.Tensor, target: torch.Tensor):
    """Output, dx and gradients of the stack in float64 eager PyTorch from
    the recorded parameter values."""
    params, subs = [], []
    for layer, values in zip(layers, snapshot):
        params.append({k: values[k].double().requires_grad_() for k in layer.param_names})
        sub = nn.Linear(HIDDEN, HIDDEN).double().cuda()
        sub.load_state_dict({k[4:]: v.double() for k, v in values.items()
                             if k.startswith("sub.")})
        subs.append(sub)
    x64 = x.double().requires_grad_()
    out = x64
    for layer, p, sub in zip(layers, params, subs):
        out = eager.layer(out, p, layer.spec, sub)
    _loss(out, target).backward()
    return out, x64.grad, params


def test_training_loop_in_place_without_host_syncs(cuda_client):
    """200 SGD steps of 4 stacked layers with a new shape every step. The
    loop never synchronises the host: every read of a daemon output or
    gradient is ordered by the stream alone, and the checks against eager
    run afterwards on stream-ordered copies."""
    torch.manual_seed(0)
    rng = random.Random(0)
    layers = _make_stack(cuda_client, 4)
    try:
        for layer in layers:
            _check_aliasing(layer)
        # Away from the near-identity init, in place and stream-ordered
        # before the first call; small steps keep the stack well conditioned
        # (fp32 against fp64) for all the steps.
        with torch.no_grad():
            for layer in layers:
                layer.phi.normal_(0, 1.0 / (N * HIDDEN) ** 0.5)
                layer.alpha.uniform_(0.5, 1.5)
        params = [p for layer in layers for p in layer.parameters()]
        optimizer = torch.optim.SGD(params, lr=1e-3)
        session = cuda_client.open_session()
        warmup, steps = 5, 200
        records: List[Any] = []
        most_regions = 0
        for step in range(steps):
            if step == warmup:
                mhc_torch.stats.reset()
            lead = ((rng.randint(1, 4), rng.randint(1, 33)) if step % 4
                    else (rng.randint(1, 200),))
            x = torch.randn(*lead, N, HIDDEN, device="cuda", requires_grad=True)
            target = torch.randn(*lead, N, HIDDEN, device="cuda")
            before = _snapshot(layers)
            optimizer.zero_grad(set_to_none=True)
            out = x
            for layer in layers:
                out = layer(out)
            loss = _loss(out, target)
            loss.backward()
            grads = [{k: getattr(layer, k).grad.clone() for k in layer.param_names}
                     for layer in layers]
            records.append((x.detach(), target, before, out.detach().clone(),
                            x.grad.clone(), grads, loss.detach()))
            optimizer.step()
            if step % 10 == 0:
                regions = [r for r in cuda_client.shared_memory_status().regions
                           if r.name != CALL_RING_REGION]
                most_regions = max(most_regions, len(regions))
                assert len(regions) <= session.cuda_capacity + 1, \
                    f"step {step}: {len(regions)} regions registered"
        assert mhc_torch.stats.host_syncs == 0, \
            f"{mhc_torch.stats.host_syncs} host synchronisations in steady state"
        assert mhc_torch.stats.cuda_calls == 4 * 4 * (steps - warmup), mhc_torch.stats
        assert most_regions < session.max_regions
        for layer in layers:
            _check_aliasing(layer)
        torch.cuda.synchronize()
        losses = [float(record[-1]) for record in records]
        assert all(loss < 1e3 for loss in losses), f"training diverged: {losses}"
        for step, (x, target, before, out, dx, grads, _) in enumerate(records):
            want_out, want_dx, want_params = _eager_step(layers, before, x, target)
            where = f"step {step} (lead {tuple(x.shape[:-2])}, loss {losses[step]:.4g})"
            assert _rel(out, want_out) <= 1e-4, f"{where}: output"
            assert _rel(dx, want_dx) <= 1e-4, f"{where}: dx"
            for layer, got, want in zip(layers, grads, want_params):
                for key, p in want.items():
                    assert _rel(got[key], p.grad) <= 1e-3, \
                        f"{where}: {layer.layer_name}.{key} gradient"
        # The daemon sees the parameters the optimizer wrote in place.
        daemon_phi = torch.from_numpy(cuda_client.get_parameters(layers[0].layer_name)["phi"])
        assert torch.equal(daemon_phi, layers[0].phi.detach().cpu())
    finally:
        for layer in layers:
            layer.close()


def test_steady_state_calls_are_one_native_step(cuda_client):
    """Once its allocations are registered, every call of a layer step is
    one step of the native extension: no registration, no Python region
    lookup, no host synchronisation."""
    if cuda_client.native is None:
        pytest.skip("the native extension is not in use")
    torch.manual_seed(1)
    layer = _make_stack(cuda_client, 1)[0]
    try:
        session = cuda_client.open_session()
        x = torch.randn(3, 17, N, HIDDEN, device="cuda", requires_grad=True)
        grad = torch.randn(3, 17, N, HIDDEN, device="cuda")
        for step in range(13):
            if step == 3:
                mhc_torch.stats.reset()
                registrations = session.cuda_registrations
            x.grad = None
            layer(x).backward(grad)
        stats = mhc_torch.stats
        assert stats.cuda_calls == 4 * 10, stats
        assert stats.native_cuda_calls == stats.cuda_calls, stats
        if session.call_ring:
            assert stats.deferred_calls == stats.cuda_calls, stats
        assert stats.host_syncs == 0, stats
        assert session.cuda_registrations == registrations
        snapshot = _snapshot([layer])
        x64 = x.detach().double().requires_grad_()
        params = {k: snapshot[0][k].double() for k in layer.param_names}
        sub = nn.Linear(HIDDEN, HIDDEN).double().cuda()
        sub.load_state_dict({k[4:]: v.double() for k, v in snapshot[0].items()
                             if k.startswith("sub.")})
        eager.layer(x64, params, layer.spec, sub).backward(grad.double())
        assert _rel(x.grad, x64.grad) <= 1e-4, "dx through the native step"
    finally:
        layer.close()


def test_deferred_failure_is_raised_by_the_next_call(cuda_client, layer_name):
    """A deferred call that fails in the daemon: the caller's stream is not
    left waiting, the next call raises the error without running, and the
    calls after it run as before."""
    if cuda_client.native is None:
        pytest.skip("the native extension is not in use")
    cuda_client.create_layer(layer_name, HIDDEN, n=N, seed=3)
    session = cuda_client.open_session()
    x = torch.randn(5, N, HIDDEN, device="cuda")
    with torch.no_grad():
        first = mhc_pre(cuda_client, layer_name, x)[0]
    if session.deferred_wait_event(x.device.index) is None:
        pytest.skip("calls on CUDA tensors are not deferred here")
    transport = mhc_torch._Transport(cuda_client, "auto")
    mhc_torch.stats.reset()
    transport.run("pre", "no_such_layer", {"x": x},
                  {"y": ((5, HIDDEN), torch.float32)})
    assert mhc_torch.stats.deferred_calls == 1
    torch.cuda.synchronize()  # would hang if the stream were left waiting
    with pytest.raises(errors.NotFound, match="earlier deferred call"):
        transport.run("pre", layer_name, {"x": x},
                      {"y": ((5, HIDDEN), torch.float32)})
    with torch.no_grad():
        again = mhc_pre(cuda_client, layer_name, x)[0]
    cuda_client.flush()
    assert torch.equal(first, again)


def test_reallocated_segment_is_not_read_through_a_stale_mapping(cuda_client, layer_name):
    cuda_client.create_layer(layer_name, HIDDEN, n=N, seed=3, matmul_precision="ieee")
    spec = cuda_client.get_layer(layer_name).spec
    params = {k: torch.from_numpy(v).double().cuda()
              for k, v in cuda_client.get_parameters(layer_name).items()}
    session = cuda_client.open_session()
    tokens = (32 << 20) // (N * HIDDEN * 4)  # a segment of its own

    def check(x: torch.Tensor) -> None:
        with torch.no_grad():
            y, _, h_post, h_res = mhc_pre(cuda_client, layer_name, x)
            want_y, _, want_post, want_res = eager.pre(x.double(), params, spec)
        assert _rel(y, want_y) <= 1e-4 and _rel(h_res, want_res) <= 1e-4, \
            "pre read the wrong memory"

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    x1 = torch.randn(tokens, N, HIDDEN, device="cuda")
    check(x1)
    first = cuda_ipc.allocation_of(x1.data_ptr())
    first_region = session._cuda[first.buffer_id].name
    del x1
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    x2 = torch.randn(tokens, N, HIDDEN, device="cuda") + 3.0
    second = cuda_ipc.allocation_of(x2.data_ptr())
    assert second.buffer_id != first.buffer_id
    check(x2)
    if second.base == first.base:  # the case this test is about
        names = [r.name for r in cuda_client.shared_memory_status().regions]
        assert first_region not in names, "the freed segment's region is still registered"


def test_close_copies_parameters_and_unmaps(cuda_client):
    layer = MhcLayer(cuda_client, HIDDEN, n=N, sublayer=nn.Identity(), seed=4)
    assert layer.parameters_in_place
    mapping = weakref.ref(layer._mapping)
    x = torch.randn(3, N, HIDDEN, device="cuda", requires_grad=True)
    layer(x).sum().backward()
    phi, grad = layer.phi.detach().clone(), layer.phi.grad.clone()
    layer.close()
    assert mapping() is None, "the layer's memory is still mapped after close()"
    assert torch.equal(layer.phi.detach(), phi) and torch.equal(layer.phi.grad, grad)


def test_convert_layout_maps_the_new_memory(cuda_client):
    layer = MhcLayer(cuda_client, HIDDEN, n=N, sublayer=nn.Identity(), seed=5,
                     matmul_precision="ieee")
    try:
        generation = layer._mapping.generation
        layer.convert_layout("stream_minor")
        assert layer.spec.layout == "stream_minor"
        assert layer._mapping.generation != generation
        _check_aliasing(layer)
        torch.cuda.synchronize()
        daemon_phi = torch.from_numpy(cuda_client.get_parameters(layer.layer_name)["phi"])
        assert torch.equal(daemon_phi, layer.phi.detach().cpu())
        x = torch.randn(5, HIDDEN, N, device="cuda")
        params = {k: getattr(layer, k).detach().double() for k in layer.param_names}
        with torch.no_grad():
            out = layer(x)
        want = eager.layer(x.double(), params, layer.spec, nn.Identity())
        assert _rel(out, want) <= 1e-4
    finally:
        layer.close()


def test_moving_parameters_off_the_device_switches_to_mirror(cuda_client):
    layer = MhcLayer(cuda_client, HIDDEN, n=N, sublayer=nn.Identity(), seed=6,
                     matmul_precision="ieee")
    try:
        assert layer.parameters_in_place
        layer.to("cpu")
        with torch.no_grad():
            layer.phi.mul_(0.5)
        x = torch.randn(4, N, HIDDEN, requires_grad=True)
        out = layer(x)
        assert not layer.parameters_in_place
        out.sum().backward()
        assert layer.phi.grad is not None and layer.phi.grad.device.type == "cpu"
        params = {k: getattr(layer, k).detach().double() for k in layer.param_names}
        want = eager.layer(x.detach().double(), params, layer.spec, nn.Identity())
        assert _rel(out, want) <= 1e-4, "the daemon did not get the moved parameters"
    finally:
        layer.close()


# A client that trains until killed.
_VICTIM = r"""
import sys
import torch
from torch import nn
from mhc_client import Client
from mhc_client.torch import MhcLayer

client = Client(sys.argv[1], timeout=60)
layer = MhcLayer(client, 64, n=4, sublayer=nn.Identity(), seed=1, name=sys.argv[2])
assert layer.parameters_in_place
optimizer = torch.optim.SGD(layer.parameters(), lr=1e-3)
for step in range(100000):
    x = torch.randn(256, 4, 64, device="cuda", requires_grad=True)
    optimizer.zero_grad()
    layer(x).square().mean().backward()
    optimizer.step()
    if step == 3:
        print("stepping", flush=True)
"""


def test_client_killed_mid_step_leaves_the_daemon_serving():
    from conftest import Daemon, _binary

    # One session at most: a second opens only once the killed client's
    # session (and its regions) is gone.
    d = Daemon(_binary(), ["--allow_shm", "--shm_max_sessions=1"])
    victim = None
    try:
        with Client(d.address, timeout=60) as client:
            if not client.server_info().has_cuda:
                pytest.skip("the test daemon serves no CUDA device (MHCD_BACKEND=cuda)")
            name = f"victim-{os.getpid()}"
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
            victim = subprocess.Popen([sys.executable, "-c", _VICTIM, d.address, name],
                                      stdout=subprocess.PIPE, text=True, env=env)
            assert victim.stdout is not None
            assert victim.stdout.readline().strip() == "stepping", "the victim did not start"
            time.sleep(0.3)
            victim.send_signal(signal.SIGKILL)
            victim.wait(30)
            assert client.health() == "SERVING"
            deadline = time.monotonic() + 30
            while True:
                try:
                    client.open_session()
                    break
                except errors.ResourceExhausted:
                    assert time.monotonic() < deadline, \
                        "the killed client's session was never closed"
                    time.sleep(0.2)
            assert [r.name for r in client.shared_memory_status().regions
                    if r.name != CALL_RING_REGION] == []
            # The device still runs work, also for the killed client's layer.
            spec = client.get_layer(name).spec
            params = {k: torch.from_numpy(v).double().cuda()
                      for k, v in client.get_parameters(name).items()}
            x = torch.randn(8, N, HIDDEN, device="cuda")
            with torch.no_grad():
                y, _, _, h_res = mhc_pre(client, name, x)
                want_y, _, _, want_res = eager.pre(x.double(), params, spec)
            assert _rel(y, want_y) <= 1e-3 and _rel(h_res, want_res) <= 1e-3
            assert client.health() == "SERVING"
            client.delete_layer(name)
    finally:
        if victim is not None and victim.poll() is None:
            victim.kill()
        d.stop()
