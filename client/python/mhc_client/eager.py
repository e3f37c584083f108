"""mHC in plain PyTorch, differentiated by torch autograd.

The one Python copy of the layer's math, written for clarity. Run in
float64 it is the oracle of the Python tests (the daemon's outputs and
gradients are checked against it, and it against the daemon's float64
reference backend); the benchmarks time it as the eager baseline; and it
is an eager twin to compare training runs with. Layer semantics come from a
:class:`~mhc_client.spec.LayerSpec` as the daemon reports it
(``client.get_layer(name).spec``); fields left None take the default
preset's values, so presets need not be repeated here.
"""

from __future__ import annotations

from typing import Mapping, Optional, Tuple

import torch

from .spec import LayerSpec

Params = Mapping[str, torch.Tensor]


def _streams_major(x: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """x as [..., n, C] whatever the layout, and back (a transpose)."""
    return x.transpose(-1, -2) if spec.layout == "stream_minor" else x


def projection(x: torch.Tensor, params: Params, spec: LayerSpec
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(h, mean_square) of x [..., n, C]: h = phi v with gamma folded into
    phi, v the token's n*C values in memory order."""
    v = x.reshape(*x.shape[:-2], x.shape[-1] * x.shape[-2])
    phi = params["phi"]
    if spec.has_gamma:
        phi = phi * params["gamma"][None, :]
    return v @ phi.t(), (v * v).mean(-1)


def sinkhorn(logits: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """H_res from raw logits A [..., n, n]."""
    spec = spec.resolved()
    if spec.sinkhorn_mode == "log":
        f = torch.zeros_like(logits[..., :, 0])
        g = torch.zeros_like(logits[..., 0, :])
        for _ in range(spec.sinkhorn_iterations):
            f = -torch.logsumexp(logits + g[..., None, :], dim=-1)
            g = -torch.logsumexp(logits + f[..., :, None], dim=-2)
        return torch.exp(f[..., :, None] + logits + g[..., None, :])
    eps = spec.eps_sk
    p = torch.softmax(logits, dim=-1) + eps
    p = p / (p.sum(dim=-2, keepdim=True) + eps)
    for _ in range(spec.sinkhorn_iterations - 1):
        p = p / (p.sum(dim=-1, keepdim=True) + eps)
        p = p / (p.sum(dim=-2, keepdim=True) + eps)
    return p


def logits(x: torch.Tensor, params: Params, spec: LayerSpec) -> torch.Tensor:
    """z [..., N]: alpha * (phi' v) * r + beta, or beta for static layers."""
    spec = spec.resolved()
    n = spec.n
    beta = params["beta"]
    if not spec.dynamic:
        return beta.expand(*x.shape[:-2], beta.shape[0])
    h, mean_square = projection(x, params, spec)
    if spec.eps_placement == "outside":
        r = 1.0 / (torch.sqrt(mean_square) + spec.eps_rms)
    else:
        r = torch.rsqrt(mean_square + spec.eps_rms)
    alpha = params["alpha"]
    if spec.kind == "head":
        gate = alpha[0].expand(h.shape[-1])
    else:
        gate = torch.cat([alpha[0].expand(n), alpha[1].expand(n),
                          alpha[2].expand(n * n)])
    return gate * h * r[..., None] + beta


def pre(x: torch.Tensor, params: Params, spec: LayerSpec
        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, H_pre, H_post, H_res) of x [..., n, C] (or [..., C, n])."""
    spec = spec.resolved()
    n = spec.n
    z = logits(x, params, spec)
    h_pre = torch.sigmoid(z[..., :n]) + spec.eps_pre
    h_post = spec.post_mult * torch.sigmoid(z[..., n:2 * n])
    h_res = sinkhorn(z[..., 2 * n:].reshape(*z.shape[:-1], n, n), spec)
    y = (h_pre[..., :, None] * _streams_major(x, spec)).sum(dim=-2)
    return y, h_pre, h_post, h_res


def post(f: torch.Tensor, x: torch.Tensor, h_post: torch.Tensor,
         h_res: torch.Tensor, spec: LayerSpec,
         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x_next[j] = H_post[j] (f + bias) + sum_i R[i, j] x[i]."""
    spec = spec.resolved()
    r = h_res.transpose(-1, -2) if spec.orientation == "dest_rows" else h_res
    fb = f + bias if bias is not None else f
    mixed = torch.einsum("...ij,...ic->...jc", r, _streams_major(x, spec))
    return _streams_major(h_post[..., :, None] * fb[..., None, :] + mixed, spec)


def expand(e: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """e [..., C] copied into n streams."""
    xs = e[..., None, :].expand(*e.shape[:-1], spec.n, e.shape[-1])
    return _streams_major(xs, spec.resolved()).contiguous()


def head(x: torch.Tensor, params: Params, spec: LayerSpec
         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(y, mix) of a HEAD layer: y = sum_i mix_i x_i."""
    spec = spec.resolved()
    mix = torch.sigmoid(logits(x, params, spec)) + spec.eps_pre
    y = (mix[..., :, None] * _streams_major(x, spec)).sum(dim=-2)
    return y, mix


def layer(x: torch.Tensor, params: Params, spec: LayerSpec,
          sublayer: torch.nn.Module,
          compute_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """One whole mHC layer around `sublayer`: pre -> F -> post. With
    `compute_dtype` (float32 for bf16 activations, say) the mixing runs in
    it while F's input and the output keep x's dtype, as the daemon's."""
    xc = x if compute_dtype is None else x.to(compute_dtype)
    y, _, h_post, h_res = pre(xc, params, spec)
    f = sublayer(y.to(x.dtype)).to(xc.dtype)
    bias = params.get("bias") if spec.has_post_bias else None
    return post(f, xc, h_post, h_res, spec, bias).to(x.dtype)
