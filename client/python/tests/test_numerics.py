"""Every compute RPC against float64 autograd of mhc_client.eager, and that
reference against the daemon's float64 reference backend."""

from __future__ import annotations

from typing import Any, Dict, Iterator, Tuple

import numpy as np
import pytest
import torch

from conftest import Daemon, _binary
from mhc_client import Batch, Client, LayerSpec, Ref, eager, errors, tensors

FP32_TOL = 1e-5
LOW_TOL = 1e-2
# The reference backend computes in float64; only its fp32 outputs and
# fp32 gradient accumulators stand between it and the eager reference.
REFERENCE_TOL = 1e-6


def rel_error(got: Any, want: Any) -> float:
    """max |got - want| / max |want| (0 for empty tensors)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.size == 0:
        return 0.0
    scale = max(np.abs(want).max(), 1e-30)
    return float(np.abs(got - want).max() / scale)


def _float64(value: Any) -> Any:
    """numpy arrays (and dicts of them) as float64 tensors; others as given."""
    if isinstance(value, dict):
        return {k: _float64(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return torch.tensor(np.asarray(value, np.float64))
    return value


def oracle(fn: Any, *args: Any) -> Any:
    """eager `fn` in float64 on numpy arguments; numpy results."""
    out = fn(*(_float64(a) for a in args))
    return tuple(o.numpy() for o in out) if isinstance(out, tuple) else out.numpy()


def post_backward(dx_next: Any, f: Any, x: Any, h_post: Any, h_res: Any,
                  spec: LayerSpec, bias: Any = None) -> Tuple[np.ndarray, ...]:
    """(df, dx, dh_post, dh_res): float64 autograd of eager.post."""
    leaves = [torch.tensor(np.asarray(a, np.float64), requires_grad=True)
              for a in (f, x, h_post, h_res)]
    eager.post(*leaves, spec, _float64(bias)).backward(_float64(np.asarray(dx_next)))
    return tuple(leaf.grad.numpy() for leaf in leaves)


@pytest.fixture(scope="module")
def reference_client() -> Iterator[Client]:
    """A client of a daemon on the float64 reference backend, the oracle."""
    daemon = Daemon(_binary(), ["--backend=reference"])
    try:
        with Client(daemon.address, timeout=60) as client:
            client.wait_for_ready(30)
            yield client
    finally:
        daemon.stop()


def _x(rng: np.random.Generator, spec: LayerSpec, lead=(13,)) -> np.ndarray:
    shape = (spec.hidden, spec.n) if spec.layout == "stream_minor" else (spec.n, spec.hidden)
    return rng.standard_normal(tuple(lead) + shape).astype(np.float32)


def _params(client: Client, name: str) -> Dict[str, np.ndarray]:
    return {k: v.astype(np.float64) for k, v in client.get_parameters(name).items()}


def _random_parameters(rng: np.random.Generator, spec: LayerSpec) -> Dict[str, np.ndarray]:
    """Non-trivial parameters, so the mixing matrices are far from identity."""
    n, k = spec.n, spec.n * spec.hidden
    out = {"phi": rng.normal(0, 0.3, (2 * n + n * n, k)),
           "alpha": rng.uniform(0.5, 1.5, 3), "beta": rng.normal(0, 0.5, 2 * n + n * n)}
    if spec.has_gamma:
        out["gamma"] = rng.uniform(0.5, 1.5, k)
    if spec.has_post_bias:
        out["bias"] = rng.normal(0, 0.5, spec.hidden)
    return {key: v.astype(np.float32) for key, v in out.items()}


@pytest.mark.parametrize("preset", ["deepseek_v4", "tilekernels", "transformer_engine",
                                    "megatron", "liger"])
def test_pre_post_match_fp64_reference(client, layer_name, rng, preset):
    spec = client.create_layer(layer_name, 16, n=4, preset=preset, seed=1,
                               matmul_precision="ieee").spec
    client.set_parameters(layer_name, _random_parameters(rng, spec))
    params = _params(client, layer_name)
    x = _x(rng, spec, lead=(2, 7))
    y, h_pre, h_post, h_res = client.pre(layer_name, x)
    want = oracle(eager.pre, x, params, spec)
    for got, exp in zip((y, h_pre, h_post, h_res), want):
        assert got.shape == exp.shape and got.dtype == np.float32
        assert rel_error(got, exp) <= FP32_TOL
    np.testing.assert_allclose(h_res.sum(-2), 1.0, atol=1e-5)
    f = rng.standard_normal(y.shape).astype(np.float32)
    x_next = client.post(layer_name, f, x, h_post, h_res)
    assert rel_error(x_next, oracle(eager.post, f, x, h_post, h_res, spec)) <= FP32_TOL


@pytest.mark.parametrize("preset", ["deepseek_v4", "transformer_engine"])
def test_eager_matches_the_reference_backend(reference_client, layer_name, rng, preset):
    """The eager reference against the C++ float64 one, LINEAR and LOG, with
    gamma and bias: forward, then a layer's backward."""
    client = reference_client
    spec = client.create_layer(layer_name, 6, n=3, preset=preset, seed=2,
                               has_gamma=True, has_post_bias=True).spec
    client.set_parameters(layer_name, _random_parameters(rng, spec))
    params = _params(client, layer_name)
    x = _x(rng, spec)
    got = client.pre(layer_name, x)
    for a, b in zip(got, oracle(eager.pre, x, params, spec)):
        assert rel_error(a, b) <= REFERENCE_TOL
    f = rng.standard_normal(got.y.shape).astype(np.float32)
    x_next = client.post(layer_name, f, x, got.h_post, got.h_res)
    want = oracle(eager.post, f, x, got.h_post, got.h_res, spec, params["bias"])
    assert rel_error(x_next, want) <= REFERENCE_TOL
    client.delete_layer(layer_name)
    for name, (got_value, want_value) in _layer_backward(
            client, layer_name, rng, 13, "f32", preset).items():
        assert rel_error(got_value, want_value) <= REFERENCE_TOL, name


def test_log_sinkhorn_equals_linear_without_eps(rng):
    a = torch.tensor(rng.standard_normal((5, 4, 4)))
    lin = LayerSpec(hidden=1, n=4, sinkhorn_mode="linear", sinkhorn_iterations=30, eps_sk=0.0)
    log = LayerSpec(hidden=1, n=4, sinkhorn_mode="log", sinkhorn_iterations=30)
    np.testing.assert_allclose(eager.sinkhorn(a, lin).numpy(), eager.sinkhorn(a, log).numpy(),
                               atol=1e-12)


def _layer_backward(client: Client, layer_name: str, rng: np.random.Generator,
                    tokens: int, dtype: str, preset: str = "deepseek_v4"
                    ) -> Dict[str, Any]:
    """PostBackward(skip_dx) + PreBackward(dx_next) on a new layer, and float64
    autograd of the same chain on exactly the daemon's inputs: name -> (got,
    want) for df, dx and every parameter gradient."""
    spec = client.create_layer(layer_name, 24, n=4, preset=preset, seed=3, has_gamma=True,
                               has_post_bias=True, matmul_precision="ieee").spec
    client.set_parameters(layer_name, _random_parameters(rng, spec))
    params = _params(client, layer_name)
    x = tensors.round_to(_x(rng, spec, (tokens,)), dtype)
    dx_next = tensors.round_to(rng.standard_normal(x.shape), dtype)
    y, _, h_post, h_res = client.pre(layer_name, x, dtype=dtype)
    f = tensors.round_to(tensors.to_float32(y) * 0.5 + 0.25, dtype)
    pb = client.post_backward(layer_name, dx_next, f, x, h_post, h_res, skip_dx=True,
                              dtype=dtype)
    assert pb.dx is None
    dy = tensors.round_to(tensors.to_float32(pb.df) * 0.5, dtype)
    dx = client.pre_backward(layer_name, x, dy, pb.dh_post, pb.dh_res, dx_next=dx_next,
                             dtype=dtype)
    grads = client.get_gradients(layer_name)
    assert grads.tokens == tokens
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    ty, _, thp, thr = eager.pre(tx, tp, spec)
    tf = torch.tensor(tensors.to_float32(f), dtype=torch.float64, requires_grad=True)
    out = eager.post(tf, tx, thp, thr, spec, tp["bias"])
    ty_grad = torch.tensor(tensors.to_float32(dy), dtype=torch.float64)
    loss = (out * torch.tensor(dx_next, dtype=torch.float64)).sum() + (ty * ty_grad).sum()
    loss.backward()
    want_df = post_backward(dx_next, f, x, h_post, h_res, spec, params["bias"])[0]
    pairs = {"df": (tensors.to_float32(pb.df), want_df),
             "dx": (tensors.to_float32(dx), tx.grad.numpy())}
    for name in ("phi", "alpha", "beta", "gamma", "bias"):
        pairs["d" + name] = (grads[name], tp[name].grad.numpy())
    return pairs


@pytest.mark.parametrize("tokens", [0, 1, 13])
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_layer_backward_matches_autograd(client, layer_name, rng, tokens, dtype):
    """PostBackward(skip_dx) + PreBackward(dx_next) vs float64 autograd."""
    tol = FP32_TOL if dtype == "f32" else LOW_TOL
    grad_tol = 1e-4 if dtype == "f32" else LOW_TOL
    for name, (got, want) in _layer_backward(client, layer_name, rng, tokens, dtype).items():
        assert rel_error(got, want) <= (tol if name in ("df", "dx") else grad_tol), name


def test_pre_backward_from_the_kept_projection(client, layer_name, rng):
    """Pre's kept projection is what PreBackward recomputes: same dx bits."""
    spec = client.create_layer(layer_name, 24, n=4, seed=5, has_gamma=True).spec
    x = tensors.round_to(_x(rng, spec, (7,)), "bf16")
    plain = client.pre(layer_name, x, dtype="bf16")
    kept, projection = client.pre_keeping_projection(layer_name, x, dtype="bf16")
    assert np.array_equal(tensors.to_float32(kept.y), tensors.to_float32(plain.y))
    assert projection.h.shape == (7, spec.logits)
    assert projection.mean_square.shape == (7,)
    dy = tensors.round_to(rng.standard_normal((7, spec.hidden)), "bf16")
    dh_post = rng.standard_normal((7, 4)).astype(np.float32)
    dh_res = rng.standard_normal((7, 4, 4)).astype(np.float32)
    args = (layer_name, x, dy, dh_post, dh_res)
    recomputed = client.pre_backward(*args, dtype="bf16", skip_parameter_gradients=True)
    from_kept = client.pre_backward(*args, dtype="bf16", skip_parameter_gradients=True,
                                    projection=projection)
    assert np.array_equal(tensors.to_float32(from_kept), tensors.to_float32(recomputed))
    with pytest.raises(errors.InvalidArgument):
        client.pre_backward(*args, dtype="bf16", h=projection.h)


@pytest.mark.parametrize("preset", ["deepseek_v4", "megatron"])
def test_huge_fp32_activations_stay_finite(client, layer_name, rng, preset):
    """fp32 x up to 1e30, whose mean square (1e59) overflows fp32: pre and pre
    backward, recomputed and from the kept projection, are finite and within
    fp32 tolerance of float64 autograd, huge and normal tokens alike."""
    spec = client.create_layer(layer_name, 16, n=4, preset=preset, seed=6,
                               matmul_precision="ieee").spec
    client.set_parameters(layer_name, _random_parameters(rng, spec))
    params = _params(client, layer_name)
    x = _x(rng, spec, lead=(8,))
    x[::2] *= np.float32(1e30 / np.abs(x[::2]).max())
    kept, projection = client.pre_keeping_projection(layer_name, x)
    want = oracle(eager.pre, x, params, spec)
    for got, exp in zip(kept, want):
        assert np.isfinite(got).all()
        for tokens in (slice(0, None, 2), slice(1, None, 2)):
            assert rel_error(got[tokens], exp[tokens]) <= FP32_TOL
    assert np.isinf(projection.mean_square[::2]).all()  # 1e59 does not fit
    dy = rng.standard_normal((8, spec.hidden)).astype(np.float32)
    dh_post = rng.standard_normal((8, 4)).astype(np.float32)
    dh_res = rng.standard_normal((8, 4, 4)).astype(np.float32)
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    ty, _, thp, thr = eager.pre(tx, _float64(params), spec)
    loss = (ty * _float64(dy)).sum() + (thp * _float64(dh_post)).sum()
    (loss + (thr * _float64(dh_res)).sum()).backward()
    args = (layer_name, x, dy, dh_post, dh_res)
    for extra in ({}, {"projection": projection}):
        dx = client.pre_backward(*args, skip_parameter_gradients=True, **extra)
        assert np.isfinite(dx).all()
        for tokens in (slice(0, None, 2), slice(1, None, 2)):
            assert rel_error(dx[tokens], tx.grad.numpy()[tokens]) <= FP32_TOL


def test_post_backward_dx_and_dest_rows(client, layer_name, rng):
    spec = client.create_layer(layer_name, 9, n=3, preset="liger", seed=4).spec
    x = _x(rng, spec, (5,))
    y, _, h_post, h_res = client.pre(layer_name, x)
    dxn = rng.standard_normal(x.shape).astype(np.float32)
    pb = client.post_backward(layer_name, dxn, y, x, h_post, h_res)
    want = post_backward(dxn, y, x, h_post, h_res, spec)
    for got, exp in zip(pb, want):
        assert rel_error(got, exp) <= FP32_TOL


def test_single_kernels_compose_to_pre(client, layer_name, rng):
    spec = client.create_layer(layer_name, 32, n=4, preset="megatron", seed=5,
                               matmul_precision="ieee").spec
    client.set_parameters(layer_name, _random_parameters(rng, spec))
    params = _params(client, layer_name)
    x = _x(rng, spec, (3, 4))
    h, ms = client.projection(layer_name, x)
    want_h, want_ms = oracle(eager.projection, x, params, spec)
    assert rel_error(h, want_h) <= FP32_TOL and rel_error(ms, want_ms) <= FP32_TOL
    sc = client.scale(layer_name, h=h, mean_square=ms)
    h_res = client.sinkhorn(layer_name, sc.logits)
    y = client.aggregate(layer_name, x, sc.h_pre)
    want = oracle(eager.pre, x, params, spec)
    assert rel_error(y, want[0]) <= FP32_TOL
    assert rel_error(h_res, want[3]) <= FP32_TOL
    # Sinkhorn backward against autograd of the eager Sinkhorn.
    dh_res = rng.standard_normal(h_res.shape).astype(np.float32)
    dlogits = client.sinkhorn_backward(layer_name, sc.logits, dh_res)
    a = torch.tensor(sc.logits, dtype=torch.float64, requires_grad=True)
    eager.sinkhorn(a, spec).backward(torch.tensor(dh_res, dtype=torch.float64))
    assert rel_error(dlogits, a.grad.numpy()) <= 1e-4
    ab = client.aggregate_backward(layer_name, x, sc.h_pre, y)
    assert rel_error(ab.dh_pre, np.einsum("...c,...ic->...i", y, x)) <= FP32_TOL


def test_expand_and_head(client, layer_name, rng):
    spec = client.create_layer(layer_name, 7, n=4, kind="head", seed=6,
                               matmul_precision="ieee").spec
    params = _params(client, layer_name)
    assert params["phi"].shape == (4, 28) and params["alpha"].shape == (1,)
    x = _x(rng, spec, (6,))
    y, mix = client.head(layer_name, x)
    want_y, want_mix = oracle(eager.head, x, params, spec)
    assert rel_error(y, want_y) <= FP32_TOL and rel_error(mix, want_mix) <= FP32_TOL
    dx = client.head_backward(layer_name, x, y)
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    eager.head(tx, tp, spec)[0].backward(torch.tensor(y, dtype=torch.float64))
    assert rel_error(dx, tx.grad.numpy()) <= FP32_TOL
    client.delete_layer(layer_name)
    spec = client.create_layer(layer_name, 7, n=4, seed=6).spec
    e = rng.standard_normal((6, 7)).astype(np.float32)
    xe = client.expand(layer_name, e)
    np.testing.assert_array_equal(xe, oracle(eager.expand, e, spec).astype(np.float32))
    np.testing.assert_allclose(client.expand_backward(layer_name, xe), 4 * e, rtol=1e-6)


def test_wide_odd_hidden_and_static_layer(client, layer_name, rng):
    spec = client.create_layer(layer_name, 5129, n=4, seed=7, matmul_precision="ieee").spec
    x = _x(rng, spec, (2,))
    params = _params(client, layer_name)
    got = client.pre(layer_name, x)
    for a, b in zip(got, oracle(eager.pre, x, params, spec)):
        assert rel_error(a, b) <= FP32_TOL
    client.delete_layer(layer_name)
    spec = client.create_layer(layer_name, 1, n=2, seed=7, dynamic=False).spec
    assert set(client.get_parameters(layer_name)) == {"beta"}
    x = _x(rng, spec, (3,))
    got = client.pre(layer_name, x)
    for a, b in zip(got, oracle(eager.pre, x, _params(client, layer_name), spec)):
        assert rel_error(a, b) <= FP32_TOL


def test_execute_batch_matches_single_calls(client, layer_name, rng):
    spec = client.create_layer(layer_name, 16, n=4, seed=8).spec
    x = _x(rng, spec, (5,))
    f = rng.standard_normal((5, 16)).astype(np.float32)
    batch = (Batch()
             .add("p", "pre", layer=layer_name, x=x)
             .add("q", "post", layer=layer_name, f=f, x=x, h_post=Ref("p.h_post"),
                  h_res=Ref("p.h_res")))
    out = client.execute(batch, fetch=["p.y", "q.x_next"])
    assert set(out) == {"p.y", "q.x_next"}
    y, _, h_post, h_res = client.pre(layer_name, x)
    np.testing.assert_array_equal(out["p.y"], y)
    np.testing.assert_array_equal(out["q.x_next"], client.post(layer_name, f, x, h_post, h_res))
    streamed = client.execute_stream([batch, batch], fetch=["q.x_next"])
    assert len(streamed) == 2
    np.testing.assert_array_equal(streamed[1]["q.x_next"], out["q.x_next"])


def test_bf16_wire_format_round_trips(rng):
    values = rng.standard_normal(1000).astype(np.float32)
    values[:3] = [np.inf, -np.inf, np.nan]
    bits = tensors.bf16_from_float32(values)
    back = tensors.bf16_to_float32(bits)
    assert np.isnan(back[2]) and np.isinf(back[0]) and back[1] < 0
    finite = np.isfinite(values)
    # Round to nearest: within half a bf16 ulp (2^-8 relative).
    assert np.all(np.abs(back[finite] - values[finite]) <= np.abs(values[finite]) * 2 ** -8)
    # Ties go to even: 1 + 2^-8 is exactly between 1 and 1 + 2^-7.
    assert tensors.bf16_to_float32(tensors.bf16_from_float32(np.float32(1 + 2 ** -8)))[()] == 1.0
    ref_ = tensors.to_tensor_ref(values, "bf16")
    np.testing.assert_array_equal(tensors.to_float32(tensors.from_tensor_ref(ref_, "uint16")),
                                  back)
