"""PyTorch integration: an mHC layer whose forward and backward run in mhcd.

    layer = MhcLayer(client, hidden=256, n=4, sublayer=ffn)
    x_next = layer(x)              # Pre -> sublayer (here) -> Post
    loss.backward()                # PostBackward -> sublayer -> PreBackward
    optimizer.step()               # updates layer.phi/alpha/beta

Parameters. The daemon holds the layer's parameters and accumulates their
gradients. The module exposes them as ``nn.Parameter`` (phi, alpha, beta,
and gamma / bias when the spec has them), so optimizers, clipping and state
dicts work as usual. Two modes:

* in place (a CUDA layer of a daemon on this node with shared memory):
  each parameter IS the daemon's parameter (a view of the daemon's memory,
  opened by CUDA IPC through MapLayerMemory) and its ``.grad`` IS the
  daemon's gradient accumulator. Backward calls add into ``.grad`` on the
  device, an optimizer step writes the parameters in place, and nothing is
  copied: a training step is the layer's four compute calls. Before a call
  that accumulates, a ``.grad`` set to None (``zero_grad()``) is zeroed and
  a ``.grad`` replaced by another tensor is copied into the accumulator.
  Writes and reads are ordered with the daemon by the current stream (see
  mhc_client.torch_transport). Other RPCs on the layer (GetParameters,
  SetParameters, ZeroGradients) are not: synchronise the stream first.
  :meth:`MhcLayer.refresh` maps the memory again when the daemon
  reallocated it (after ConvertLayout: use :meth:`MhcLayer.convert_layout`).
  Moving the parameters to another device (``module.to("cpu")``) switches
  the layer to the mirror mode.
* mirror (remote daemons, CPU layers, ``transport="inline"``): the module
  keeps copies. The layer's last backward step (PreBackward) fetches the
  daemon's accumulated gradients, zeroes the accumulators and returns them
  as the parameters' gradients, so they land in ``.grad`` like any other
  module's (``sync_gradients=False`` leaves them in the daemon instead:
  call :meth:`MhcLayer.pull_grads` before the optimizer step); before each
  forward the module pushes parameters that changed locally with
  SetParameters (:meth:`MhcLayer.push_parameters` does it explicitly).

Transport (mhc_client.torch_transport). CUDA tensors go by CUDA IPC (zero
copy: the daemon reads and writes this process's device memory in place,
ordered with the current stream by events, with no host synchronisation)
when the daemon is on this node (unix socket) and serves a CUDA device.
Host tensors go through a shared-memory arena when the daemon is on this
node and allows shared memory; otherwise tensors are sent inline.
``transport="inline"`` / ``"ipc"`` forces one. :data:`stats` counts calls
and host synchronisations.

Backward fusion. As in the canonical sequence (PostBackward with skip_dx,
then PreBackward with dx_next), the layer hands the post's upstream
gradient to PreBackward so the layer's dx is accumulated in fp32 and
rounded once; the standalone functions :func:`mhc_pre` / :func:`mhc_post`
compute their own dx each.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import errors
from .client import Client
from .layer_memory import LayerMemoryMapping
from .shm import unique_key
from .spec import LayerInfo, LayerSpec
from .torch_transport import (TransportStats, _Transport, from_numpy,
                              stats, to_numpy)

__all__ = ["MhcLayer", "TransportStats", "from_numpy", "mhc_post", "mhc_pre",
           "stats", "to_numpy"]

# Errors of MapLayerMemory that mean "not for this layer or daemon".
_NO_LAYER_MEMORY = (errors.FailedPrecondition, errors.PermissionDenied,
                    errors.Unimplemented)


# --------------------------------------------------------------- functions


class _Link:
    """Carries the post's dx_next to the same layer's PreBackward."""

    def __init__(self) -> None:
        self.dx_next: Optional[torch.Tensor] = None


def _lead(x: torch.Tensor) -> Tuple[int, ...]:
    return tuple(x.shape[:-2])


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`: `t` itself when it is already (a no-op conversion
    still costs a dispatch, and the step runs a dozen). The transport makes
    inputs contiguous."""
    return t if t.dtype is dtype else t.to(dtype)


class _PreFunction(torch.autograd.Function):
    # The parameters are inputs so that the outputs need gradients whenever
    # the parameters do; in place, their gradients are the daemon's
    # accumulators already and backward returns None for them.
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
                                  order_device=owner.order_device,
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
        inputs = {"x": x, "dy": _as(dy, x.dtype),
                  "dh_post": _as(dh_post, torch.float32),
                  "dh_res": _as(dh_res, torch.float32), "dx_next": dx_next}
        if projection:
            inputs["h"], inputs["mean_square"] = projection
        skip = owner.before_accumulating()
        flags = {"skip_parameter_gradients": True} if skip else {}
        dx = owner.transport.run("pre_backward", owner.name, inputs,
                                 {"dx": (tuple(x.shape), x.dtype)},
                                 order_device=owner.order_device, **flags)["dx"]
        grads = owner.take_gradients() if ctx.n_params else []
        return (dx, None, None, *grads)


class _PostFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, f: torch.Tensor, x: torch.Tensor,  # type: ignore[override]
                h_post: torch.Tensor, h_res: torch.Tensor, owner: "_Owner",
                link: Optional[_Link]) -> torch.Tensor:
        f = _as(f, x.dtype)
        out = owner.transport.run(
            "post", owner.name,
            {"f": f, "x": x, "h_post": _as(h_post, torch.float32),
             "h_res": _as(h_res, torch.float32)},
            {"x_next": (tuple(x.shape), x.dtype)},
            order_device=owner.order_device)
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
        dx_next = _as(dx_next, x.dtype).contiguous()
        lead, n = _lead(x), owner.spec.n
        wanted = {"df": (tuple(f.shape), f.dtype),
                  "dh_post": (lead + (n,), torch.float32),
                  "dh_res": (lead + (n, n), torch.float32)}
        if not fused:
            wanted["dx"] = (tuple(x.shape), x.dtype)
        flags: Dict[str, Any] = {"skip_dx": fused}
        if owner.spec.has_post_bias and owner.before_accumulating():
            flags["skip_parameter_gradients"] = True
        out = owner.transport.run(
            "post_backward", owner.name,
            {"dx_next": dx_next, "f": f, "x": x,
             "h_post": _as(h_post, torch.float32),
             "h_res": _as(h_res, torch.float32)}, wanted,
            order_device=owner.order_device, **flags)
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

    @property
    def order_device(self) -> Optional[torch.device]:
        """The device of the parameters in place, if any."""
        return self.module._in_place_device if self.module is not None else None

    def sync_before_forward(self) -> None:
        if self.module is not None:
            self.module._before_forward()

    def before_accumulating(self) -> bool:
        """Readies ``.grad`` for a call that adds parameter gradients; True
        when no parameter wants them (the call may skip them)."""
        if self.module is None:
            return False
        return self.module._before_accumulating()

    def take_gradients(self) -> List[Optional[torch.Tensor]]:
        module = self.module
        if module is None:
            return []
        if module.parameters_in_place or not module.sync_gradients:
            return [None] * len(module.param_names)
        return module._fetch_gradients(zero=True)


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
        name: daemon layer name (default: unique to this process, a random
            part included, so that a later process of the same pid never
            meets a layer an earlier one left on the daemon).
        seed / parameters: initialisation (docs/SPEC.md section 5) or explicit
            float32 arrays by name.
        device: daemon device ("" = its default, "cpu", "cuda:0").
        transport: "auto", "inline" or "ipc" (see the module docstring).
        sync_gradients: mirror mode: fetch gradients into ``.grad`` at
            every backward.
        parameters_in_place: None (whenever possible), True (required) or
            False (mirror mode); see the module docstring.
    """

    def __init__(self, client: Client, hidden: int, n: int = 4,
                 sublayer: Optional[nn.Module] = None, *,
                 preset: str = "", name: Optional[str] = None,
                 seed: Optional[int] = None,
                 parameters: Optional[Dict[str, Any]] = None,
                 device: str = "", transport: str = "auto",
                 sync_gradients: bool = True,
                 parameters_in_place: Optional[bool] = None,
                 **spec_overrides: Any) -> None:
        super().__init__()
        self.client = client
        self.layer_name = name or unique_key("torch-", "layer")
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
        self._mapping: Optional[LayerMemoryMapping] = None
        self._in_place_device: Optional[torch.device] = None
        self._param_views: Dict[str, torch.Tensor] = {}
        self._grad_views: Dict[str, torch.Tensor] = {}
        try:
            if self._may_map(info, transport, parameters_in_place):
                try:
                    self._map()
                except _NO_LAYER_MEMORY:
                    if parameters_in_place:
                        raise
            if self._mapping is not None:
                values = self._param_views
            else:
                values = {k: torch.from_numpy(v)
                          for k, v in client.get_parameters(self.layer_name).items()}
            self.param_names: List[str] = [
                k for k in ("phi", "alpha", "beta", "gamma", "bias") if k in values]
            for key in self.param_names:
                self.register_parameter(key, nn.Parameter(values[key]))
            if self._mapping is not None:
                for key in self.param_names:
                    if getattr(self, key).data_ptr() != self._param_views[key].data_ptr():
                        raise errors.Internal(
                            f"MhcLayer: parameter '{key}' does not alias the "
                            "daemon's memory")
            self._remember_versions()
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------- in place mode

    def _may_map(self, info: LayerInfo, transport: str,
                 wanted: Optional[bool]) -> bool:
        if wanted is False:
            return False
        reasons = []
        if transport == "inline":
            reasons.append("transport='inline'")
        if not self.client.is_local:
            reasons.append("the daemon is not on this node (unix socket)")
        if not info.device.startswith("cuda"):
            reasons.append(f"the layer is on '{info.device}', not a CUDA device")
        elif not torch.cuda.is_available():
            reasons.append("torch sees no CUDA device")
        if reasons and wanted:
            raise errors.FailedPrecondition(
                "parameters_in_place=True: " + "; ".join(reasons))
        return not reasons

    def _map(self) -> None:
        """Maps the layer's memory and takes views of it."""
        memory = self.client.map_layer_memory(self.layer_name)
        mapping = LayerMemoryMapping(memory)
        self._param_views, self._grad_views = mapping.views()
        self._mapping = mapping
        self._in_place_device = torch.device("cuda", mapping.device)

    @property
    def parameters_in_place(self) -> bool:
        """Whether the parameters are the daemon's memory (see module doc)."""
        return self._mapping is not None

    def _before_forward(self) -> None:
        if self._mapping is None:
            self.push_parameters(only_changed=True)
            return
        for key in self.param_names:
            p = getattr(self, key)
            view = self._param_views[key]
            if p.data_ptr() == view.data_ptr() and p.dtype == view.dtype \
                    and p.shape == view.shape:
                continue
            if p.device != view.device or p.shape != view.shape:
                self._leave_in_place()
                self.push_parameters()
                return
            # Replaced on the same device (e.g. `p.data = t`): take the
            # values and alias the daemon's memory again.
            with torch.no_grad():
                view.copy_(p.detach())
            p.data = view

    def _before_accumulating(self) -> bool:
        if self._mapping is None:
            return False
        params = [getattr(self, k) for k in self.param_names]
        if not any(p.requires_grad for p in params):
            return True
        with torch.no_grad():
            for key, p in zip(self.param_names, params):
                accumulator = self._grad_views[key]
                grad = p.grad
                if grad is None:
                    accumulator.zero_()
                elif grad.data_ptr() == accumulator.data_ptr() and \
                        grad.shape == accumulator.shape:
                    continue
                else:
                    accumulator.copy_(grad)
                p.grad = accumulator
        return False

    def _leave_in_place(self) -> None:
        """Switches to the mirror mode (parameters moved off the layer's
        device): gradients stay in ``.grad`` and leave the daemon."""
        device = self._in_place_device
        for key in self.param_names:
            p = getattr(self, key)
            if p.grad is not None and \
                    p.grad.data_ptr() == self._grad_views[key].data_ptr():
                p.grad = p.grad.clone()
        self._drop_mapping()
        if device is not None:
            torch.cuda.current_stream(device).synchronize()
        self.client.zero_gradients(self.layer_name)

    def _drop_mapping(self) -> None:
        # The mapping closes once no view of it is left.
        self._param_views = {}
        self._grad_views = {}
        self._mapping = None
        self._in_place_device = None

    def refresh(self) -> bool:
        """Re-reads the layer's spec; in place, maps the layer's memory again
        if the daemon reallocated it (LayerMemory.generation changed);
        mirrored, pulls the parameters. True if the memory was remapped."""
        info = self.client.get_layer(self.layer_name)
        self.spec = self._owner.spec = info.spec
        if self._mapping is None:
            self.pull_parameters()
            return False
        memory = self.client.map_layer_memory(self.layer_name)
        if int(memory.generation) == self._mapping.generation:
            return False
        torch.cuda.current_stream(self._in_place_device).synchronize()
        old_grads = self._grad_views
        mapping = LayerMemoryMapping(memory)
        params, grads = mapping.views()
        for key in self.param_names:
            p = getattr(self, key)
            p.data = params[key]
            if p.grad is not None and \
                    p.grad.data_ptr() == old_grads[key].data_ptr():
                p.grad = grads[key]
        self._param_views, self._grad_views = params, grads
        self._mapping = mapping
        self._in_place_device = torch.device("cuda", mapping.device)
        return True

    def convert_layout(self, layout: str) -> None:
        """ConvertLayout of the daemon layer, then :meth:`refresh`."""
        if self._mapping is not None:
            torch.cuda.current_stream(self._in_place_device).synchronize()
        else:
            self.push_parameters(only_changed=True)
        self.client.convert_layout(self.layer_name, layout)
        self.refresh()

    # ------------------------------------------------------ mirror mode

    def _params(self) -> List[nn.Parameter]:
        return [getattr(self, k) for k in self.param_names]

    def _remember_versions(self) -> None:
        self._versions = {k: (p._version, p.data_ptr())
                          for k, p in zip(self.param_names, self._params())}

    def push_parameters(self, only_changed: bool = False) -> bool:
        """Sends the local parameters to the daemon; True if any were sent.
        In place there is nothing to send."""
        if self._mapping is not None:
            return False
        changed = {k: p for k, p in zip(self.param_names, self._params())
                   if not only_changed
                   or self._versions.get(k) != (p._version, p.data_ptr())}
        if not changed:
            return False
        self.client.set_parameters(
            self.layer_name, {k: to_numpy(p.float()) for k, p in changed.items()})
        self._remember_versions()
        return True

    def pull_parameters(self) -> None:
        """Overwrites the local parameters with the daemon's (nothing to do
        in place)."""
        if self._mapping is not None:
            return
        values = self.client.get_parameters(self.layer_name)
        with torch.no_grad():
            for key, p in zip(self.param_names, self._params()):
                p.copy_(from_numpy(values[key], p.device))
        self._remember_versions()

    def _fetch_gradients(self, zero: bool) -> List[Optional[torch.Tensor]]:
        grads = self.client.get_gradients(self.layer_name)
        if zero:
            self.client.zero_gradients(self.layer_name)
        out: List[Optional[torch.Tensor]] = []
        for key, p in zip(self.param_names, self._params()):
            g = grads.get(key)
            out.append(None if g is None else from_numpy(g, p.device).to(p.dtype))
        return out

    def pull_grads(self) -> None:
        """Adds the daemon's accumulated gradients to ``.grad`` and zeroes
        them in the daemon (for ``sync_gradients=False``; nothing to do in
        place)."""
        if self._mapping is not None:
            return
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
        """Deletes the daemon layer. Idempotent. In place, the parameters and
        gradients become copies first, so the module stays readable."""
        if self._deleted:
            return
        self._deleted = True
        if self._mapping is not None:
            with torch.no_grad():
                for key in getattr(self, "param_names", []):
                    p = getattr(self, key)
                    p.data = p.data.clone()
                    if p.grad is not None:
                        p.grad = p.grad.clone()
            self._drop_mapping()
        try:
            self.client.delete_layer(self.layer_name)
        except errors.NotFound:
            pass

    def extra_repr(self) -> str:
        return (f"name={self.layer_name!r}, n={self.spec.n}, "
                f"hidden={self.spec.hidden}, "
                f"in_place={self.parameters_in_place}")
