"""CUDA IPC plumbing of the torch layer: mhc_client.cuda_ipc and the event
pool, against a stand-in daemon process (no mhcd needed), and the torch
layer on CUDA tensors through the test daemon. Needs a GPU (skipped
without one)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from typing import List

import pytest
import torch
from torch import nn

from mhc_client import Client, cuda_ipc, eager
from mhc_client.cuda_events import EventPool
from mhc_client.shm import cuda_ipc_handle
from mhc_client.torch import MhcLayer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_ipc_handle_accounts_for_offsets():
    base = torch.zeros(1024, device="cuda")
    view = base[100:200]
    whole, part = cuda_ipc_handle(base), cuda_ipc_handle(view)
    assert whole.handle == part.handle and len(part.handle) == 64
    assert part.offset - whole.offset == 100 * 4
    assert part.region_bytes >= part.offset + 100 * 4
    assert whole.handle.count(0) < 64, "an empty handle"


def test_allocation_of_names_the_segment():
    a = torch.empty(1000, device="cuda")
    b = a[500:]
    whole, part = cuda_ipc.allocation_of(a.data_ptr()), cuda_ipc.allocation_of(b.data_ptr())
    assert whole == part, "two views of one storage lie in different allocations"
    assert whole.base <= a.data_ptr() and b.data_ptr() + 500 * 4 <= whole.base + whole.size
    assert cuda_ipc.is_ipc_capable(a.data_ptr())
    assert cuda_ipc.device_of(a.data_ptr()) == a.device.index


def test_reallocated_segment_gets_a_new_buffer_id():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    first = cuda_ipc.allocation_of(x.data_ptr())
    del x
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    y = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    second = cuda_ipc.allocation_of(y.data_ptr())
    assert second.buffer_id != first.buffer_id, \
        f"a new allocation (at {second.base:#x}, was {first.base:#x}) kept the old buffer id"


class _Owner:
    pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_from_pointer_aliases_and_keeps_its_owner(dtype):
    base = torch.arange(16, device="cuda").to(dtype)
    owner = _Owner()
    alive = weakref.ref(owner)
    size = base.element_size()
    alias = cuda_ipc.tensor_from_pointer(base.data_ptr() + 4 * size, (2, 2), dtype,
                                         base.device, owner)
    del owner
    gc.collect()
    assert alive() is not None, "the owner died while a tensor aliases its memory"
    assert alias.dtype == dtype and alias.shape == (2, 2)
    assert alias.data_ptr() == base.data_ptr() + 4 * size
    assert alias.flatten().float().tolist() == [4.0, 5.0, 6.0, 7.0]
    alias.fill_(-1)
    assert base[4:8].float().tolist() == [-1.0] * 4
    del alias
    gc.collect()
    assert alive() is None, "the owner outlived every tensor made from it"


# A stand-in for the daemon's side of shm.proto's "Stream order": it maps the
# client's memory, opens the client's events, and for each request waits on
# event i, runs a slow kernel that writes out = 2 x + 1, records its event j
# and answers at once, without synchronising.
_FAKE_DAEMON = r"""
import sys
import torch
from mhc_client import cuda_ipc

torch.cuda.set_device(0)
stream = torch.cuda.Stream()
theirs, mine, base = [], [], 0
for line in sys.stdin:
    words = line.split()
    if words[0] == "events":
        where = torch.device("cuda", 0)
        theirs = [torch.cuda.Event.from_ipc_handle(where, bytes.fromhex(h))
                  for h in words[1:]]
        mine = [torch.cuda.Event(enable_timing=False, blocking=False,
                                 interprocess=True) for _ in theirs]
        reply = "events " + " ".join(bytes(e.ipc_handle()).hex() for e in mine)
    elif words[0] == "mem":
        base = cuda_ipc.open_mem_handle(bytes.fromhex(words[1]), 0)
        reply = "ok"
    elif words[0] == "run":
        i, j, src, dst, count = map(int, words[1:])
        x = cuda_ipc.tensor_from_pointer(base + src, (count,), torch.float32,
                                         "cuda:0", None)
        out = cuda_ipc.tensor_from_pointer(base + dst, (count,), torch.float32,
                                           "cuda:0", None)
        stream.wait_event(theirs[i])
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)
            out.copy_(x * 2 + 1)
        mine[j].record(stream)
        reply = "done"
    else:
        torch.cuda.synchronize()
        cuda_ipc.close_mem_handle(base, 0)
        reply = "bye"
    print(reply, flush=True)
    if reply == "bye":
        break
"""


class _FakeDaemon:
    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.proc = subprocess.Popen([sys.executable, "-c", _FAKE_DAEMON],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline().strip()
        assert reply, f"the stand-in daemon died (exit {self.proc.poll()})"
        return reply

    # The one Client method EventPool calls.
    def register_cuda_events(self, device: int, handles: List[bytes]) -> List[bytes]:
        reply = self.ask("events " + " ".join(h.hex() for h in handles)).split()
        assert reply[0] == "events"
        return [bytes.fromhex(h) for h in reply[1:]]

    def close(self) -> None:
        try:
            self.ask("quit")
        finally:
            self.proc.wait(30)


def test_memory_and_events_order_two_processes_without_host_syncs():
    torch.cuda.set_device(0)
    count = 1 << 20
    buffer = torch.zeros(2 * count, device="cuda:0")
    allocation = cuda_ipc.allocation_of(buffer.data_ptr())
    src = buffer.data_ptr() - allocation.base
    dst = src + count * 4
    daemon = _FakeDaemon()
    try:
        assert daemon.ask("mem " + cuda_ipc.ipc_mem_handle(allocation.base).hex()) == "ok"
        pool = EventPool(daemon, 0, size=4)
        stream = torch.cuda.current_stream()
        results = []
        for step in range(6):
            # Slow writes of this step's input: the daemon must wait for them.
            torch.cuda._sleep(20_000_000)
            buffer[:count].fill_(float(step))
            i, j = pool.acquire()
            pool.record_wait(i, stream)
            assert daemon.ask(f"run {i} {j} {src} {dst} {count}") == "done"
            pool.wait_signal(j, stream)
            pool.release(i, j)
            # Read after the daemon's slow kernel: must see its output.
            results.append(buffer[count:].clone())
        torch.cuda.synchronize()
        for step, out in enumerate(results):
            want = 2.0 * step + 1.0
            assert bool((out == want).all()), \
                f"step {step}: read {out[:4].tolist()}..., want {want} (stream order broken)"
    finally:
        daemon.close()


@pytest.fixture
def own_client(daemon):
    """A client of its own: its session's CUDA regions stay out of the
    shared client's session."""
    with Client(daemon.address, timeout=60) as client:
        client.wait_for_ready(30)
        yield client


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_on_cuda_tensors(own_client: Client, dtype):
    client = own_client
    torch.manual_seed(0)
    sub = nn.Linear(16, 16).to(device="cuda", dtype=dtype)
    # IEEE projection so fp32 holds its 1e-4 bound on a CUDA daemon too.
    layer = MhcLayer(client, 16, n=4, sublayer=sub, seed=1,
                     matmul_precision="ieee").cuda()
    try:
        x = torch.randn(6, 4, 16, device="cuda", dtype=dtype, requires_grad=True)
        out = layer(x.to(dtype))
        assert out.device.type == "cuda" and out.dtype == dtype
        out.float().square().sum().backward()
        params = {k: getattr(layer, k).detach().double().cpu().requires_grad_()
                  for k in layer.param_names}
        sub64 = nn.Linear(16, 16).double()
        sub64.load_state_dict({k: v.double().cpu() for k, v in sub.state_dict().items()})
        x64 = x.detach().double().cpu().requires_grad_()
        ref = eager.layer(x64, params, layer.spec, sub64)
        ref.square().sum().backward()
        tol = 1e-4 if dtype == torch.float32 else 5e-2

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            a = a.detach().double().cpu()
            return float((a - b.detach()).abs().max() / b.detach().abs().max())

        assert rel(out, ref) <= tol
        assert rel(x.grad, x64.grad) <= tol
        assert rel(layer.phi.grad, params["phi"].grad) <= max(tol, 1e-3)
        uses_ipc = client.is_local and client.server_info().has_cuda
        assert layer._owner.transport.use_ipc(x) == uses_ipc
    finally:
        layer.close()
