"""The session's CUDA region cache (shm.Session.register_cuda_tensor)
against a simulated caching allocator and daemon: runs without a GPU.

The allocator hands out segments (allocations) at reused addresses with
fresh buffer ids, as cudaMalloc after cudaFree does; the daemon enforces the
per-session region quota. The cache must never exceed it, must reuse one
region for every tensor of a segment, and must drop the region of a segment
freed and reallocated at the same address.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from typing import Dict, List, Tuple

import pytest

from mhc_client import cuda_ipc, errors, shm
from mhc_client._proto import shm_pb2

MAX_REGIONS = 16


class FakeDevice:
    type = "cuda"
    index = 0


class FakeTensor:
    """What register_cuda_tensor reads of a tensor."""

    device = FakeDevice()

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class FakeAllocator:
    """Segments at a few reusable addresses; a new buffer id per allocation."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.live: Dict[int, Tuple[int, int]] = {}  # base -> (buffer id, size)

    def allocate(self, base: int, size: int) -> int:
        self.live[base] = (next(self.ids), size)
        return self.live[base][0]

    def free(self, base: int) -> None:
        del self.live[base]

    def allocation_of(self, ptr: int) -> cuda_ipc.Allocation:
        for base, (buffer_id, size) in self.live.items():
            if base <= ptr < base + size:
                return cuda_ipc.Allocation(buffer_id, base, size)
        raise errors.InvalidArgument(f"{ptr:#x} is not allocated")


class FakeStream:
    """OpenSession: one SessionEvent, then open until the client ends it."""

    def __init__(self, requests) -> None:
        self.requests = requests
        self.sent = False

    def __iter__(self):
        return self

    def __next__(self):
        if not self.sent:
            self.sent = True
            return shm_pb2.SessionEvent(session_id="s1", max_regions=MAX_REGIONS,
                                        max_bytes=1 << 40)
        for _ in self.requests:
            pass
        raise StopIteration


class FakeClient:
    """The daemon's region bookkeeping, with its quota."""

    def __init__(self, allocator: FakeAllocator) -> None:
        self.allocator = allocator
        self.regions: Dict[str, int] = {}  # name -> buffer id
        self.busy: set = set()
        self.registrations = 0

        class Stub:
            def OpenSession(stub_self, requests):  # noqa: N802 - gRPC name
                return FakeStream(requests)

        self._stub = Stub()

    def register_cuda_shared_memory(self, name: str, handle: bytes,
                                    device: int, byte_size: int) -> int:
        if name in self.regions:
            raise errors.AlreadyExists(name)
        if len(self.regions) >= MAX_REGIONS:
            raise errors.ResourceExhausted("region quota")
        buffer_id = int.from_bytes(handle[:8], "little")
        self.regions[name] = buffer_id
        self.registrations += 1
        for base, (live_id, size) in self.allocator.live.items():
            if live_id == buffer_id:
                return size
        raise errors.InvalidArgument("stale handle")

    def unregister_shared_memory(self, name: str) -> List[str]:
        if name in self.busy:
            raise errors.FailedPrecondition(f"{name} in use")
        if name not in self.regions:
            raise errors.NotFound(name)
        del self.regions[name]
        return [name]

    def _forget_session(self, session) -> None:
        pass


@pytest.fixture
def fake(monkeypatch):
    allocator = FakeAllocator()
    monkeypatch.setattr(cuda_ipc, "allocation_of", allocator.allocation_of)

    def handle_of(base: int) -> bytes:
        return allocator.live[base][0].to_bytes(8, "little").ljust(64, b"\0")

    monkeypatch.setattr(cuda_ipc, "ipc_mem_handle", handle_of)
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    client = FakeClient(allocator)
    session = shm.Session(client)
    yield allocator, client, session
    session.close()


def _check(session, client, allocator, tensor: FakeTensor) -> None:
    region, offset = session.register_cuda_tensor(tensor)
    allocation = allocator.allocation_of(tensor.ptr)
    assert region.buffer_id == allocation.buffer_id, "region of another allocation"
    assert region.base + offset == tensor.ptr, "offset does not land on the tensor"
    assert client.regions[region.name] == allocation.buffer_id, \
        "the daemon's region names another allocation (stale mapping)"


def test_one_region_per_allocation_at_any_offset(fake):
    allocator, client, session = fake
    allocator.allocate(0x10000, 1 << 20)
    for offset in (0, 512, 4096, (1 << 20) - 4):
        _check(session, client, allocator, FakeTensor(0x10000 + offset))
    assert client.registrations == 1


def test_reallocated_address_is_registered_anew_and_the_old_region_dropped(fake):
    allocator, client, session = fake
    allocator.allocate(0x10000, 1 << 20)
    first, _ = session.register_cuda_tensor(FakeTensor(0x10040))
    allocator.free(0x10000)
    allocator.allocate(0x10000, 1 << 21)  # same address, new allocation
    second, _ = session.register_cuda_tensor(FakeTensor(0x10040))
    assert second.name != first.name
    assert first.name not in client.regions, "the freed allocation's region stayed"
    assert second.byte_size == 1 << 21


def test_ten_thousand_steps_never_exceed_the_quota(fake):
    allocator, client, session = fake
    rng = random.Random(7)
    bases = [0x100000 * (i + 1) for i in range(3 * MAX_REGIONS)]
    for step in range(10_000):
        # Shapes change every step: the allocator frees and reallocates a
        # few segments, sometimes at the same address with another size.
        for _ in range(rng.randint(0, 3)):
            base = rng.choice(bases)
            if base in allocator.live:
                allocator.free(base)
            allocator.allocate(base, rng.choice((1 << 16, 1 << 18, 1 << 20)))
        live = list(allocator.live.items())
        request = rng.sample(live, min(len(live), rng.randint(1, 8)))
        with session.pinned_cuda_regions() as pins:
            for base, (_, size) in request:
                region, offset = session.register_cuda_tensor(
                    FakeTensor(base + rng.randrange(0, size, 4)), pins)
                assert client.regions.get(region.name) == region.buffer_id
            # Every region of this request is still registered.
            named = {session._cuda[b].name for b in pins}
            assert named <= set(client.regions)
        assert len(client.regions) <= session.cuda_capacity < MAX_REGIONS, \
            f"step {step}: {len(client.regions)} regions registered"
    assert client.registrations > MAX_REGIONS  # the cache did evict


def test_busy_region_is_unregistered_later(fake):
    allocator, client, session = fake
    for i in range(session.cuda_capacity):
        allocator.allocate(0x100000 * (i + 1), 4096)
        session.register_cuda_tensor(FakeTensor(0x100000 * (i + 1)))
    oldest = next(iter(session._cuda.values())).name
    client.busy.add(oldest)
    allocator.allocate(0x7000000, 4096)
    session.register_cuda_tensor(FakeTensor(0x7000000))
    assert oldest in client.regions and oldest in session.cuda_region_names()
    client.busy.clear()
    allocator.allocate(0x8000000, 4096)
    session.register_cuda_tensor(FakeTensor(0x8000000))
    assert oldest not in client.regions, "the parked region was never retried"
    assert len(client.regions) <= session.cuda_capacity


def test_native_table_follows_the_session(fake):
    """The native call path's table (shm.Session.cuda_table) holds exactly
    the session's registered allocations, through registrations, LRU
    evictions and reallocations at reused addresses, and eviction takes the
    allocation used least recently."""
    allocator, client, session = fake
    table = session.cuda_table
    if table is None:
        pytest.skip("the native extension is not built")
    rng = random.Random(7)
    seen = set()
    for step in range(500):
        base = 0x1000_0000 * rng.randint(1, 40)
        if base in allocator.live and rng.random() < 0.3:
            allocator.free(base)
        if base not in allocator.live:
            allocator.allocate(base, 1 << 20)
        _check(session, client, allocator, FakeTensor(base + 64))
        seen.add(allocator.live[base][0])
        for buffer_id in seen:
            registered = buffer_id in session._cuda
            assert (table.last_use(buffer_id) > 0) == registered, \
                f"step {step}: buffer {buffer_id} registered={registered}"
    session.forget_cuda()
    assert all(table.last_use(b) == 0 for b in seen)

    # Fill the quota, use the first again: the second is evicted.
    bases = [0x1000_0000 * (100 + i) for i in range(session.cuda_capacity + 1)]
    ids = [allocator.allocate(base, 1 << 20) for base in bases]
    for base in bases[:-1]:
        _check(session, client, allocator, FakeTensor(base))
    _check(session, client, allocator, FakeTensor(bases[0] + 8))
    _check(session, client, allocator, FakeTensor(bases[-1]))
    assert ids[0] in session._cuda and ids[1] not in session._cuda
    assert table.last_use(ids[1]) == 0 and not table.in_use(ids[0])
    # An idle allocation goes; one the table does not hold counts as gone.
    assert table.remove_if_idle(ids[0]) and table.last_use(ids[0]) == 0
    assert table.remove_if_idle(ids[1])
