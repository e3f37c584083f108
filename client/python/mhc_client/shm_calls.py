"""Shared memory: the :class:`Client` methods for sessions, their regions and
events, and the session's call ring (see docs/api.md and
:mod:`mhc_client.shm`)."""

from __future__ import annotations

import os
from typing import Any, List, Sequence

from . import errors
from . import native as native_path
from ._proto import shm_pb2


class SharedMemoryCalls:
    """Mixed into :class:`mhc_client.Client` (which provides ``_call``,
    ``native``, ``_native`` and ``_session``)."""

    def open_session(self) -> Any:
        """Opens the shared-memory session (see :mod:`mhc_client.shm`)."""
        from .shm import Session  # late: shm imports this module
        if self._session is not None and not self._session.closed:
            return self._session
        self._session = Session(self)
        self._open_call_ring(self._session)
        return self._session

    def _open_call_ring(self, session: Any) -> None:
        """Sends the native path's compute calls of `session` through a call
        ring, when the daemon takes one (it is an optimisation: any refusal
        leaves the calls on gRPC)."""
        connection = self.native
        if connection is None or os.environ.get(
                native_path.CALL_RING_ENV, "").strip().lower() in ("off", "0"):
            return
        try:
            connection.open_call_ring(session.id, session.key_prefix)
        except (errors.Unimplemented, errors.FailedPrecondition,
                errors.PermissionDenied, errors.InvalidArgument,
                errors.ResourceExhausted, errors.Internal):
            return
        session.call_ring = True
        session.on_close(connection.close_call_ring)

    def flush(self) -> None:
        """Waits for the answer of the last deferred call (see
        :mod:`mhc_client.torch_transport`) and raises its error, if it
        failed. Later calls report it too; this is for a caller that wants
        to know now, e.g. at the end of a training step."""
        if self._native:
            self._native.flush()

    def _forget_session(self, session: Any) -> None:
        if self._session is session:
            self._session = None

    def register_system_shared_memory(self, name: str, key: str, offset: int,
                                      byte_size: int) -> None:
        self._call("RegisterSystemSharedMemory",
                   shm_pb2.RegisterSystemSharedMemoryRequest(
                       name=name, key=key, offset=offset, byte_size=byte_size))

    def register_cuda_shared_memory(self, name: str, raw_handle: bytes,
                                    device_id: int, byte_size: int = 0) -> int:
        """Registers a CUDA allocation; byte_size 0 means all of it. Returns
        the bytes registered."""
        response = self._call("RegisterCudaSharedMemory",
                              shm_pb2.RegisterCudaSharedMemoryRequest(
                                  name=name, raw_handle=raw_handle,
                                  device_id=device_id, byte_size=byte_size))
        return int(response.byte_size)

    def register_cuda_events(self, device_id: int,
                             raw_handles: Sequence[bytes]) -> List[bytes]:
        """Registers this process's interprocess events on `device_id` with
        the session; returns as many of the daemon's (see
        :mod:`mhc_client.cuda_events`)."""
        response = self._call("RegisterCudaEvents",
                              shm_pb2.RegisterCudaEventsRequest(
                                  device_id=device_id,
                                  raw_handles=list(raw_handles)))
        return [bytes(h) for h in response.raw_handles]

    def unregister_shared_memory(self, name: str = "") -> List[str]:
        """Unregisters one region, or all of the session's (name empty)."""
        response = self._call("UnregisterSharedMemory",
                              shm_pb2.UnregisterSharedMemoryRequest(name=name))
        return list(response.unregistered)

    def shared_memory_status(self, name: str = ""
                             ) -> shm_pb2.SharedMemoryStatusResponse:
        return self._call("SharedMemoryStatus",
                          shm_pb2.SharedMemoryStatusRequest(name=name),
                          retry=True)
