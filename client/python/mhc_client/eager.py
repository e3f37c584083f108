"""mHC in plain PyTorch, differentiated by torch autograd.

The same math as the daemon, written for clarity: a reference for tests
(run in float64 it is the oracle the daemon's gradients are checked
against), and an eager baseline to compare training runs with. Layer
semantics come from a :class:`~mhc_client.spec.LayerSpec` as the daemon
reports it (``client.get_layer(name).spec``), so presets need not be
duplicated here.
"""

from __future__ import annotations

from typing import Mapping, Optional, Tuple

import torch

from .spec import LayerSpec

Params = Mapping[str, torch.Tensor]


def _streams_major(x: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """x as [..., n, C] whatever the layout."""
    return x.transpose(-1, -2) if spec.layout == "stream_minor" else x


def _from_major(xs: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    return xs.transpose(-1, -2) if spec.layout == "stream_minor" else xs


def _rms_scale(v: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    ms = (v * v).mean(-1)
    eps = spec.eps_rms if spec.eps_rms is not None else 1e-6
    if spec.eps_placement == "outside":
        return 1.0 / (torch.sqrt(ms) + eps)
    return torch.rsqrt(ms + eps)


def _effective_phi(params: Params, spec: LayerSpec) -> torch.Tensor:
    phi = params["phi"]
    return phi * params["gamma"][None, :] if spec.has_gamma else phi


def sinkhorn(logits: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """H_res from raw logits A [..., n, n] (docs/SPEC.md section 3)."""
    iterations = spec.sinkhorn_iterations or 20
    if spec.sinkhorn_mode == "log":
        f = torch.zeros_like(logits[..., :, 0])
        g = torch.zeros_like(logits[..., 0, :])
        for _ in range(iterations):
            f = -torch.logsumexp(logits + g[..., None, :], dim=-1)
            g = -torch.logsumexp(logits + f[..., :, None], dim=-2)
        return torch.exp(f[..., :, None] + logits + g[..., None, :])
    eps = spec.eps_sk if spec.eps_sk is not None else 1e-6
    p = torch.softmax(logits, dim=-1) + eps
    p = p / (p.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        p = p / (p.sum(dim=-1, keepdim=True) + eps)
        p = p / (p.sum(dim=-2, keepdim=True) + eps)
    return p


def logits(x: torch.Tensor, params: Params, spec: LayerSpec) -> torch.Tensor:
    """z [..., N]: alpha * (phi' v) * r + beta, or beta for static layers."""
    n = spec.n
    lead = x.shape[:-2]
    beta = params["beta"]
    if spec.dynamic is False:
        return beta.expand(*lead, beta.shape[0])
    v = x.reshape(*lead, x.shape[-1] * x.shape[-2])
    h = v @ _effective_phi(params, spec).t()
    r = _rms_scale(v, spec)
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
    n = spec.n
    eps_pre = spec.eps_pre if spec.eps_pre is not None else 1e-6
    post_mult = spec.post_mult if spec.post_mult is not None else 2.0
    z = logits(x, params, spec)
    h_pre = torch.sigmoid(z[..., :n]) + eps_pre
    h_post = post_mult * torch.sigmoid(z[..., n:2 * n])
    h_res = sinkhorn(z[..., 2 * n:].reshape(*z.shape[:-1], n, n), spec)
    y = (h_pre[..., :, None] * _streams_major(x, spec)).sum(dim=-2)
    return y, h_pre, h_post, h_res


def post(f: torch.Tensor, x: torch.Tensor, h_post: torch.Tensor,
         h_res: torch.Tensor, spec: LayerSpec,
         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x_next[j] = H_post[j] (f + bias) + sum_i R[i, j] x[i]."""
    r = h_res.transpose(-1, -2) if spec.orientation == "dest_rows" else h_res
    fb = f + bias if bias is not None else f
    xs = _streams_major(x, spec)
    mixed = torch.einsum("...ij,...ic->...jc", r, xs)
    return _from_major(h_post[..., :, None] * fb[..., None, :] + mixed, spec)


def expand(e: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """e [..., C] copied into n streams."""
    xs = e[..., None, :].expand(*e.shape[:-1], spec.n, e.shape[-1])
    return _from_major(xs, spec).contiguous()


def head(x: torch.Tensor, params: Params, spec: LayerSpec
         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(y, mix) of a HEAD layer: y = sum_i mix_i x_i."""
    eps_pre = spec.eps_pre if spec.eps_pre is not None else 1e-6
    mix = torch.sigmoid(logits(x, params, spec)) + eps_pre
    y = (mix[..., :, None] * _streams_major(x, spec)).sum(dim=-2)
    return y, mix


def layer(x: torch.Tensor, params: Params, spec: LayerSpec,
          sublayer: torch.nn.Module) -> torch.Tensor:
    """One whole mHC layer around `sublayer`: pre -> F -> post."""
    y, _, h_post, h_res = pre(x, params, spec)
    f = sublayer(y)
    bias = params.get("bias") if spec.has_post_bias else None
    return post(f, x, h_post, h_res, spec, bias)
