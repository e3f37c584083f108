"""How the torch layer's tensors reach the daemon (see mhc_client.torch).

Three paths, picked per call from the first input tensor:

* ``cuda``: CUDA tensors and a CUDA daemon on this node. Tensors stay where
  they are: each names its allocation's region (registered once per
  allocation, see :meth:`mhc_client.shm.Session.register_cuda_tensor`) and
  the daemon reads and writes them in place. With the native extension the
  whole call (naming the regions, the events, the request) is one step in
  C++ once the allocations are registered; Python registers new ones. Outputs are allocated here
  with ``torch.empty`` on the current stream. This process records an
  interprocess event on the current stream once the inputs are queued, and
  the daemon's stream waits on it (shm.proto, "Stream order"). With the
  session's call ring the call is deferred: it returns once the request is
  written, and the current stream waits (cuStreamWaitValue32) until the
  ring's done word reaches the call's number, which the daemon's stream
  writes after the work. The host waits for nothing; the next call
  collects this one's answer and raises its error, if it failed
  (:meth:`mhc_client.Client.flush` does it at once). Without a ring the
  answer comes once the work is queued, and the current stream waits on an
  event of the daemon's. No host synchronisation either way.
* ``arena``: host tensors (or a daemon without CUDA) on this node with
  shared memory: inputs are copied into the session's host arena, the
  daemon writes outputs there, and they are copied out. No bytes travel in
  the messages, so tensors larger than the daemon's inline limits work.
* ``inline``: the bytes travel in the messages (remote daemons, or shared
  memory refused).

On the ``cuda`` and ``arena`` paths every tensor is a (region, offset)
place, and the call goes through :meth:`mhc_client.Client.compute_in_place`:
by the native extension when available (see :mod:`mhc_client.native`;
this module stays the same either way), else by the pure-Python stub.

Ordering contract of the ``cuda`` path: the daemon's work behaves like a
kernel launched on the current stream at the time of the call (a
deferred call's failure is raised by the next call, as an asynchronous
kernel error would be by a later CUDA call). It starts
after everything queued on that stream before (so inputs, parameters
written by an optimizer step, and recycled output memory are ready), and
everything queued on that stream afterwards starts after it. Inputs and
outputs therefore stay valid until the daemon is done: memory freed later
is reused by torch's allocator only in that stream's order, and inputs
allocated on another stream are marked as used on the current one
(``Tensor.record_stream``), so their memory waits for it too. As for any
kernel, an input written on another stream must be made visible to the
current stream by the caller (an event or a synchronisation between the
streams).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from . import errors, tensors
from .client import Client
from .native import (CudaOutputPlace, CudaTensorPlace, EventPair, OutputPlace,
                     TensorPlace)
from .ops import OpDef, op_def
from .shm import aligned, torch_dtype_code

_ITEMSIZE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
# Errors after which the daemon may still run the request: its tensors and
# events must not be reused.
_AMBIGUOUS = (errors.DeadlineExceeded, errors.Cancelled, errors.Unavailable)
# Tensors and event pairs of requests whose outcome is unknown, kept out of
# reuse for the life of the process.
_abandoned: List[Any] = []
# The raw handle of a device's current stream, where torch has it (CUDA
# builds): much cheaper than building a torch.cuda.Stream per call.
_raw_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_MAX_CACHED_STREAMS = 64


@dataclasses.dataclass
class TransportStats:
    """What the torch layer's transport did, for tests and tuning.

    ``host_syncs`` counts the times the client blocked the host on the
    device on the compute path (staying 0 in steady state on the ``cuda``
    path with a daemon that takes events). ``native_calls`` counts the
    ``cuda`` and ``arena`` calls sent by the native extension (see
    :mod:`mhc_client.native`); ``native_cuda_calls`` those of them done in
    one step of the extension, tensors named by address (every ``cuda``
    call in steady state, once their allocations are registered);
    ``deferred_calls`` those of them that returned without waiting for the
    daemon's answer (every one, with a call ring).
    """

    calls: int = 0
    native_calls: int = 0  # of the cuda and arena calls, native ones
    native_cuda_calls: int = 0  # of those, the cuda calls done in one step
    deferred_calls: int = 0  # of those, deferred ones
    cuda_calls: int = 0
    arena_calls: int = 0
    inline_calls: int = 0
    host_syncs: int = 0

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, 0)


stats = TransportStats()


# ------------------------------------------------------------- conversion


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A host numpy copy with the tensor's wire bytes (bf16 as uint16)."""
    t = t.detach()
    torch_dtype_code(t)  # refuses other dtypes
    if t.is_cuda:
        stats.host_syncs += 1
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
    if torch.device(device).type == "cuda":
        stats.host_syncs += 1
    return t.to(device)


Outputs = Dict[str, Tuple[Sequence[int], torch.dtype]]


class _Transport:
    """Moves one op's tensors to the daemon and its outputs back."""

    def __init__(self, client: Client, mode: str) -> None:
        if mode not in ("auto", "inline", "ipc"):
            raise errors.InvalidArgument("transport: auto, inline or ipc")
        self.client = client
        self.mode = mode
        self._daemon_has_cuda: Optional[bool] = None
        self._shm: Optional[bool] = None if mode == "auto" else mode == "ipc"
        # (device, raw handle) -> torch.cuda.Stream, see _current_stream.
        self._streams: Dict[Tuple[int, int], Any] = {}

    # ------------------------------------------------------------ choice

    def daemon_has_cuda(self) -> bool:
        if self._daemon_has_cuda is None:
            self._daemon_has_cuda = self.client.server_info().has_cuda
        return self._daemon_has_cuda

    def use_ipc(self, t: torch.Tensor) -> bool:
        """Whether CUDA tensor `t` would go by CUDA IPC."""
        return self._path(t) == "cuda"

    def _path(self, first: torch.Tensor) -> str:
        if self.mode == "inline" or self._shm is False:
            return "inline"
        if not self.client.is_local:
            if self.mode == "ipc":
                raise errors.FailedPrecondition(
                    "transport='ipc' needs a daemon on this node (unix socket)")
            return "inline"
        if first.is_cuda and self.daemon_has_cuda():
            return "cuda"
        return "arena"

    def _session(self) -> Any:
        """The client's session, or None when the daemon refuses shared
        memory (then, in auto mode, every later call goes inline)."""
        try:
            return self.client.open_session()
        except (errors.FailedPrecondition, errors.PermissionDenied):
            if self.mode == "ipc":
                raise
            self._shm = False
            return None

    # --------------------------------------------------------------- run

    def run(self, kind: str, layer: str, inputs: Dict[str, Optional[torch.Tensor]],
            outputs: Outputs, order_device: Optional[torch.device] = None,
            **flags: Any) -> Dict[str, torch.Tensor]:
        """Runs `kind`; `outputs` gives each wanted output's shape/dtype.

        `order_device`: a CUDA device whose current stream the call must be
        ordered with even when the tensors are on the host (the layer's
        parameters in place live there).
        """
        first = next(t for t in inputs.values() if t is not None)
        spec = op_def(kind)
        retry = not spec.mutates or bool(flags.get("skip_parameter_gradients"))
        stats.calls += 1
        path = self._path(first)
        session = self._session() if path != "inline" else None
        if session is not None and path == "cuda":
            stats.cuda_calls += 1
            return self._run_cuda(spec, session, layer, inputs, outputs,
                                  first.device, order_device, retry, flags)
        if session is not None:
            stats.arena_calls += 1
            return self._run_arena(spec, session, layer, inputs, outputs,
                                   first.device, order_device, retry, flags)
        stats.inline_calls += 1
        if order_device is not None:
            self._synchronize(order_device)
        arrays = {k: to_numpy(v) for k, v in inputs.items() if v is not None}
        result = self.client.compute(kind, layer, **arrays, **flags)
        return {k: from_numpy(result[k], first.device)
                for k in outputs if k in result}

    # -------------------------------------------------------------- cuda

    def _run_cuda(self, spec: OpDef, session: Any, layer: str,
                  inputs: Dict[str, Optional[torch.Tensor]], outputs: Outputs,
                  device: torch.device, order_device: Optional[torch.device],
                  retry: bool, flags: Dict[str, Any]) -> Dict[str, torch.Tensor]:
        # Every call of a training step comes here: one pass over the
        # tensors builds what the native call needs, since Python's cost per
        # call is most of the host's time of a step.
        stream = self._current_stream(device)
        if order_device is not None and order_device != device:
            self._synchronize(order_device)
        index = device.index
        named: List[Tuple[str, torch.Tensor]] = []
        places: List[CudaTensorPlace] = []
        for name, t in inputs.items():
            if t is None:
                continue
            if not t.is_contiguous():
                t = t.contiguous()
            if t.get_device() != index:
                raise errors.InvalidArgument(
                    f"{spec.kind}: '{name}' is on {t.device}, the other "
                    f"inputs on {device}")
            # No-op for memory allocated on this stream (the usual case).
            t.record_stream(stream)
            named.append((name, t))
            places.append((name, torch_dtype_code(t), t.shape, t.data_ptr(),
                           t.nbytes))
        result: Dict[str, torch.Tensor] = {}
        out_places: List[CudaOutputPlace] = []
        for name, (shape, dtype) in outputs.items():
            out = result[name] = torch.empty(shape, dtype=dtype, device=device)
            if out.nbytes:
                out_places.append((name, out.data_ptr(), out.nbytes))
        alive = [t for _, t in named] + list(result.values())
        if not self._run_cuda_native(spec, session, layer, places, out_places,
                                     stream, retry, flags, alive):
            py_places: List[TensorPlace] = []
            py_out_places: List[OutputPlace] = []
            with session.pinned_cuda_regions() as pins:
                for name, t in named:
                    py_places.append(_cuda_place(session, name, t, pins))
                for name, out in result.items():
                    if out.numel() > 0:
                        _, _, _, region, offset, nbytes = _cuda_place(
                            session, name, out, pins)
                        py_out_places.append((name, region, offset, nbytes))
            self._ordered_call(spec, session, layer, py_places, py_out_places,
                               flags, stream, retry, alive)
        return result

    def _run_cuda_native(self, spec: OpDef, session: Any, layer: str,
                         places: List[CudaTensorPlace],
                         out_places: List[CudaOutputPlace], stream: Any,
                         retry: bool, flags: Dict[str, Any],
                         alive: List[torch.Tensor]) -> bool:
        """The call in one step of the native extension: tensors named by
        address, regions found and events recorded and waited on there
        (:meth:`mhc_client.native.Connection.compute_cuda`). False when it
        does not apply or an allocation is not registered yet: the Python
        path then takes the call and registers it."""
        connection = self.client.native
        table = session.cuda_table
        if connection is None or table is None:
            return False
        raw_stream, index = stream.cuda_stream, stream.device_index
        if raw_stream == 0 and index != torch.cuda.current_device():
            return False  # the legacy stream of another device's context
        deferred = session.deferred_wait_event(index)
        pool = None
        if deferred is not None:
            # The ring's done word orders the stream; the event is the
            # ring's own, recorded only after the previous call's answer.
            events = EventPair(deferred[0], -1, deferred[1], 0)
            attempts = 1
        else:
            pool = session.cuda_events(index)
            if pool is None:
                return False
            wait_index, signal_index = pool.acquire()
            events = EventPair(wait_index, signal_index,
                               pool.wait_handles[wait_index],
                               pool.signal_handles[signal_index])
            attempts = self.client.retries if retry else 1
        try:
            sent = connection.compute_cuda(
                spec.rpc, layer, places, out_places, tuple(flags.items()),
                session_id=session.id, table=table, stream=raw_stream,
                events=events, timeout=self.client.timeout, attempts=attempts)
        except _AMBIGUOUS:
            if pool is not None:
                _abandoned.append((alive, pool, wait_index, signal_index))
                pool = None  # never hand these events out again
            raise
        finally:
            if pool is not None:
                pool.release(wait_index, signal_index)
        if sent:
            stats.native_calls += 1
            stats.native_cuda_calls += 1
            if deferred is not None:
                stats.deferred_calls += 1
        return sent

    def _ordered_call(self, spec: OpDef, session: Any, layer: str,
                      places: List[TensorPlace], out_places: List[OutputPlace],
                      flags: Dict[str, Any], stream: Any, retry: bool,
                      alive: List[torch.Tensor]) -> None:
        """The RPC, ordered with `stream` by events (or, with a daemon that
        takes none, by synchronising first)."""
        pool = session.cuda_events(stream.device.index)
        if pool is None:
            stream.synchronize()
            stats.host_syncs += 1
            self._send(spec, layer, places, out_places, flags, retry)
            return
        wait_index, signal_index = pool.acquire()
        release = True
        try:
            pool.record_wait(wait_index, stream)
            self._send(spec, layer, places, out_places, flags, retry,
                       wait_index, signal_index)
            pool.wait_signal(signal_index, stream)
        except _AMBIGUOUS:
            # The daemon may still read or write these tensors and use the
            # events later: never hand them out again.
            release = False
            _abandoned.append((alive, pool, wait_index, signal_index))
            raise
        finally:
            if release:
                pool.release(wait_index, signal_index)

    def _send(self, spec: OpDef, layer: str, places: List[TensorPlace],
              out_places: List[OutputPlace], flags: Dict[str, Any],
              retry: bool, wait_index: int = -1, signal_index: int = -1) -> None:
        if self.client.compute_in_place(spec, layer, places, out_places, flags,
                                        retry=retry, wait_event=wait_index,
                                        signal_event=signal_index):
            stats.native_calls += 1

    def _current_stream(self, device: torch.device) -> Any:
        """The current stream of `device`, as a torch.cuda.Stream reused
        for as long as it is current."""
        if _raw_current_stream is None:
            return torch.cuda.current_stream(device)
        key = (device.index, _raw_current_stream(device.index))
        stream = self._streams.get(key)
        if stream is None:
            if len(self._streams) >= _MAX_CACHED_STREAMS:
                self._streams.clear()  # handles of streams since destroyed
            stream = self._streams[key] = torch.cuda.current_stream(device)
        return stream

    def _synchronize(self, device: torch.device) -> None:
        torch.cuda.current_stream(device).synchronize()
        stats.host_syncs += 1

    # ------------------------------------------------------------- arena

    def _run_arena(self, spec: OpDef, session: Any, layer: str,
                   inputs: Dict[str, Optional[torch.Tensor]], outputs: Outputs,
                   device: torch.device, order_device: Optional[torch.device],
                   retry: bool, flags: Dict[str, Any]) -> Dict[str, torch.Tensor]:
        present = {k: v.detach() for k, v in inputs.items() if v is not None}
        places: Dict[str, int] = {}
        total = 0
        for name, t in present.items():
            places[name] = total
            total += aligned(t.numel() * t.element_size())
        out_places: Dict[str, Tuple[int, int]] = {}  # name -> (offset, bytes)
        for name, (shape, dtype) in outputs.items():
            count = int(math.prod(shape))  # np.prod costs microseconds a call
            out_places[name] = (total, count * _ITEMSIZE[dtype])
            total += aligned(count * _ITEMSIZE[dtype])
        if device.type == "cuda":
            stats.host_syncs += 1  # copies through pageable host memory
        arena = session.host_arena()
        with arena.lock:
            region = arena.reserve(total)
            whole = torch.from_numpy(region.ndarray(np.uint8, (region.byte_size,)))
            tensor_places: List[TensorPlace] = []
            for name, t in present.items():
                nbytes = t.numel() * t.element_size()
                if nbytes == 0:  # no bytes to place
                    tensor_places.append(
                        (name, torch_dtype_code(t), t.shape, None, 0, 0))
                    continue
                start = places[name]
                whole[start:start + nbytes].view(t.dtype).view(t.shape).copy_(t)
                tensor_places.append((name, torch_dtype_code(t), t.shape,
                                      region.name, start, nbytes))
            views: Dict[str, torch.Tensor] = {}
            output_places: List[OutputPlace] = []
            for name, (shape, dtype) in outputs.items():
                start, nbytes = out_places[name]
                if nbytes == 0:
                    continue
                views[name] = whole[start:start + nbytes].view(dtype).view(tuple(shape))
                output_places.append((name, region.name, start, nbytes))
            if order_device is not None:
                # Parameters in place: the daemon's stream must follow this
                # process's writes to them and precede its reads of gradients.
                self._ordered_call(spec, session, layer, tensor_places,
                                   output_places, flags,
                                   torch.cuda.current_stream(order_device),
                                   retry, [])
            else:
                self._send(spec, layer, tensor_places, output_places, flags,
                           retry)
            result: Dict[str, torch.Tensor] = {}
            for name, (shape, dtype) in outputs.items():
                out = torch.empty(tuple(shape), dtype=dtype, device=device)
                if name in views:
                    out.copy_(views[name])
                result[name] = out
            return result


def _cuda_place(session: Any, name: str, t: torch.Tensor,
                pins: Any) -> TensorPlace:
    """Where contiguous CUDA tensor `t` lies: its allocation's region
    (registered on first use) and its offset there."""
    code = torch_dtype_code(t)
    if t.numel() == 0:  # no allocation to name
        return (name, code, t.shape, None, 0, 0)
    region, offset = session.register_cuda_tensor(t, pins)
    return (name, code, t.shape, region.name, offset,
            t.numel() * t.element_size())
