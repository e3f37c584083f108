"""The native call path: compute calls built and sent in C++.

``mhc_client._native`` is a CPython extension built by the CMake build next
to the generated modules (``BUILD_DIR/client/python/mhc_client``). It holds
its own C++ gRPC channel to the daemon; a call passes only strs, ints and
small tuples naming tensors already placed in the session's regions (see
:meth:`mhc_client.Client.compute_in_place`), and the request is built,
sent (without the GIL) and its answer checked in C++. It needs no CUDA:
stream-order events travel as indices, as in the pure-Python path.

Which path a client takes: ``Client(native=...)``, else the environment
variable ``MHC_CLIENT_NATIVE``:

* ``auto`` (default): native when the extension imports and the daemon is
  on this node (unix socket); pure Python otherwise.
* ``on`` / ``1``: native, and an error if the extension does not import.
* ``off`` / ``0``: pure Python.

Remote daemons and inline tensors always take the pure-Python path.

On the native path a session also opens a call ring (unless
``MHC_CLIENT_CALL_RING=off``): the compute calls of that session then go
through shared memory and a futex instead of gRPC messages. Calls on CUDA
tensors then become deferred (unless ``MHC_CLIENT_DEFERRED=off``): they
return once the request is written, and the caller's stream waits on the
ring's done word for the daemon's work (see
:mod:`mhc_client.torch_transport`).
"""

from __future__ import annotations

import os
from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import grpc

from . import errors

ENV = "MHC_CLIENT_NATIVE"
# "off" keeps the native path's compute calls on gRPC (see
# Connection.open_call_ring).
CALL_RING_ENV = "MHC_CLIENT_CALL_RING"
CALL_RING_AREA_BYTES = 64 << 10
# "off" keeps calls on CUDA tensors answered before they return (see
# Connection.enable_deferred_calls).
DEFERRED_ENV = "MHC_CLIENT_DEFERRED"
_MODES = {"auto": "auto", "": "auto", "on": "on", "1": "on", "true": "on",
          "off": "off", "0": "off", "false": "off"}
_CODES = {code.value[0]: code for code in grpc.StatusCode}

# A tensor in place: (field, dtype code, shape, region or None, offset,
# byte_size); region None is an empty tensor. An output destination:
# (output, region, offset, byte_size).
TensorPlace = Tuple[str, int, Tuple[int, ...], Optional[str], int, int]
OutputPlace = Tuple[str, str, int, int]

# A CUDA tensor by address: (field, dtype code, shape, address, byte_size);
# byte_size 0 is an empty tensor. A CUDA output: (output, address,
# byte_size).
CudaTensorPlace = Tuple[str, int, Tuple[int, ...], int, int]
CudaOutputPlace = Tuple[str, int, int]


class EventPair(NamedTuple):
    """One call's stream-order events (see mhc_client.cuda_events): their
    indices in the session's pool and their raw ``cudaEvent_t`` handles."""

    wait_index: int
    signal_index: int
    wait_handle: int
    signal_handle: int


_module: Any = None
_import_error: Optional[BaseException] = None


def mode(native: Optional[bool] = None) -> str:
    """``"on"``, ``"off"`` or ``"auto"``: `native` if given, else the
    environment's choice."""
    if native is not None:
        return "on" if native else "off"
    value = os.environ.get(ENV, "auto").strip().lower()
    if value not in _MODES:
        raise errors.InvalidArgument(
            f"{ENV}: expected auto, on or off, got '{value}'")
    return _MODES[value]


def load() -> Any:
    """The extension module, or None when it is not built or not loadable
    (:func:`unavailable_reason` says why)."""
    global _module, _import_error
    if _module is None and _import_error is None:
        try:
            from . import _native  # type: ignore[attr-defined]
            _module = _native
        except ImportError as error:
            _import_error = error
    return _module


def cuda_region_table() -> Any:
    """A new, empty table of a session's registered CUDA allocations, for
    :meth:`Connection.compute_cuda`; None without the extension. The
    session keeps it in step with its registrations (mhc_client.shm)."""
    module = load()
    return module.CudaRegionTable() if module is not None else None


def unavailable_reason() -> Optional[str]:
    load()
    return None if _module is not None else str(_import_error)


class Connection:
    """The native path of one :class:`~mhc_client.Client`: a C++ channel to
    the same daemon, and the calls over it."""

    def __init__(self, target: str, max_message_bytes: int,
                 bearer_token: str = "") -> None:
        module = load()
        if module is None:
            raise errors.FailedPrecondition(
                f"the native call path is not available: {unavailable_reason()}")
        self._error = module.RpcError
        self._methods: Dict[str, int] = {
            name: index for index, name in enumerate(module.methods())}
        try:
            self._connection = module.Connection(target, max_message_bytes,
                                                 bearer_token)
        except module.RpcError as error:
            raise _typed(error, "Connect") from None

    def compute(self, rpc: str, layer: str, tensors: Sequence[TensorPlace],
                outputs: Sequence[OutputPlace], flags: Sequence[Tuple[str, Any]],
                *, session_id: str, wait_event: int, signal_event: int,
                timeout: float, attempts: int) -> None:
        """One compute call; raises the same :class:`~mhc_client.MhcError`
        subclass and message as the pure-Python path."""
        try:
            self._connection.compute(
                self._methods[rpc], layer, tensors, outputs, flags, session_id,
                wait_event, signal_event, timeout, attempts)
        except self._error as error:
            raise _typed(error, rpc) from None

    def compute_cuda(self, rpc: str, layer: str,
                     tensors: Sequence[CudaTensorPlace],
                     outputs: Sequence[CudaOutputPlace],
                     flags: Sequence[Tuple[str, Any]], *, session_id: str,
                     table: Any, stream: int, events: "EventPair",
                     timeout: float, attempts: int) -> bool:
        """One compute call on CUDA tensors named by device address, their
        regions and offsets found in `table` (see :func:`cuda_region_table`)
        and the call ordered with `stream` (a raw ``cudaStream_t``) by the
        event pair. False, and nothing done, when an allocation is not in
        `table`: the caller registers it and calls again."""
        try:
            return self._connection.compute_cuda(
                self._methods[rpc], layer, tensors, outputs, flags, session_id,
                events.wait_index, events.signal_index, timeout, attempts,
                table, stream, events.wait_handle, events.signal_handle)
        except self._error as error:
            raise _typed(error, rpc) from None

    def open_call_ring(self, session_id: str, key_prefix: str,
                       area_bytes: int = CALL_RING_AREA_BYTES) -> None:
        """Sends this connection's compute calls of session `session_id`
        through a call ring of that session (shm.proto, "Call ring"): a
        shared-memory object whose key starts with `key_prefix`, registered
        as region ``call_ring``. Its compute calls then skip gRPC."""
        try:
            self._connection.open_call_ring(session_id, key_prefix, area_bytes)
        except self._error as error:
            raise _typed(error, "OpenCallRing") from None

    def close_call_ring(self) -> None:
        """Compute calls go over gRPC again. With deferred calls, first
        waits for them and for the device (streams may still wait on the
        ring's memory)."""
        self._connection.close_call_ring()

    def enable_deferred_calls(self) -> bool:
        """Makes :meth:`compute_cuda` calls whose event pair has no signal
        event (index -1) deferred calls of the open ring: they return once
        the request is written, the stream waiting on the ring's done word
        for the daemon's work, and a failure is raised by the next call (or
        :meth:`flush`). Needs the CUDA context of the caller's device
        current. False when there is no ring or the driver cannot wait on
        host memory; calls then stay as they were."""
        if os.environ.get(DEFERRED_ENV, "").strip().lower() in ("off", "0"):
            return False
        return bool(self._connection.enable_deferred_calls())

    def flush(self) -> None:
        """Collects the last deferred call's answer; raises its error."""
        try:
            self._connection.flush()
        except self._error as error:
            raise _typed(error, "flush") from None

    def stats(self) -> Dict[str, int]:
        """Calls, deferred calls, failures, retries, the largest request
        (bytes), the calls sent through the open call ring so far and the
        seconds callers waited there for deferred calls' answers."""
        return self._connection.stats()

    def reset_stats(self) -> None:
        self._connection.reset_stats()

    def close(self) -> None:
        self._connection.close()


def _typed(error: BaseException, rpc: str) -> errors.MhcError:
    code, message = error.args
    return errors.error_for(_CODES.get(code, grpc.StatusCode.UNKNOWN), message,
                            rpc)
