"""Interprocess CUDA events that order this process's stream with the
daemon's (see shm.proto, "Stream order").

One :class:`EventPool` per session and device: this process's events (the
daemon's stream waits on them before a request's work) and the daemon's
events (this process's stream waits on them after the request's answer).
A request takes one of each: see :meth:`EventPool.acquire`.
"""

from __future__ import annotations

import threading
from typing import Any, List, Tuple

from . import errors

WAIT_EVENT_METADATA_KEY = "mhc-wait-event"
SIGNAL_EVENT_METADATA_KEY = "mhc-signal-event"
DEFAULT_POOL_SIZE = 32
# How long a request waits for a free pair before giving up: pairs leak only
# when requests end without an answer, so an empty pool means something is
# stuck rather than busy.
ACQUIRE_TIMEOUT_S = 600.0


class EventPool:
    """`size` event pairs registered with the daemon for one CUDA device.

    Thread-safe. An index is taken from a free list and given back once the
    rules allow it again: this process's event i after the request that
    waits on it was answered, the daemon's event j after this process's
    stream called wait_event on it.
    """

    def __init__(self, client: Any, device: int,
                 size: int = DEFAULT_POOL_SIZE) -> None:
        import torch

        self.device = device
        self.size = size
        with torch.cuda.device(device):
            self._mine: List[Any] = [
                torch.cuda.Event(enable_timing=False, blocking=False,
                                 interprocess=True)
                for _ in range(size)]
            handles = [bytes(event.ipc_handle()) for event in self._mine]
        theirs = client.register_cuda_events(device, handles)
        if len(theirs) != size:
            raise errors.Internal(
                f"RegisterCudaEvents: asked for {size} events, the daemon "
                f"returned {len(theirs)}")
        where = torch.device("cuda", device)
        self._theirs: List[Any] = [torch.cuda.Event.from_ipc_handle(where, h)
                                   for h in theirs]
        # Raw cudaEvent_t handles, for the native call path.
        self.wait_handles = [event.cuda_event for event in self._mine]
        self.signal_handles = [event.cuda_event for event in self._theirs]
        self._free_wait = list(range(size))
        self._free_signal = list(range(size))
        self._available = threading.Condition()
        self._waiters = 0

    def acquire(self) -> Tuple[int, int]:
        """(wait index i, signal index j), blocking while none is free."""
        # list.pop and list.append are atomic under the GIL: the lock is
        # only for waiting on an empty pool, which is rare.
        try:
            wait = self._free_wait.pop()
        except IndexError:
            return self._acquire_waiting()
        try:
            return wait, self._free_signal.pop()
        except IndexError:
            self._free_wait.append(wait)
            return self._acquire_waiting()

    def _acquire_waiting(self) -> Tuple[int, int]:
        with self._available:
            self._waiters += 1
            try:
                if not self._available.wait_for(
                        lambda: self._free_wait and self._free_signal,
                        timeout=ACQUIRE_TIMEOUT_S):
                    raise errors.ResourceExhausted(
                        f"no free CUDA event pair on device {self.device}: "
                        f"{self.size} requests are unanswered")
                return self._free_wait.pop(), self._free_signal.pop()
            finally:
                self._waiters -= 1

    def reserve_wait(self) -> int:
        """Takes one of this process's events out of the pool for good:
        the deferred calls of a call ring record it, each after the daemon
        has waited for the previous one (see
        :meth:`mhc_client.native.Connection.enable_deferred_calls`)."""
        wait, signal = self.acquire()
        self._free_signal.append(signal)
        return wait

    def release(self, wait_index: int, signal_index: int) -> None:
        self._free_wait.append(wait_index)
        self._free_signal.append(signal_index)
        if self._waiters:  # read after the appends: no wake-up is lost
            with self._available:
                self._available.notify()

    def record_wait(self, index: int, stream: Any) -> None:
        """Marks the point of `stream` that the daemon's work must follow."""
        self._mine[index].record(stream)

    def wait_signal(self, index: int, stream: Any) -> None:
        """Makes `stream`'s later work follow the daemon's work."""
        stream.wait_event(self._theirs[index])

    @staticmethod
    def metadata(wait_index: int, signal_index: int) -> List[Tuple[str, str]]:
        return [(WAIT_EVENT_METADATA_KEY, str(wait_index)),
                (SIGNAL_EVENT_METADATA_KEY, str(signal_index))]
