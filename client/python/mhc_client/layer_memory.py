"""A daemon layer's parameters and gradients, mapped into this process.

:meth:`Client.map_layer_memory` describes one device allocation of the
daemon that holds all of a CUDA layer's parameters and gradient
accumulators; :class:`LayerMemoryMapping` opens it by CUDA IPC and hands out
torch tensors aliasing its parts, so the torch layer uses the daemon's
parameters in place (see mhc_client.torch).

Lifetime: the mapping stays open as long as any tensor made from it (each
tensor keeps the mapping alive), and is closed after the device finished
its queued work, so no kernel reads unmapped memory. The daemon may keep
several layers in one allocation (one handle): a process can open a handle
only once, so layers with the same handle share one opened allocation.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, Tuple

from . import cuda_ipc, errors

_FLOAT32_BYTES = 4


def _unmap(address: int, device: int) -> None:
    try:
        import torch

        torch.cuda.synchronize(device)
        cuda_ipc.close_mem_handle(address, device)
    except Exception:  # noqa: BLE001 - at exit CUDA may already be gone
        pass


class _OpenedHandle:
    """One daemon allocation opened here; closed when no user is left."""

    def __init__(self, handle: bytes, device: int) -> None:
        self.address = cuda_ipc.open_mem_handle(handle, device)
        self._finalizer = weakref.finalize(self, _unmap, self.address, device)


_opened: "weakref.WeakValueDictionary[Tuple[int, bytes], _OpenedHandle]" = \
    weakref.WeakValueDictionary()
_opened_lock = threading.Lock()


def _open(handle: bytes, device: int) -> _OpenedHandle:
    with _opened_lock:
        opened = _opened.get((device, handle))
        if opened is None:
            opened = _OpenedHandle(handle, device)
            _opened[(device, handle)] = opened
        return opened


class LayerMemoryMapping:
    """One opened LayerMemory (layer.proto)."""

    def __init__(self, memory: Any) -> None:
        self.device = int(memory.device_id)
        self.generation = int(memory.generation)
        self.byte_size = int(memory.byte_size)
        self._slices = {
            "parameters": {k: (int(v.offset), tuple(int(d) for d in v.shape))
                           for k, v in memory.parameters.items()},
            "gradients": {k: (int(v.offset), tuple(int(d) for d in v.shape))
                          for k, v in memory.gradients.items()},
        }
        if set(self._slices["parameters"]) != set(self._slices["gradients"]):
            raise errors.Internal(
                "LayerMemory: parameters and gradients name different tensors")
        for kind, slices in self._slices.items():
            for name, (offset, shape) in slices.items():
                count = 1
                for d in shape:
                    count *= d
                if offset % _FLOAT32_BYTES or \
                        offset + count * _FLOAT32_BYTES > self.byte_size:
                    raise errors.Internal(
                        f"LayerMemory: {kind} '{name}' at offset {offset} "
                        f"with shape {list(shape)} is outside the "
                        f"{self.byte_size}-byte allocation")
        self._opened = _open(bytes(memory.raw_handle), self.device)
        self.address = self._opened.address

    def views(self) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """(parameters, gradients): fp32 torch tensors by name, aliasing the
        daemon's memory. They keep this mapping open; it holds no reference
        to them, so dropping them all closes it."""
        import torch

        device = torch.device("cuda", self.device)

        def view(offset: int, shape: Tuple[int, ...]) -> Any:
            return cuda_ipc.tensor_from_pointer(self.address + offset, shape,
                                                torch.float32, device, self)

        return ({k: view(*v) for k, v in self._slices["parameters"].items()},
                {k: view(*v) for k, v in self._slices["gradients"].items()})
