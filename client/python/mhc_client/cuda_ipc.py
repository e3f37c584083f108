"""Minimal ctypes bindings of CUDA IPC for the torch layer (no cupy).

The runtime library is the one torch already loaded (so handles and
pointers belong to the same CUDA runtime as torch's tensors); the driver is
``libcuda.so.1``. Every call checks its error code and raises an
:class:`~mhc_client.errors.MhcError` naming the CUDA error.

* :func:`allocation_of` says which allocation a device pointer lies in, in
  one driver call: the allocation's process-unique buffer id (a segment
  freed and allocated again at the same address gets a new id), its start
  and its size.
* :func:`ipc_mem_handle`, :func:`open_mem_handle`, :func:`close_mem_handle`:
  cudaIpcGetMemHandle / cudaIpcOpenMemHandle / cudaIpcCloseMemHandle.
* :func:`tensor_from_pointer`: a torch tensor aliasing device memory that
  torch did not allocate (e.g. memory opened from another process).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from typing import Any, NamedTuple, Optional, Sequence

from . import errors

IPC_HANDLE_BYTES = 64
_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x01

# CUpointer_attribute values (cuda.h).
_ATTR_BUFFER_ID = 7
_ATTR_DEVICE_ORDINAL = 9
_ATTR_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_ATTR_RANGE_START_ADDR = 11
_ATTR_RANGE_SIZE = 12

# Runtime and driver errors whose meaning is "this memory cannot be shared"
# rather than a failure of the call itself.
_UNSHAREABLE_RUNTIME = {"cudaErrorNotSupported", "cudaErrorInvalidDevicePointer",
                        "cudaErrorMapBufferObjectFailed"}


class Allocation(NamedTuple):
    """The CUDA allocation holding a device pointer."""

    buffer_id: int  # unique over the process's lifetime, never reused
    base: int       # device address of the allocation's first byte
    size: int       # bytes


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class _Libraries:
    """The loaded runtime and driver, with prototypes set once."""

    def __init__(self) -> None:
        self.runtime = ctypes.CDLL(_runtime_path())
        try:
            self.driver = ctypes.CDLL("libcuda.so.1")
        except OSError as error:
            raise errors.FailedPrecondition(
                f"CUDA driver library libcuda.so.1 not found: {error}") from None
        rt, drv = self.runtime, self.driver
        rt.cudaGetErrorName.restype = ctypes.c_char_p
        rt.cudaGetErrorName.argtypes = [ctypes.c_int]
        rt.cudaIpcGetMemHandle.restype = ctypes.c_int
        rt.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_void_p]
        rt.cudaIpcOpenMemHandle.restype = ctypes.c_int
        rt.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p),
                                            _IpcHandle, ctypes.c_uint]
        rt.cudaIpcCloseMemHandle.restype = ctypes.c_int
        rt.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        drv.cuGetErrorName.restype = ctypes.c_int
        drv.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        drv.cuPointerGetAttributes.restype = ctypes.c_int
        drv.cuPointerGetAttributes.argtypes = [
            ctypes.c_uint, ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64]

    def runtime_error(self, code: int) -> str:
        name = self.runtime.cudaGetErrorName(code)
        return name.decode() if name else f"cudaError {code}"

    def driver_error(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self.driver.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
        return f"CUresult {code}"


_libraries: Optional[_Libraries] = None
_libraries_lock = threading.Lock()


def _runtime_path() -> str:
    """The libcudart that this process already mapped (torch's), else one
    by name."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if os.path.basename(path).startswith("libcudart.so"):
                    return path
    except OSError:
        pass
    candidates = []
    found = ctypes.util.find_library("cudart")
    if found:
        candidates.append(found)
    try:
        import torch

        if torch.version.cuda:
            candidates.append(f"libcudart.so.{torch.version.cuda.split('.')[0]}")
    except ImportError:  # pragma: no cover - torch is how callers get here
        pass
    candidates.append("libcudart.so")
    for name in candidates:
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    raise errors.FailedPrecondition(
        "CUDA runtime library (libcudart) not found in this process or by "
        "name; CUDA IPC needs a CUDA build of torch")


def _libs() -> _Libraries:
    global _libraries
    if _libraries is None:
        with _libraries_lock:
            if _libraries is None:
                import torch

                # The driver must be initialised (torch does it) before any
                # driver call; the runtime must be loaded before it is found.
                torch.cuda.init()
                _libraries = _Libraries()
    return _libraries


def _check_runtime(code: int, what: str) -> None:
    if code == 0:
        return
    name = _libs().runtime_error(code)
    if name in _UNSHAREABLE_RUNTIME:
        raise errors.FailedPrecondition(
            f"{what}: {name}: this memory cannot be shared by CUDA IPC (is "
            "it from expandable segments? run with PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:False, or use transport='inline')")
    if name == "cudaErrorInvalidValue":
        raise errors.InvalidArgument(f"{what}: {name}")
    raise errors.Internal(f"{what}: {name}")


# One buffer set per thread: the attribute query writes into them.
_query = threading.local()


def _query_buffers() -> Any:
    buffers = getattr(_query, "buffers", None)
    if buffers is None:
        attrs = (ctypes.c_int * 3)(_ATTR_BUFFER_ID, _ATTR_RANGE_START_ADDR,
                                   _ATTR_RANGE_SIZE)
        buffer_id = ctypes.c_ulonglong()
        start = ctypes.c_uint64()
        size = ctypes.c_size_t()
        data = (ctypes.c_void_p * 3)(ctypes.addressof(buffer_id),
                                     ctypes.addressof(start),
                                     ctypes.addressof(size))
        buffers = (attrs, data, buffer_id, start, size)
        _query.buffers = buffers
    return buffers


def allocation_of(ptr: int) -> Allocation:
    """The allocation holding device pointer `ptr`, in one driver call."""
    libs = _libs()
    attrs, data, buffer_id, start, size = _query_buffers()
    code = libs.driver.cuPointerGetAttributes(3, attrs, data, ptr)
    if code != 0:
        raise errors.Internal(
            f"cuPointerGetAttributes: {libs.driver_error(code)}")
    if buffer_id.value == 0 or size.value == 0:
        raise errors.InvalidArgument(
            f"address {ptr:#x} is not in a CUDA allocation of this process")
    return Allocation(int(buffer_id.value), int(start.value), int(size.value))


def _int_attribute(ptr: int, attribute: int) -> int:
    """One int-valued CUpointer_attribute of `ptr`."""
    libs = _libs()
    attrs = (ctypes.c_int * 1)(attribute)
    value = ctypes.c_int(-1)
    data = (ctypes.c_void_p * 1)(ctypes.addressof(value))
    code = libs.driver.cuPointerGetAttributes(1, attrs, data, ptr)
    if code != 0:
        raise errors.Internal(
            f"cuPointerGetAttributes: {libs.driver_error(code)}")
    return int(value.value)


def is_ipc_capable(ptr: int) -> bool:
    """Whether cudaIpcGetMemHandle accepts the allocation holding `ptr`."""
    return bool(_int_attribute(ptr, _ATTR_IS_LEGACY_CUDA_IPC_CAPABLE))


def device_of(ptr: int) -> int:
    """The ordinal of the device holding `ptr`."""
    return _int_attribute(ptr, _ATTR_DEVICE_ORDINAL)


def ipc_mem_handle(base: int) -> bytes:
    """The 64-byte cudaIpcMemHandle_t of the allocation starting at `base`."""
    libs = _libs()
    handle = _IpcHandle()
    _check_runtime(libs.runtime.cudaIpcGetMemHandle(ctypes.byref(handle), base),
                   "cudaIpcGetMemHandle")
    # Not handle.reserved: ctypes cuts a char array field at its first NUL.
    return ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES)


def open_mem_handle(handle: bytes, device: int) -> int:
    """Maps another process's allocation on `device`; returns its address.

    The mapping lives until :func:`close_mem_handle`.
    """
    if len(handle) != IPC_HANDLE_BYTES:
        raise errors.InvalidArgument(
            f"CUDA IPC handle: expected {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
    import torch

    libs = _libs()
    raw = _IpcHandle()
    ctypes.memmove(ctypes.addressof(raw), handle, IPC_HANDLE_BYTES)
    ptr = ctypes.c_void_p()
    with torch.cuda.device(device):
        _check_runtime(libs.runtime.cudaIpcOpenMemHandle(
            ctypes.byref(ptr), raw, _IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
            "cudaIpcOpenMemHandle")
    return int(ptr.value or 0)


def close_mem_handle(ptr: int, device: int) -> None:
    """Unmaps memory opened by :func:`open_mem_handle`."""
    import torch

    libs = _libs()
    with torch.cuda.device(device):
        _check_runtime(libs.runtime.cudaIpcCloseMemHandle(ptr),
                       "cudaIpcCloseMemHandle")


# ------------------------------------------------------------------ tensors


_TYPESTR = {"float32": "<f4", "float16": "<f2", "float64": "<f8",
            "int32": "<i4", "int64": "<i8", "int16": "<i2", "uint8": "|u1"}


class DeviceBuffer:
    """Device memory described by ``__cuda_array_interface__`` (version 2,
    no stream: torch reads it without synchronising anything).

    torch keeps this object alive as long as any tensor made from it, and
    this object keeps `owner` alive, so whatever owns the memory outlives
    every view of it.
    """

    def __init__(self, ptr: int, shape: Sequence[int], typestr: str,
                 owner: Any) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": tuple(int(d) for d in shape), "typestr": typestr,
            "data": (int(ptr), False), "strides": None, "version": 2}


def tensor_from_pointer(ptr: int, shape: Sequence[int], dtype: Any,
                        device: Any, owner: Any) -> Any:
    """A contiguous torch tensor of `shape` and `dtype` aliasing device
    memory at `ptr` on `device`; `owner` lives as long as the tensor."""
    import torch

    name = str(dtype).rsplit(".", 1)[-1]
    view_as = None
    if name == "bfloat16":
        typestr, view_as = "<i2", torch.bfloat16
    elif name in _TYPESTR:
        typestr = _TYPESTR[name]
    else:
        raise errors.InvalidArgument(f"tensor_from_pointer: unsupported dtype {dtype}")
    device = torch.device(device)
    if device.type != "cuda":
        raise errors.InvalidArgument("tensor_from_pointer: needs a CUDA device")
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        tensor = torch.as_tensor(DeviceBuffer(ptr, shape, typestr, owner),
                                 device=torch.device("cuda", index))
    if view_as is not None:
        tensor = tensor.view(view_as)
    if tensor.numel() and tensor.data_ptr() != ptr:
        raise errors.Internal(
            f"tensor_from_pointer: torch copied the memory at {ptr:#x} "
            "instead of aliasing it")
    return tensor
