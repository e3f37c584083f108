"""PyTorch integration: an mHC layer whose forward and backward run in mhcd.

    layer = MhcLayer(client, hidden=256, n=4, sublayer=ffn)
    x_next = layer(x)              # Pre -> sublayer (here) -> Post
    loss.backward()                # PostBackward -> sublayer -> PreBackward
    optimizer.step()               # updates layer.phi/alpha/beta locally

Parameters. The daemon holds the layer's parameters and accumulates their
gradients. The module mirrors them as ``nn.Parameter`` (phi, alpha, beta,
and gamma / bias when the spec has them), so optimizers, clipping and state
dicts work as usual:

* gradients: the layer's last backward step (PreBackward) fetches the
  daemon's accumulated gradients, zeroes the accumulators and returns them
  as the parameters' gradients, so they land in ``.grad`` like any other
  module's (``sync_gradients=False`` leaves them in the daemon instead:
  call :meth:`MhcLayer.pull_grads` before the optimizer step, which saves
  two RPCs per backward when accumulating many micro-batches);
* updates: before each forward the module pushes parameters that changed
  locally (an optimizer step, ``load_state_dict``) with SetParameters;
  :meth:`MhcLayer.push_parameters` does it explicitly.

Transport. CPU tensors go inline. CUDA tensors go by CUDA IPC (zero copy:
inputs and outputs stay in this process's device memory and the daemon
reads and writes them in place) when the daemon is on this node (unix
socket) and serves a CUDA device; otherwise they are copied to the host and
sent inline. ``transport="inline"`` / ``"ipc"`` forces one.

Backward fusion. As in the canonical sequence (PostBackward with skip_dx,
then PreBackward with dx_next), the layer hands the post's upstream
gradient to PreBackward so the layer's dx is accumulated in fp32 and
rounded once; the standalone functions :func:`mhc_pre` / :func:`mhc_post`
compute their own dx each.
"""

from __future__ import annotations

import itertools
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from . import errors, tensors
from .client import Client
from .spec import LayerInfo, LayerSpec

_names = itertools.count()
_TORCH_CODES = {torch.float32: tensors.F32, torch.float16: tensors.F16,
                torch.bfloat16: tensors.BF16}


# ------------------------------------------------------------- conversion


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A host numpy copy with the tensor's wire bytes (bf16 as uint16)."""
    t = t.detach()
    if t.dtype not in _TORCH_CODES:
        raise errors.InvalidArgument(f"unsupported tensor dtype {t.dtype}")
    t = t.contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_numpy(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """The inverse of :func:`to_numpy` (uint16 / ml_dtypes bf16 -> bfloat16)."""
    if a.dtype == np.uint16 or (tensors.BFLOAT16 is not None
                                and a.dtype == tensors.BFLOAT16):
        t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.ascontiguousarray(a))
    return t.to(device)


class _Transport:
    """Moves one op's tensors to the daemon and its outputs back."""

    def __init__(self, client: Client, mode: str) -> None:
        if mode not in ("auto", "inline", "ipc"):
            raise errors.InvalidArgument("transport: auto, inline or ipc")
        self.client = client
        self.mode = mode
        self._ipc: Optional[bool] = None if mode == "auto" else mode == "ipc"

    def use_ipc(self, t: torch.Tensor) -> bool:
        if not t.is_cuda:
            return False
        if self._ipc is None:
            self._ipc = self.client.is_local and self.client.server_info().has_cuda
        return self._ipc

    def run(self, kind: str, layer: str, inputs: Dict[str, Optional[torch.Tensor]],
            outputs: Dict[str, Tuple[Sequence[int], torch.dtype]],
            **flags: Any) -> Dict[str, torch.Tensor]:
        """Runs `kind`; `outputs` gives each wanted output's shape/dtype."""
        first = next(t for t in inputs.values() if t is not None)
        device = first.device
        if self.use_ipc(first):
            session = self.client.open_session()
            refs = {k: session.cuda_tensor_ref(v.detach().contiguous())
                    for k, v in inputs.items() if v is not None}
            out = {k: torch.empty(tuple(shape), dtype=dtype, device=device)
                   for k, (shape, dtype) in outputs.items()}
            regions = {k: session.cuda_output_ref(v) for k, v in out.items()}
            torch.cuda.current_stream(device).synchronize()
            self.client.compute(kind, layer, out=regions, **refs, **flags)
            return out
        arrays = {k: to_numpy(v) for k, v in inputs.items() if v is not None}
        result = self.client.compute(kind, layer, **arrays, **flags)
        return {k: from_numpy(result[k], device) for k in outputs if k in result}


# --------------------------------------------------------------- functions


class _Link:
    """Carries the post's dx_next to the same layer's PreBackward."""

    def __init__(self) -> None:
        self.dx_next: Optional[torch.Tensor] = None


def _lead(x: torch.Tensor) -> Tuple[int, ...]:
    return tuple(x.shape[:-2])


class _PreFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, owner: "_Owner",  # type: ignore[override]
                link: Optional[_Link], *params: torch.Tensor
                ) -> Tuple[torch.Tensor, ...]:
        owner.sync_before_forward()
        n, lead = owner.spec.n, _lead(x)
        c = owner.spec.hidden
        wanted = {"y": (lead + (c,), x.dtype),
                  "h_pre": (lead + (n,), torch.float32),
                  "h_post": (lead + (n,), torch.float32),
                  "h_res": (lead + (n, n), torch.float32)}
        # A dynamic layer keeps its projection (N + 1 floats per token) so
        # the backward does not read x once more to recompute it.
        keep = bool(owner.spec.dynamic)
        if keep:
            wanted["h"] = (lead + (owner.spec.logits,), torch.float32)
            wanted["mean_square"] = (lead, torch.float32)
        out = owner.transport.run("pre", owner.name, {"x": x}, wanted,
                                  keep_projection=keep)
        ctx.owner, ctx.link, ctx.n_params = owner, link, len(params)
        if keep:
            ctx.save_for_backward(x, out["h"], out["mean_square"])
        else:
            ctx.save_for_backward(x)
        ctx.mark_non_differentiable(out["h_pre"])
        return out["y"], out["h_pre"], out["h_post"], out["h_res"]

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, _dh_pre: torch.Tensor,  # type: ignore[override]
                 dh_post: torch.Tensor, dh_res: torch.Tensor
                 ) -> Tuple[Optional[torch.Tensor], ...]:
        x, *projection = ctx.saved_tensors
        owner: _Owner = ctx.owner
        dx_next = None
        if ctx.link is not None:
            dx_next, ctx.link.dx_next = ctx.link.dx_next, None
        inputs = {"x": x, "dy": dy.to(x.dtype).contiguous(),
                  "dh_post": dh_post.float().contiguous(),
                  "dh_res": dh_res.float().contiguous(),
                  "dx_next": None if dx_next is None else dx_next.contiguous()}
        if projection:
            inputs["h"], inputs["mean_square"] = projection
        dx = owner.transport.run("pre_backward", owner.name, inputs,
                                 {"dx": (tuple(x.shape), x.dtype)})["dx"]
        grads = owner.take_gradients() if ctx.n_params else []
        return (dx, None, None, *grads)


class _PostFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, f: torch.Tensor, x: torch.Tensor,  # type: ignore[override]
                h_post: torch.Tensor, h_res: torch.Tensor, owner: "_Owner",
                link: Optional[_Link]) -> torch.Tensor:
        f = f.to(x.dtype)
        out = owner.transport.run(
            "post", owner.name,
            {"f": f, "x": x, "h_post": h_post.float(), "h_res": h_res.float()},
            {"x_next": (tuple(x.shape), x.dtype)})
        ctx.owner, ctx.link = owner, link
        ctx.f_dtype = f.dtype
        ctx.save_for_backward(f, x, h_post, h_res)
        return out["x_next"]

    @staticmethod
    def backward(ctx: Any, dx_next: torch.Tensor  # type: ignore[override]
                 ) -> Tuple[Optional[torch.Tensor], ...]:
        f, x, h_post, h_res = ctx.saved_tensors
        owner: _Owner = ctx.owner
        fused = ctx.link is not None
        dx_next = dx_next.to(x.dtype).contiguous()
        lead, n = _lead(x), owner.spec.n
        wanted = {"df": (tuple(f.shape), f.dtype),
                  "dh_post": (lead + (n,), torch.float32),
                  "dh_res": (lead + (n, n), torch.float32)}
        if not fused:
            wanted["dx"] = (tuple(x.shape), x.dtype)
        out = owner.transport.run(
            "post_backward", owner.name,
            {"dx_next": dx_next, "f": f, "x": x, "h_post": h_post.float(),
             "h_res": h_res.float()}, wanted, skip_dx=fused)
        if fused:
            ctx.link.dx_next = dx_next
        return (out["df"], out.get("dx"), out["dh_post"], out["dh_res"], None,
                None)


class _Owner:
    """What the autograd functions need to know about a daemon layer."""

    def __init__(self, client: Client, name: str, spec: LayerSpec,
                 transport: _Transport) -> None:
        self.client = client
        self.name = name
        self.spec = spec
        self.transport = transport
        self.module: Optional["MhcLayer"] = None

    def sync_before_forward(self) -> None:
        if self.module is not None:
            self.module.push_parameters(only_changed=True)

    def take_gradients(self) -> List[Optional[torch.Tensor]]:
        if self.module is None or not self.module.sync_gradients:
            return [None] * len(self.module.param_names if self.module else [])
        return self.module._fetch_gradients(zero=True)


def mhc_pre(client: Client, layer: str, x: torch.Tensor, *,
            transport: str = "auto"
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h_pre, h_post, h_res) of daemon layer `layer`, differentiable in x.

    Parameter gradients accumulate in the daemon (read them with
    ``client.get_gradients``); h_pre is returned for inspection only.
    """
    spec = client.get_layer(layer).spec
    owner = _Owner(client, layer, spec, _Transport(client, transport))
    return _PreFunction.apply(x, owner, None)


def mhc_post(client: Client, layer: str, f: torch.Tensor, x: torch.Tensor,
             h_post: torch.Tensor, h_res: torch.Tensor, *,
             transport: str = "auto") -> torch.Tensor:
    """x_next of daemon layer `layer`, differentiable in f, x, h_post, h_res."""
    spec = client.get_layer(layer).spec
    owner = _Owner(client, layer, spec, _Transport(client, transport))
    return _PostFunction.apply(f, x, h_post, h_res, owner, None)


# ------------------------------------------------------------------ module


class MhcLayer(nn.Module):
    """One mHC layer (pre -> sublayer -> post) computed by mhcd.

    Args:
        client: the daemon connection (kept open by the caller).
        hidden: C, the width of one stream.
        n: number of streams.
        sublayer: F, run here between pre and post (attention, FFN, ...);
            may also be passed to :meth:`forward`.
        preset: the daemon preset; `spec_overrides` set single fields.
        name: daemon layer name (default: unique per process).
        seed / parameters: initialisation (SPEC section 5) or explicit
            float32 arrays by name.
        device: daemon device ("" = its default, "cpu", "cuda:0").
        transport: "auto", "inline" or "ipc" (see the module docstring).
        sync_gradients: fetch gradients into ``.grad`` at every backward.
    """

    def __init__(self, client: Client, hidden: int, n: int = 4,
                 sublayer: Optional[nn.Module] = None, *,
                 preset: str = "", name: Optional[str] = None,
                 seed: Optional[int] = None,
                 parameters: Optional[Dict[str, Any]] = None,
                 device: str = "", transport: str = "auto",
                 sync_gradients: bool = True, **spec_overrides: Any) -> None:
        super().__init__()
        self.client = client
        self.layer_name = name or f"torch-{os.getpid()}-{next(_names)}"
        self.sublayer = sublayer
        self.sync_gradients = sync_gradients
        info: LayerInfo = client.create_layer(
            self.layer_name, hidden, n=n, preset=preset, seed=seed,
            parameters=parameters, device=device, **spec_overrides)
        self.spec = info.spec
        self._owner = _Owner(client, self.layer_name, self.spec,
                             _Transport(client, transport))
        self._owner.module = self
        self._versions: Dict[str, Tuple[int, int]] = {}
        self._deleted = False
        values = client.get_parameters(self.layer_name)
        self.param_names: List[str] = [k for k in ("phi", "alpha", "beta",
                                                   "gamma", "bias")
                                       if k in values]
        for key in self.param_names:
            self.register_parameter(key, nn.Parameter(torch.from_numpy(values[key])))
        self._remember_versions()

    # -------------------------------------------------------- parameters

    def _params(self) -> List[nn.Parameter]:
        return [getattr(self, k) for k in self.param_names]

    def _remember_versions(self) -> None:
        self._versions = {k: (p._version, p.data_ptr())
                          for k, p in zip(self.param_names, self._params())}

    def push_parameters(self, only_changed: bool = False) -> bool:
        """Sends the local parameters to the daemon; True if any were sent."""
        changed = {k: p for k, p in zip(self.param_names, self._params())
                   if not only_changed
                   or self._versions.get(k) != (p._version, p.data_ptr())}
        if not changed:
            return False
        self.client.set_parameters(
            self.layer_name,
            {k: p.detach().float().cpu().numpy() for k, p in changed.items()})
        self._remember_versions()
        return True

    def pull_parameters(self) -> None:
        """Overwrites the local parameters with the daemon's."""
        values = self.client.get_parameters(self.layer_name)
        with torch.no_grad():
            for key, p in zip(self.param_names, self._params()):
                p.copy_(torch.from_numpy(values[key]))
        self._remember_versions()

    def _fetch_gradients(self, zero: bool) -> List[Optional[torch.Tensor]]:
        grads = self.client.get_gradients(self.layer_name)
        if zero:
            self.client.zero_gradients(self.layer_name)
        out: List[Optional[torch.Tensor]] = []
        for key, p in zip(self.param_names, self._params()):
            g = grads.get(key)
            out.append(None if g is None else
                       torch.from_numpy(g).to(device=p.device, dtype=p.dtype))
        return out

    def pull_grads(self) -> None:
        """Adds the daemon's accumulated gradients to ``.grad`` and zeroes
        them in the daemon (for ``sync_gradients=False``)."""
        for p, g in zip(self._params(), self._fetch_gradients(zero=True)):
            if g is None:
                continue
            p.grad = g if p.grad is None else p.grad + g

    # ----------------------------------------------------------- forward

    def pre(self, x: torch.Tensor, link: Optional[_Link] = None
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(y, h_pre, h_post, h_res); parameter gradients flow from here."""
        return _PreFunction.apply(x, self._owner, link, *self._params())

    def post(self, f: torch.Tensor, x: torch.Tensor, h_post: torch.Tensor,
             h_res: torch.Tensor, link: Optional[_Link] = None) -> torch.Tensor:
        return _PostFunction.apply(f, x, h_post, h_res, self._owner, link)

    def forward(self, x: torch.Tensor,
                sublayer: Optional[nn.Module] = None) -> torch.Tensor:
        fn = sublayer if sublayer is not None else self.sublayer
        if fn is None:
            raise errors.InvalidArgument("MhcLayer: no sublayer given")
        link = _Link()
        y, _, h_post, h_res = self.pre(x, link)
        return self.post(fn(y), x, h_post, h_res, link)

    def close(self) -> None:
        """Deletes the daemon layer. Idempotent."""
        if not self._deleted:
            self._deleted = True
            try:
                self.client.delete_layer(self.layer_name)
            except errors.NotFound:
                pass

    def extra_repr(self) -> str:
        return (f"name={self.layer_name!r}, n={self.spec.n}, "
                f"hidden={self.spec.hidden}")
