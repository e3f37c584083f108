"""Zero-copy tensors for clients on the daemon's node (see shm.proto).

A :class:`Session` is the OpenSession stream, held open by this client; its
id goes out with every call of the client while it is open. Regions belong
to the session: :meth:`Session.create_region` makes a POSIX shared-memory
object, maps it here and registers it with the daemon; numpy views onto it
(:meth:`Region.ndarray`) can be passed to any compute call as inputs or as
``out=`` destinations, and the client sends them as region references
instead of bytes.

Cleanup: closing the session (or the client, or leaving its ``with``
block) unregisters every region in the daemon, unmaps it here and unlinks
the POSIX object; the same happens when the Session or Region is garbage
collected, and the daemon drops a session's regions by itself when the
stream ends (e.g. this process dies).

CUDA tensors (torch) are shared with :meth:`Session.register_cuda_tensor`:
one region per CUDA allocation (a segment of torch's caching allocator),
registered whole the first time a tensor inside it is used and reused for
every tensor in it at any offset. Allocations are told apart by the
driver's buffer id, so a segment freed and allocated again at the same
address is registered anew (and the old region unregistered), never read
through a stale mapping. The cache is bounded below the session's region
quota: the least recently used allocation is unregistered to make room.

Host tensors in transit (the torch layer's CPU path) go through the
session's :class:`HostArena`, one region that grows geometrically and is
registered again only when it grows.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import mmap
import os
import queue
import secrets
import threading
import time
import weakref
from typing import (Any, Dict, Iterator, List, NamedTuple, Optional,
                    Sequence, Set, Tuple, Union)

import grpc
import numpy as np

from . import errors, tensors
from . import native as native_path
from ._proto import shm_pb2, tensor_pb2

try:  # CPython's own binding of shm_open/shm_unlink (multiprocessing uses it).
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX platforms
    _posixshmem = None

DEFAULT_KEY_PREFIX = "mhcd_"
ALIGNMENT = 64
_counter = itertools.count()


# Random per process: the pid alone repeats, and a process killed before it
# unlinked its objects leaves their names behind for the next of its pid.
_NONCE = secrets.token_hex(4)


def unique_key(prefix: str = DEFAULT_KEY_PREFIX, tag: str = "r") -> str:
    """A POSIX shm name unique to this process:
    ``<prefix><pid>_<nonce>_<n>_<tag>``."""
    return f"{prefix}{os.getpid()}_{_NONCE}_{next(_counter)}_{tag}"


def _shm_open(key: str, create: bool, size: int = 0) -> Tuple[int, int]:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    if _posixshmem is not None:
        fd = _posixshmem.shm_open("/" + key, flags, mode=0o600)
    else:  # pragma: no cover
        fd = os.open(os.path.join("/dev/shm", key), flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        return fd, os.fstat(fd).st_size
    except BaseException:
        os.close(fd)
        raise


def _shm_unlink(key: str) -> None:
    try:
        if _posixshmem is not None:
            _posixshmem.shm_unlink("/" + key)
        else:  # pragma: no cover
            os.unlink(os.path.join("/dev/shm", key))
    except FileNotFoundError:
        pass


class SharedMemoryObject:
    """A POSIX shared-memory object mapped read-write into this process.

    ``create`` makes a new object (the key must not exist) and unlinks it on
    :meth:`close`; ``open`` maps an existing one and never unlinks it.
    """

    def __init__(self, key: str, size: int = 0, create: bool = True) -> None:
        if create and size < 1:
            raise errors.InvalidArgument("shared memory: size must be >= 1")
        self.key = key
        self.owned = create
        try:
            fd, actual = _shm_open(key, create, size)
        except FileExistsError:
            raise errors.AlreadyExists(f"shared memory object exists: {key}") from None
        except FileNotFoundError:
            raise errors.NotFound(f"no shared memory object: {key}") from None
        try:
            self.size = actual
            self._mmap = mmap.mmap(fd, actual)
        finally:
            os.close(fd)
        self._base = np.frombuffer(self._mmap, dtype=np.uint8)
        self.address = int(self._base.ctypes.data)
        self._finalizer = weakref.finalize(
            self, SharedMemoryObject._release, self._mmap, key, create)

    @staticmethod
    def _release(mapping: mmap.mmap, key: str, unlink: bool) -> None:
        if unlink:
            _shm_unlink(key)
        try:
            mapping.close()
        except BufferError:
            # numpy views are still alive; the mapping goes with the last one.
            pass

    @property
    def buffer(self) -> np.ndarray:
        """The whole object as a uint8 array (a view)."""
        return self._base

    def close(self) -> None:
        """Unlinks (if created here) and unmaps once no view is left."""
        self._base = np.empty(0, np.uint8)
        self._finalizer()


class Region:
    """A registered byte range of a shared-memory object, with numpy views.

    A region made by :meth:`Session.create_region` also hands out aligned
    slices with :meth:`alloc` (a bump allocator; :meth:`reset` starts over).
    """

    def __init__(self, session: "Session", name: str, obj: SharedMemoryObject,
                 offset: int, byte_size: int) -> None:
        self.session = session
        self.name = name
        self.object = obj
        self.offset = offset
        self.byte_size = byte_size
        self.address = obj.address + offset
        self._next = 0
        self.closed = False

    def ndarray(self, dtype: Any, shape: Sequence[int], offset: int = 0
                ) -> np.ndarray:
        """A numpy view of `shape` at byte `offset` of the region.

        ``dtype`` is a numpy dtype, or "bf16" for uint16 bit patterns.
        """
        np_dtype = np.dtype(np.uint16) if dtype in ("bf16", "bfloat16") else np.dtype(dtype)
        count = int(math.prod(shape))  # np.prod costs microseconds a call
        end = offset + count * np_dtype.itemsize
        if offset < 0 or end > self.byte_size:
            raise errors.InvalidArgument(
                f"region '{self.name}': [{offset}, {end}) outside its "
                f"{self.byte_size} bytes")
        start = self.offset + offset
        return np.frombuffer(self.object.buffer, dtype=np_dtype, count=count,
                             offset=start).reshape(tuple(shape))

    def alloc(self, dtype: Any, shape: Sequence[int]) -> np.ndarray:
        """The next free ALIGNMENT-aligned view of `shape` in the region."""
        np_dtype = np.dtype(np.uint16) if dtype in ("bf16", "bfloat16") else np.dtype(dtype)
        count = int(math.prod(shape))  # np.prod costs microseconds a call
        view = self.ndarray(np_dtype, shape, self._next)
        self._next += aligned(count * np_dtype.itemsize)
        return view

    def put(self, array: Any, dtype: tensors.DTypeLike = None) -> np.ndarray:
        """Copies `array` (converted to its wire dtype) into a new slice."""
        _, wire = tensors.encode(array, dtype)
        view = self.alloc(wire.dtype, wire.shape)
        view[...] = wire
        return view

    def reset(self) -> None:
        self._next = 0

    def contains(self, address: int, nbytes: int) -> bool:
        return self.address <= address and address + nbytes <= self.address + self.byte_size

    def shm_ref(self, offset: int, nbytes: int) -> tensor_pb2.SharedMemoryRef:
        return tensor_pb2.SharedMemoryRef(region=self.name, offset=offset,
                                          byte_size=nbytes)

    def close(self) -> None:
        """Unregisters the region and releases its object. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.session._drop_region(self)


class CudaRegion(NamedTuple):
    """A registered CUDA allocation (see :meth:`Session.register_cuda_tensor`)."""

    name: str
    device: int
    base: int        # device address of the allocation's start
    byte_size: int
    buffer_id: int = 0  # the driver's id of the allocation


class CudaIpcHandle(NamedTuple):
    """Where a CUDA tensor lives, as another process can open it."""

    handle: bytes        # 64-byte cudaIpcMemHandle_t of the allocation
    device: int          # CUDA ordinal
    base: int            # device address of the allocation's start
    offset: int          # byte offset of the tensor's first element in it
    region_bytes: int    # bytes of the whole allocation


def cuda_ipc_handle(tensor: Any) -> CudaIpcHandle:
    """The IPC handle of a torch CUDA tensor's allocation and its offset.

    torch's caching allocator carves tensors out of larger allocations; the
    handle names the allocation, and the tensor's offset in it is its
    address minus the allocation's start.
    """
    import torch

    from . import cuda_ipc

    if not (isinstance(tensor, torch.Tensor) and tensor.is_cuda):
        raise errors.InvalidArgument("cuda_ipc_handle: expected a CUDA tensor")
    ptr = tensor.data_ptr()
    allocation = cuda_ipc.allocation_of(ptr)
    device = tensor.device.index
    with torch.cuda.device(device):
        handle = cuda_ipc.ipc_mem_handle(allocation.base)
    return CudaIpcHandle(handle=handle, device=device, base=allocation.base,
                         offset=ptr - allocation.base,
                         region_bytes=allocation.size)


class HostArena:
    """The session's region for host tensors in transit.

    One region, grown geometrically (registered anew only when it grows),
    handed out whole to one request at a time: hold :attr:`lock` from
    :meth:`reserve` until the request's outputs were read.
    """

    MIN_BYTES = 1 << 20

    def __init__(self, session: "Session") -> None:
        self.session = session
        self.lock = threading.Lock()
        self.region: Optional[Region] = None
        self.growths = 0

    def reserve(self, nbytes: int) -> Region:
        """The arena's region, at least `nbytes` long."""
        current = self.region
        if current is not None and not current.closed and current.byte_size >= nbytes:
            return current
        grown = max(self.MIN_BYTES, 2 * (current.byte_size if current else 0))
        if self.session.max_bytes:
            grown = min(grown, self.session.max_bytes)
        size = -(-max(nbytes, grown) // self.MIN_BYTES) * self.MIN_BYTES
        self.region = None
        if current is not None:
            current.close()
        self.region = self.session.create_region(f"arena{next(_counter)}", size)
        self.growths += 1
        return self.region


# The region a native client's call ring takes in its session (see
# mhc_client.native); the C++ client names it the same.
CALL_RING_REGION = "call_ring"


class Session:
    """An open shared-memory session of a :class:`~mhc_client.Client`.

    Opening it starts the OpenSession stream and waits for the daemon's
    first event (the session id and quotas). Use as a context manager or
    call :meth:`close`; the client closes it too.
    """

    def __init__(self, client: Any, key_prefix: str = DEFAULT_KEY_PREFIX,
                 timeout: Optional[float] = None) -> None:
        self._client = client
        self.key_prefix = key_prefix
        self.closed = False
        self._regions: Dict[str, Region] = {}
        # CUDA allocations by buffer id, least recently used first.
        self._cuda: "collections.OrderedDict[int, CudaRegion]" = \
            collections.OrderedDict()
        self._cuda_at: Dict[Tuple[int, int], int] = {}  # (device, base) -> id
        # Evicted regions whose unregistration the daemon refused while a
        # request used them; retried before each registration.
        self._cuda_parked: List[str] = []
        # Buffer ids named by requests being built (never evicted meanwhile).
        self._cuda_pins: Dict[int, Set[int]] = {}
        self._cuda_lock = threading.RLock()
        # The same allocations for the native call path (None without the
        # extension): see mhc_client.native.cuda_region_table.
        self.cuda_table: Any = native_path.cuda_region_table()
        self._event_pools: Dict[int, Any] = {}  # device -> EventPool or None
        # device -> the wait event of deferred calls (index, cudaEvent_t), or
        # None where calls are not deferred (see deferred_wait_event).
        self._deferred_waits: Dict[int, Optional[Tuple[int, int]]] = {}
        self._arena: Optional[HostArena] = None
        self.cuda_registrations = 0
        self.cuda_unregistrations = 0
        self._lock = threading.Lock()
        self._on_close: List[Any] = []
        # Whether region CALL_RING_REGION carries this session's calls.
        self.call_ring = False
        self._stop: "queue.Queue[None]" = queue.Queue()
        self._stream = client._stub.OpenSession(self._requests())
        try:
            first = next(self._stream)
        except grpc.RpcError as error:
            self._stop.put(None)
            raise errors.from_rpc_error(error, "OpenSession") from None
        except StopIteration:
            raise errors.Unavailable("OpenSession: the stream ended at once") from None
        self.id: str = first.session_id
        self.max_regions: int = first.max_regions
        self.max_bytes: int = first.max_bytes
        self._finalizer = weakref.finalize(self, Session._end_stream,
                                           self._stop, self._stream)

    def _requests(self) -> Any:
        # Nothing is sent; the stream is half-closed when close() says so.
        self._stop.get()
        return
        yield  # pragma: no cover - makes this a generator

    @staticmethod
    def _end_stream(stop: "queue.Queue[None]", stream: Any) -> None:
        stop.put(None)
        try:
            for _ in stream:
                pass
        except grpc.RpcError:
            pass

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ regions

    def create_region(self, name: str, byte_size: int,
                      key: Optional[str] = None) -> Region:
        """Creates a POSIX object of `byte_size` bytes and registers it."""
        self._check_open()
        obj = SharedMemoryObject(key or unique_key(self.key_prefix, name),
                                 byte_size, create=True)
        try:
            self._client.register_system_shared_memory(name, obj.key, 0, byte_size)
        except BaseException:
            obj.close()
            raise
        region = Region(self, name, obj, 0, byte_size)
        with self._lock:
            self._regions[name] = region
        return region

    def register_object(self, name: str, obj: SharedMemoryObject,
                        offset: int = 0, byte_size: Optional[int] = None
                        ) -> Region:
        """Registers part of an existing object (its owner keeps it)."""
        self._check_open()
        size = obj.size - offset if byte_size is None else byte_size
        self._client.register_system_shared_memory(name, obj.key, offset, size)
        region = Region(self, name, obj, offset, size)
        region._owns_object = False  # type: ignore[attr-defined]
        with self._lock:
            self._regions[name] = region
        return region

    def region(self, name: str) -> Region:
        return self._regions[name]

    @property
    def regions(self) -> List[Region]:
        return list(self._regions.values())

    def status(self) -> shm_pb2.SharedMemoryStatusResponse:
        return self._client.shared_memory_status()

    def _drop_region(self, region: Region) -> None:
        with self._lock:
            self._regions.pop(region.name, None)
        try:
            if not self.closed:
                self._client.unregister_shared_memory(region.name)
        finally:
            if getattr(region, "_owns_object", True):
                region.object.close()

    # --------------------------------------------------- tensor references

    def _find(self, address: int, nbytes: int) -> Optional[Tuple[Region, int]]:
        for region in self._regions.values():
            if region.contains(address, nbytes):
                return region, address - region.address
        return None

    def shm_ref(self, array: np.ndarray) -> Optional[tensor_pb2.SharedMemoryRef]:
        """The region reference of a contiguous view of one of our regions."""
        if not array.flags.c_contiguous:
            return None
        found = self._find(int(array.ctypes.data), array.nbytes)
        if found is None:
            return None
        region, offset = found
        return region.shm_ref(offset, array.nbytes)

    def tensor_ref(self, array: np.ndarray, dtype: tensors.DTypeLike
                   ) -> Optional[tensor_pb2.TensorRef]:
        """A TensorRef naming `array`'s bytes in place, or None.

        Only when the array already has the wire dtype (no conversion is
        possible in place) and lies inside a registered region.
        """
        code = tensors.dtype_code(dtype) if dtype is not None else None
        wire_code, _ = tensors.encode(array[:0] if array.ndim else array, None)
        if code is not None and code != wire_code:
            return None
        ref = self.shm_ref(array)
        if ref is None:
            return None
        return tensor_pb2.TensorRef(dtype=wire_code, shape=list(array.shape),
                                    shm=ref)

    def view_of(self, ref: tensor_pb2.TensorRef
                ) -> Union[np.ndarray, tensor_pb2.TensorRef]:
        """The numpy view of an output the daemon wrote into our region.

        An output in a CUDA region has no host view: the daemon wrote into
        the caller's device tensor, and its TensorRef comes back as is.
        """
        if ref.shm.region not in self._regions and \
                ref.shm.region in self.cuda_region_names():
            return ref
        region = self._regions.get(ref.shm.region)
        if region is None:
            raise errors.NotFound(f"output in unknown region '{ref.shm.region}'")
        np_dtype = {tensors.F32: np.float32, tensors.F16: np.float16,
                    tensors.BF16: np.uint16}[ref.dtype]
        view = region.ndarray(np_dtype, list(ref.shape), ref.shm.offset)
        if ref.dtype == tensors.BF16 and tensors.BFLOAT16 is not None \
                and self._client.bf16 != "uint16":
            view = view.view(tensors.BFLOAT16)
        return view

    # --------------------------------------------------------------- CUDA

    @property
    def cuda_capacity(self) -> int:
        """How many CUDA allocations stay registered at most: the session's
        region quota less a margin and the host regions."""
        margin = max(1, min(8, self.max_regions // 8))
        return max(1, self.max_regions - margin - len(self._regions)
                   - int(self.call_ring))

    def cuda_region_names(self) -> Set[str]:
        with self._cuda_lock:
            return {r.name for r in self._cuda.values()} | set(self._cuda_parked)

    @contextlib.contextmanager
    def pinned_cuda_regions(self) -> Iterator[Set[int]]:
        """A set to pass as ``pins`` to :meth:`register_cuda_tensor` while
        building one request: the allocations it names are not evicted to
        make room for others of the same request."""
        pins: Set[int] = set()
        with self._cuda_lock:
            self._cuda_pins[id(pins)] = pins
        try:
            yield pins
        finally:
            with self._cuda_lock:
                self._cuda_pins.pop(id(pins), None)

    def register_cuda_tensor(self, tensor: Any, pins: Optional[Set[int]] = None
                             ) -> Tuple[CudaRegion, int]:
        """The region holding `tensor` and the tensor's byte offset in it.

        The allocation holding the tensor is registered whole the first
        time and reused afterwards (one driver query per call); see the
        module docstring for when regions are unregistered.
        """
        from . import cuda_ipc

        self._check_open()
        ptr = tensor.data_ptr()
        allocation = cuda_ipc.allocation_of(ptr)
        with self._cuda_lock:
            region = self._cuda.get(allocation.buffer_id)
            if region is None:
                region = self._register_allocation(allocation, tensor.device.index)
            else:
                self._cuda.move_to_end(allocation.buffer_id)
                if self.cuda_table is not None:  # marks it used now
                    self.cuda_table.add(region.buffer_id, region.base, region.name)
            if pins is not None:
                pins.add(allocation.buffer_id)
        return region, ptr - region.base

    def _register_allocation(self, allocation: Any, device: int) -> CudaRegion:
        import torch

        from . import cuda_ipc

        # Another allocation at this address means the old one was freed.
        stale = self._cuda_at.get((device, allocation.base))
        if stale is not None and stale != allocation.buffer_id:
            self._evict(stale)
        self._make_room()
        with torch.cuda.device(device):
            handle = cuda_ipc.ipc_mem_handle(allocation.base)
        name = f"cuda{device}_{allocation.buffer_id}"
        try:
            registered = self._client.register_cuda_shared_memory(
                name, handle, device, 0)
        except errors.AlreadyExists:  # left over from a failed unregistration
            self._unregister_name(name)
            registered = self._client.register_cuda_shared_memory(
                name, handle, device, 0)
        region = CudaRegion(name, device, allocation.base, registered,
                            allocation.buffer_id)
        self._cuda[allocation.buffer_id] = region
        self._cuda_at[(device, allocation.base)] = allocation.buffer_id
        if self.cuda_table is not None:
            self.cuda_table.add(allocation.buffer_id, allocation.base, name)
        self.cuda_registrations += 1
        return region

    def _make_room(self) -> None:
        """Unregisters least recently used allocations until one more fits."""
        deadline = time.monotonic() + 30.0
        while True:
            self._retry_parked()
            if len(self._cuda) + len(self._cuda_parked) < self.cuda_capacity:
                return
            victim = self._eviction_victim()
            if victim is not None:
                # A native call may have named it since it was chosen.
                if self.cuda_table is None or self.cuda_table.remove_if_idle(victim):
                    self._evict(victim)
                continue
            if not self._cuda_parked or time.monotonic() > deadline:
                raise errors.ResourceExhausted(
                    f"CUDA regions: {len(self._cuda)} allocations are named by "
                    f"requests in progress and {len(self._cuda_parked)} are "
                    f"still in use, the most this session holds "
                    f"({self.cuda_capacity} of --shm_max_regions_per_session "
                    f"{self.max_regions})")
            time.sleep(0.01)

    def _eviction_victim(self) -> Optional[int]:
        """The least recently used allocation that no request being built
        or (native path) in flight names."""
        pinned = set().union(*self._cuda_pins.values()) if self._cuda_pins else set()
        table = self.cuda_table
        free = [b for b in self._cuda
                if b not in pinned and not (table is not None and table.in_use(b))]
        if not free:
            return None
        return min(free, key=table.last_use) if table is not None else free[0]

    def _evict(self, buffer_id: int) -> None:
        if self.call_ring:
            # A deferred call naming the region may not have reached the
            # daemon yet. Raises that call's error, if it failed, before
            # anything changes here.
            self._client.flush()
        region = self._cuda.pop(buffer_id)
        if self.cuda_table is not None:
            self.cuda_table.remove(buffer_id)
        if self._cuda_at.get((region.device, region.base)) == buffer_id:
            del self._cuda_at[(region.device, region.base)]
        self._unregister_name(region.name)

    def _unregister_name(self, name: str) -> None:
        try:
            self._client.unregister_shared_memory(name)
            self.cuda_unregistrations += 1
        except errors.FailedPrecondition:  # in use by a running request
            if name not in self._cuda_parked:
                self._cuda_parked.append(name)
        except errors.NotFound:
            pass

    def _retry_parked(self) -> None:
        parked, self._cuda_parked = self._cuda_parked, []
        for name in parked:
            self._unregister_name(name)

    def cuda_tensor_ref(self, tensor: Any, pins: Optional[Set[int]] = None
                        ) -> tensor_pb2.TensorRef:
        """A TensorRef naming a contiguous torch CUDA tensor in place."""
        if not tensor.is_contiguous():
            raise errors.InvalidArgument("cuda_tensor_ref: tensor not contiguous")
        region, offset = self.register_cuda_tensor(tensor, pins)
        code = torch_dtype_code(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        return tensor_pb2.TensorRef(
            dtype=code, shape=list(tensor.shape),
            shm=tensor_pb2.SharedMemoryRef(region=region.name, offset=offset,
                                           byte_size=nbytes))

    def cuda_output_ref(self, tensor: Any, pins: Optional[Set[int]] = None
                        ) -> tensor_pb2.SharedMemoryRef:
        """An ``out=`` destination for a contiguous torch CUDA tensor."""
        return self.cuda_tensor_ref(tensor, pins).shm

    def forget_cuda(self) -> None:
        """Unregisters every CUDA allocation of the session."""
        with self._cuda_lock:
            for buffer_id in list(self._cuda):
                self._evict(buffer_id)
            self._retry_parked()

    def cuda_events(self, device: int) -> Any:
        """The session's :class:`~mhc_client.cuda_events.EventPool` for
        `device`, registered with the daemon on first use; None when the
        daemon does not take events (it then answers after the work)."""
        pool = self._event_pools.get(device, self)
        if pool is not self:
            return pool
        from .cuda_events import EventPool

        with self._cuda_lock:
            if device not in self._event_pools:
                self._check_open()
                try:
                    self._event_pools[device] = EventPool(self._client, device)
                except (errors.Unimplemented, errors.FailedPrecondition):
                    self._event_pools[device] = None
            return self._event_pools[device]

    def deferred_wait_event(self, device: int) -> Optional[Tuple[int, int]]:
        """The (index, cudaEvent_t) of the event that deferred calls on
        `device` record, enabling them on first use; None where calls on
        CUDA tensors are not deferred (no call ring, no events, or a driver
        that cannot wait on host memory). Call with `device`'s context
        current."""
        if device in self._deferred_waits:
            return self._deferred_waits[device]
        with self._cuda_lock:
            if device not in self._deferred_waits:
                pool = self.cuda_events(device)
                connection = self._client.native
                wait = None
                if (pool is not None and self.call_ring
                        and connection.enable_deferred_calls()):
                    index = pool.reserve_wait()
                    wait = (index, pool.wait_handles[index])
                self._deferred_waits[device] = wait
            return self._deferred_waits[device]

    def host_arena(self) -> HostArena:
        """The session's arena for host tensors in transit."""
        with self._lock:
            if self._arena is None:
                self._arena = HostArena(self)
            return self._arena

    # -------------------------------------------------------------- close

    def _check_open(self) -> None:
        if self.closed:
            raise errors.FailedPrecondition("the shared-memory session is closed")

    def on_close(self, callback: Any) -> None:
        """Calls `callback()` when the session closes, before its stream
        ends."""
        self._on_close.append(callback)

    def close(self) -> None:
        """Ends the session: the daemon unregisters its regions; objects
        created here are unmapped and unlinked. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for callback in self._on_close:
            callback()
        self._finalizer()  # half-closes the stream and drains it
        for region in list(self._regions.values()):
            region.closed = True
            if getattr(region, "_owns_object", True):
                region.object.close()
        self._regions.clear()
        with self._cuda_lock:
            self._cuda.clear()
            if self.cuda_table is not None:
                self.cuda_table.clear()
            self._cuda_at.clear()
            self._cuda_parked.clear()
            self._event_pools.clear()
            self._deferred_waits.clear()
        self._arena = None
        self._client._forget_session(self)


_TORCH_CODES: Dict[Any, int] = {}


def torch_dtype_code(tensor: Any) -> int:
    """The wire dtype of a torch tensor (INVALID_ARGUMENT for others)."""
    if not _TORCH_CODES:  # torch is imported only by torch users
        import torch

        _TORCH_CODES.update({torch.float32: tensors.F32,
                             torch.float16: tensors.F16,
                             torch.bfloat16: tensors.BF16})
    code = _TORCH_CODES.get(tensor.dtype)
    if code is None:
        raise errors.InvalidArgument(f"unsupported tensor dtype {tensor.dtype}")
    return code


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to ALIGNMENT (at least one ALIGNMENT)."""
    return -(-max(nbytes, 1) // ALIGNMENT) * ALIGNMENT
