"""mhc_client.torch on CPU tensors against float64 autograd of mhc_client.eager."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from mhc_client import eager, shm
from mhc_client.torch import MhcLayer, mhc_post, mhc_pre

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _twin_grads(layer: MhcLayer, x: torch.Tensor, sub: nn.Module, upstream: torch.Tensor):
    params = {k: getattr(layer, k).detach().cpu().double().requires_grad_()
              for k in layer.param_names}
    sub64 = nn.Linear(sub.in_features, sub.out_features).double()
    sub64.load_state_dict({k: v.double() for k, v in sub.state_dict().items()})
    x64 = x.detach().double().requires_grad_()
    out = eager.layer(x64, params, layer.spec, sub64)
    (out * upstream.double()).sum().backward()
    return out, x64.grad, {k: p.grad for k, p in params.items()}, sub64.weight.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("preset,extra", [("deepseek_v4", {}),
                                          ("transformer_engine", {"has_gamma": True}),
                                          ("liger", {"has_post_bias": True})])
def test_layer_gradients_match_eager_autograd(client, preset, extra):
    torch.manual_seed(0)
    sub = nn.Linear(12, 12)
    layer = MhcLayer(client, 12, n=4, sublayer=sub, preset=preset, seed=1,
                     matmul_precision="ieee", **extra)
    try:
        with torch.no_grad():  # move away from the near-identity init
            layer.phi.normal_(0, 0.2)
            layer.alpha.uniform_(0.5, 1.5)
        x_shape = (3, 5) + ((12, 4) if layer.spec.layout == "stream_minor" else (4, 12))
        x = torch.randn(x_shape, requires_grad=True)
        upstream = torch.randn(x_shape)
        out = layer(x)
        (out * upstream).sum().backward()
        want_out, want_dx, want_params, want_sub = _twin_grads(layer, x, sub, upstream)
        assert _rel(out, want_out) <= 1e-5
        assert _rel(x.grad, want_dx) <= 1e-5
        for name, grad in want_params.items():
            assert _rel(getattr(layer, name).grad.cpu(), grad) <= 1e-4, name
        assert _rel(sub.weight.grad, want_sub) <= 1e-5
        if not layer.parameters_in_place:
            # The daemon's accumulators were handed over and zeroed.
            assert client.get_gradients(layer.layer_name).tokens == 0
    finally:
        layer.close()


def test_optimizer_step_reaches_the_daemon(client):
    # Mirror mode (a local CUDA daemon would keep the parameters in place:
    # test_torch_cuda.py).
    layer = MhcLayer(client, 8, n=2, sublayer=nn.Tanh(), seed=2,
                     parameters_in_place=False)
    try:
        opt = torch.optim.SGD(layer.parameters(), lr=0.5)
        x = torch.randn(4, 2, 8)
        layer(x).square().sum().backward()
        assert layer.phi.grad is not None and layer.phi.grad.abs().sum() > 0
        opt.step()
        version = client.get_layer(layer.layer_name).parameters_version
        layer(x)  # pushes the changed parameters first
        assert client.get_layer(layer.layer_name).parameters_version > version
        np.testing.assert_array_equal(client.get_parameters(layer.layer_name)["phi"],
                                      layer.phi.detach().numpy())
        layer(x)  # unchanged: nothing is pushed
        assert client.get_layer(layer.layer_name).parameters_version == version + 1
    finally:
        layer.close()


def test_manual_gradient_sync_accumulates_micro_batches(client):
    torch.manual_seed(1)
    auto = MhcLayer(client, 8, n=4, sublayer=nn.Tanh(), seed=3,
                    parameters_in_place=False)
    manual = MhcLayer(client, 8, n=4, sublayer=nn.Tanh(), seed=3, sync_gradients=False,
                      parameters_in_place=False)
    try:
        xs = [torch.randn(3, 4, 8) for _ in range(2)]
        for layer in (auto, manual):
            for x in xs:
                layer(x).sum().backward()
        assert manual.phi.grad is None
        assert client.get_gradients(manual.layer_name).tokens == 6
        manual.pull_grads()
        for name in auto.param_names:
            torch.testing.assert_close(getattr(manual, name).grad, getattr(auto, name).grad,
                                       rtol=1e-5, atol=1e-7)
    finally:
        auto.close()
        manual.close()


def test_standalone_functions_and_bf16(client, layer_name):
    client.create_layer(layer_name, 16, n=4, seed=4)
    x = torch.randn(5, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    y, h_pre, h_post, h_res = mhc_pre(client, layer_name, x)
    assert y.dtype == torch.bfloat16 and h_res.dtype == torch.float32
    assert not h_pre.requires_grad
    out = mhc_post(client, layer_name, torch.tanh(y), x, h_post, h_res)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    out.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    # Against float64 eager on the same (bf16-rounded) input.
    params = {k: torch.from_numpy(v).double()
              for k, v in client.get_parameters(layer_name).items()}
    spec = client.get_layer(layer_name).spec
    x64 = x.detach().double().requires_grad_()
    y64, _, hp64, hr64 = eager.pre(x64, params, spec)
    eager.post(torch.tanh(y64), x64, hp64, hr64, spec).sum().backward()
    assert _rel(x.grad, x64.grad) <= 2e-2
    assert client.get_gradients(layer_name).tokens == 5


def test_train_tiny_example_follows_eager(client):
    sys.path.insert(0, str(EXAMPLES))
    try:
        import train_tiny
    finally:
        sys.path.remove(str(EXAMPLES))
    curves = train_tiny.train(client, steps=50)
    first = sum(curves["mhcd"][:5]) / 5
    last = sum(curves["mhcd"][-10:]) / 10
    assert last < 0.5 * first
    gaps = [abs(a - b) / b for a, b in zip(curves["mhcd"], curves["eager"])]
    assert max(gaps) <= 1e-3


def test_default_names_outlive_a_reused_pid(client, monkeypatch):
    # A later process of this pid counts its names from the start again; the
    # random part of the default name keeps it off the earlier one's layer.
    monkeypatch.setattr(shm, "_counter", itertools.count())
    earlier = MhcLayer(client, 8, n=2, sublayer=nn.Tanh(), seed=1)
    try:
        monkeypatch.setattr(shm, "_counter", itertools.count())
        monkeypatch.setattr(shm, "_NONCE", "0" * 8 if shm._NONCE != "0" * 8 else "1" * 8)
        later = MhcLayer(client, 8, n=2, sublayer=nn.Tanh(), seed=1)
        try:
            assert later.layer_name != earlier.layer_name
            assert later.layer_name.startswith("torch-")
        finally:
            later.close()
    finally:
        earlier.close()
