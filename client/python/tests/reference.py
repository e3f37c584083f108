"""mHC forward in float64 numpy, written from the math for the tests.

Kept separate from mhc_client.eager (torch) on purpose: the two are
checked against each other, and the daemon against both.
"""

from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from mhc_client import LayerSpec


def _major(x: np.ndarray, spec: LayerSpec) -> np.ndarray:
    return np.swapaxes(x, -1, -2) if spec.layout == "stream_minor" else x


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def sinkhorn(a: np.ndarray, spec: LayerSpec) -> np.ndarray:
    a = np.asarray(a, np.float64)
    t = spec.sinkhorn_iterations
    if spec.sinkhorn_mode == "log":
        f = np.zeros(a.shape[:-1])
        g = np.zeros(a.shape[:-2] + a.shape[-1:])
        for _ in range(t):
            s = a + g[..., None, :]
            m = s.max(-1, keepdims=True)
            f = -(m[..., 0] + np.log(np.exp(s - m).sum(-1)))
            s = a + f[..., :, None]
            m = s.max(-2, keepdims=True)
            g = -(m[..., 0, :] + np.log(np.exp(s - m).sum(-2)))
        return np.exp(f[..., :, None] + a + g[..., None, :])
    eps = spec.eps_sk
    e = np.exp(a - a.max(-1, keepdims=True))
    p = e / e.sum(-1, keepdims=True) + eps
    p = p / (p.sum(-2, keepdims=True) + eps)
    for _ in range(t - 1):
        p = p / (p.sum(-1, keepdims=True) + eps)
        p = p / (p.sum(-2, keepdims=True) + eps)
    return p


def projection(x: np.ndarray, params: Dict[str, np.ndarray], spec: LayerSpec
               ) -> Tuple[np.ndarray, np.ndarray]:
    """(h, mean_square) with gamma folded into phi."""
    v = np.asarray(x, np.float64).reshape(x.shape[:-2] + (x.shape[-1] * x.shape[-2],))
    phi = params["phi"].astype(np.float64)
    if spec.has_gamma:
        phi = phi * params["gamma"].astype(np.float64)[None, :]
    return v @ phi.T, (v * v).mean(-1)


def logits(x: np.ndarray, params: Dict[str, np.ndarray], spec: LayerSpec
           ) -> np.ndarray:
    n = spec.n
    beta = params["beta"].astype(np.float64)
    if spec.dynamic is False:
        return np.broadcast_to(beta, x.shape[:-2] + beta.shape).copy()
    h, ms = projection(x, params, spec)
    if spec.eps_placement == "outside":
        r = 1.0 / (np.sqrt(ms) + spec.eps_rms)
    else:
        r = 1.0 / np.sqrt(ms + spec.eps_rms)
    alpha = params["alpha"].astype(np.float64)
    if spec.kind == "head":
        gate = np.full(h.shape[-1], alpha[0])
    else:
        gate = np.concatenate([np.full(n, alpha[0]), np.full(n, alpha[1]),
                               np.full(n * n, alpha[2])])
    return gate * h * r[..., None] + beta


def pre(x: np.ndarray, params: Dict[str, np.ndarray], spec: LayerSpec
        ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    n = spec.n
    z = logits(x, params, spec)
    h_pre = sigmoid(z[..., :n]) + spec.eps_pre
    h_post = spec.post_mult * sigmoid(z[..., n:2 * n])
    h_res = sinkhorn(z[..., 2 * n:].reshape(z.shape[:-1] + (n, n)), spec)
    xs = _major(np.asarray(x, np.float64), spec)
    y = np.einsum("...i,...ic->...c", h_pre, xs)
    return y, h_pre, h_post, h_res


def post(f: np.ndarray, x: np.ndarray, h_post: np.ndarray, h_res: np.ndarray,
         spec: LayerSpec, bias: np.ndarray = None) -> np.ndarray:
    r = np.asarray(h_res, np.float64)
    if spec.orientation == "dest_rows":
        r = np.swapaxes(r, -1, -2)
    fb = np.asarray(f, np.float64) + (0.0 if bias is None else bias)
    xs = _major(np.asarray(x, np.float64), spec)
    out = h_post[..., :, None] * fb[..., None, :] + np.einsum("...ij,...ic->...jc", r, xs)
    return _major(out, spec)


def post_backward(dx_next: np.ndarray, f: np.ndarray, x: np.ndarray,
                  h_post: np.ndarray, h_res: np.ndarray, spec: LayerSpec,
                  bias: np.ndarray = None):
    """(df, dx, dh_post, dh_res) per docs/SPEC.md section 4."""
    d = _major(np.asarray(dx_next, np.float64), spec)
    xs = _major(np.asarray(x, np.float64), spec)
    r = np.asarray(h_res, np.float64)
    fb = np.asarray(f, np.float64) + (0.0 if bias is None else bias)
    df = np.einsum("...j,...jc->...c", h_post, d)
    dh_post = np.einsum("...jc,...c->...j", d, fb)
    dr = np.einsum("...ic,...jc->...ij", xs, d)
    if spec.orientation == "dest_rows":
        dx = np.einsum("...ji,...jc->...ic", r, d)
        dh_res = np.swapaxes(dr, -1, -2)
    else:
        dx = np.einsum("...ij,...jc->...ic", r, d)
        dh_res = dr
    return df, _major(dx, spec), dh_post, dh_res


def expand(e: np.ndarray, spec: LayerSpec) -> np.ndarray:
    xs = np.repeat(np.asarray(e, np.float64)[..., None, :], spec.n, axis=-2)
    return _major(xs, spec)


def head(x: np.ndarray, params: Dict[str, np.ndarray], spec: LayerSpec):
    mix = sigmoid(logits(x, params, spec)) + spec.eps_pre
    y = np.einsum("...i,...ic->...c", mix, _major(np.asarray(x, np.float64), spec))
    return y, mix


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| (0 for empty tensors)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.size == 0:
        return 0.0
    scale = max(np.abs(want).max(), 1e-30)
    return float(np.abs(got - want).max() / scale)
