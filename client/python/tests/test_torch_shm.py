"""The torch layer's host tensors through the session's shared-memory arena
(mhc_client.torch_transport, path "arena"), against float64 autograd of
mhc_client.eager: changing shapes, bounded regions, no tensor bytes in the
messages, and a tensor larger than the daemon's inline limits."""

from __future__ import annotations

import random
import shutil
from typing import Any, List

import pytest
import torch
from torch import nn

from mhc_client import Client, errors, eager
from mhc_client import torch as mhc_torch
from mhc_client.shm import CALL_RING_REGION
from mhc_client.torch import MhcLayer, mhc_pre


def _host_regions(client: Client) -> List[Any]:
    """The session's regions, less the call ring of a native client."""
    return [r for r in client.shared_memory_status().regions
            if r.name != CALL_RING_REGION]


# Compute requests whose tensors all lie in regions are small; inline
# tensors of the shapes below would not be.
MAX_REQUEST_BYTES = 2048


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / (scale if scale > 0 else 1.0)


def _record_requests(client: Client) -> List[Any]:
    """Wraps client._call to keep (rpc, request bytes) of every call of the
    pure-Python path (the native path counts its own, see _compute_sizes)."""
    seen: List[Any] = []
    call = client._call

    def recording(rpc: str, request: Any, **kw: Any) -> Any:
        seen.append((rpc, request.ByteSize()))
        return call(rpc, request, **kw)

    client._call = recording  # type: ignore[method-assign]
    return seen


def _compute_sizes(client: Client, seen: List[Any]) -> List[int]:
    """Request sizes of the compute calls: each one the pure-Python path
    made, or the native path's call count times its largest request."""
    if client.native is not None:
        stats = client.native.stats()
        return [stats["largest_request_bytes"]] * stats["calls"]
    return [size for rpc, size in seen
            if rpc in ("Pre", "Post", "PreBackward", "PostBackward")]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target.to(out.dtype)).square().mean()


def _eager_twin(layers: List[MhcLayer], x: torch.Tensor, target: torch.Tensor):
    """Output, dx and parameter / sublayer gradients of the same stack in
    float64 eager PyTorch, from the layers' current parameter values."""
    params = [{k: getattr(layer, k).detach().double().requires_grad_()
               for k in layer.param_names} for layer in layers]
    subs = []
    for layer in layers:
        sub = nn.Linear(layer.sublayer.in_features, layer.sublayer.out_features).double()
        sub.load_state_dict({k: v.double() for k, v in layer.sublayer.state_dict().items()})
        subs.append(sub)
    x64 = x.detach().double().requires_grad_()
    out = x64
    for layer, p, sub in zip(layers, params, subs):
        out = eager.layer(out, p, layer.spec, sub)
    _loss(out, target).backward()
    return out, x64.grad, params, subs


def test_stacked_layers_follow_eager_through_shared_memory(daemon):
    torch.manual_seed(3)
    rng = random.Random(3)
    with Client(daemon.address, timeout=60) as client:
        hidden, n = 16, 4
        # Mirror mode also on a CUDA daemon: this test is about host tensors.
        layers = [MhcLayer(client, hidden, n=n, sublayer=nn.Linear(hidden, hidden),
                           seed=10 + i, preset=preset, matmul_precision="ieee",
                           parameters_in_place=False, **extra)
                  for i, (preset, extra) in enumerate(
                      [("deepseek_v4", {}), ("liger", {"has_post_bias": True})])]
        try:
            assert not any(layer.parameters_in_place for layer in layers)
            with torch.no_grad():  # away from the near-identity init
                for layer in layers:
                    layer.phi.normal_(0, 0.2)
                    layer.alpha.uniform_(0.5, 1.5)
            params = [p for layer in layers for p in layer.parameters()]
            optimizer = torch.optim.SGD(params, lr=0.05)
            seen = _record_requests(client)
            if client.native is not None:
                client.native.reset_stats()
            before = dict(vars(mhc_torch.stats))
            steps = 24
            for step in range(steps):
                # Shapes change every step; one step is large enough to grow
                # the arena.
                lead = (rng.randint(2, 4), rng.randint(4, 12)) if step % 3 else (rng.randint(8, 40),)
                if step == steps // 2:
                    lead = (1500,)
                x = torch.randn(*lead, n, hidden, requires_grad=True)
                target = torch.randn(*lead, n, hidden)
                optimizer.zero_grad()
                out = x
                for layer in layers:
                    out = layer(out)
                _loss(out, target).backward()
                want_out, want_dx, want_params, want_subs = _eager_twin(layers, x, target)
                # fp32 against fp64; a misplaced or stale tensor would be
                # off by far more.
                assert _rel(out, want_out) <= 1e-4, f"step {step}: output"
                assert _rel(x.grad, want_dx) <= 1e-4, f"step {step}: dx"
                for layer, wanted, sub in zip(layers, want_params, want_subs):
                    for name, p in wanted.items():
                        assert _rel(getattr(layer, name).grad, p.grad) <= 1e-3, \
                            f"step {step}: {layer.layer_name}.{name} gradient"
                    assert _rel(layer.sublayer.weight.grad, sub.weight.grad) <= 1e-4
                optimizer.step()
                regions = _host_regions(client)
                assert len(regions) == 1, \
                    f"step {step}: {[r.name for r in regions]} (one arena expected)"
            after = vars(mhc_torch.stats)
            assert after["arena_calls"] - before["arena_calls"] == 4 * len(layers) * steps
            assert after["inline_calls"] == before["inline_calls"]
            assert client.session.host_arena().growths >= 2, "the arena never grew"
            compute = _compute_sizes(client, seen)
            assert len(compute) == 4 * len(layers) * steps
            assert max(compute) <= MAX_REQUEST_BYTES, \
                "tensor bytes travelled inline"
            native_calls = after["native_calls"] - before["native_calls"]
            assert native_calls == (len(compute) if client.native else 0)
        finally:
            for layer in layers:
                layer.close()


def test_parameters_in_place_needs_a_cuda_layer(client):
    if client.server_info().has_cuda:
        pytest.skip("a CUDA daemon has no CPU layers")
    with pytest.raises(errors.FailedPrecondition):
        MhcLayer(client, 8, n=2, sublayer=nn.Tanh(), seed=1, device="cpu",
                 parameters_in_place=True)
    layer = MhcLayer(client, 8, n=2, sublayer=nn.Tanh(), seed=1, device="cpu")
    try:
        assert not layer.parameters_in_place
    finally:
        layer.close()


def test_shared_memory_refused_falls_back_inline(rng):
    from conftest import Daemon, _binary

    d = Daemon(_binary(), [])
    try:
        with Client(d.address) as client:
            layer = MhcLayer(client, 8, n=2, sublayer=nn.Tanh(), seed=2)
            try:
                before = mhc_torch.stats.inline_calls
                x = torch.randn(3, 2, 8, requires_grad=True)
                layer(x).sum().backward()
                assert mhc_torch.stats.inline_calls - before == 4
                assert x.grad is not None and layer.phi.grad is not None
            finally:
                layer.close()
    finally:
        d.stop()


def test_pre_over_one_gib_through_shared_memory(daemon):
    """x of 1.07 GiB (bf16) with the daemon's default 1 GiB inline limits."""
    tokens, n, hidden = 140_000, 4, 1024
    x_bytes = tokens * n * hidden * 2
    if shutil.disk_usage("/dev/shm").free < 3 * x_bytes:
        pytest.skip("not enough room in /dev/shm")
    with Client(daemon.address, timeout=300) as client:
        limits = client.server_info().limits
        assert x_bytes > limits["max_tensor_bytes"] and x_bytes > limits["max_request_bytes"]
        name = f"big-{id(client)}"
        client.create_layer(name, hidden, n=n, seed=5)
        try:
            # Distinct tokens (a repeated block with a per-token ramp), so a
            # misplaced offset shows.
            gen = torch.Generator().manual_seed(5)
            block = torch.randn(1024, n, hidden, generator=gen).to(torch.bfloat16)
            x = block.repeat(tokens // 1024 + 1, 1, 1)[:tokens]
            x[:, 0, 0] = (torch.arange(tokens) % 4093).to(torch.bfloat16) / 1024
            with torch.no_grad():
                y, h_pre, h_post, h_res = mhc_pre(client, name, x)
            assert y.shape == (tokens, hidden) and y.dtype == torch.bfloat16
            params = {k: torch.from_numpy(v).double()
                      for k, v in client.get_parameters(name).items()}
            spec = client.get_layer(name).spec
            # First, middle, past 1 GiB into x, last.
            picks = [0, tokens // 2, (1 << 30) // (n * hidden * 2) + 7, tokens - 1]
            want_y, _, want_post, want_res = eager.pre(x[picks].double(), params, spec)
            assert _rel(y[picks], want_y) <= 1e-2
            assert _rel(h_post[picks], want_post) <= 1e-4
            assert _rel(h_res[picks], want_res) <= 1e-4
            regions = _host_regions(client)
            assert len(regions) == 1 and regions[0].byte_size >= x_bytes
        finally:
            client.delete_layer(name)
