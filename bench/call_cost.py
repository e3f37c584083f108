"""What one call costs a Python client, by call form: the round trip of a
tiny Aggregate whose tensors are in a shared-memory region (so only the
request travels). Rows: the generated stub as a unary RPC and as messages
of one persistent ExecuteStream sent in lockstep, beside a unary
GetServerInfo; then `Client.compute_in_place` (what the torch layer calls)
by the pure-Python path and by the native extension (mhc_client._native)
over gRPC and through the session's call ring;
then a whole call of the torch layer's transport on host tensors (arena
path: copies in and out included) by each path. Medians over --calls calls
after a warm-up, in microseconds. Compare with the C++ client's round trip
of the same request shape in `mhc_rpc_bench` (its 1 KiB shared-memory row).

    python3 bench/call_cost.py --address=unix:/run/mhcd.sock [--calls=2000]

The daemon needs --allow_shm; mhc_client and its generated modules (and,
for the native rows, its extension) must be on PYTHONPATH. Native rows are
skipped, with the reason, when the extension does not load.
"""

import argparse
import os
import queue
import statistics
import time

import numpy as np

from mhc_client import Client, native
from mhc_client._proto import service_pb2
from mhc_client.ops import op_def
from mhc_client.tensors import F32

N, C, M = 4, 64, 1


def median_us(fn, calls, warmup=200):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def stub_rows(client, layer, calls):
    """The generated stub's unary call, ExecuteStream message, GetServerInfo."""
    session = client.open_session()
    region = session.create_region("io", 1 << 16)
    x = region.put(np.random.randn(M, N, C).astype(np.float32))
    h_pre = region.put(np.random.rand(M, N).astype(np.float32))
    y = region.alloc(np.float32, (M, C))
    request = client.build_request("aggregate", layer, x=x, h_pre=h_pre,
                                   out={"y": y})
    metadata = [("mhc-session-id", session.id)]
    stub = client._stub
    rows = [("GetServerInfo, unary", median_us(
        lambda: stub.GetServerInfo(service_pb2.GetServerInfoRequest()), calls))]
    rows.append(("Aggregate on shm, unary", median_us(
        lambda: stub.Aggregate(request, metadata=metadata), calls)))

    batch = service_pb2.ExecuteRequest()
    batch.ops.add(id="a").aggregate.CopyFrom(request)
    outgoing: "queue.Queue" = queue.Queue()

    def requests():
        while True:
            item = outgoing.get()
            if item is None:
                return
            yield item

    responses = stub.ExecuteStream(requests(), metadata=metadata)

    def stream_call():
        outgoing.put(batch)
        next(responses)

    rows.append(("Aggregate on shm, ExecuteStream message",
                 median_us(stream_call, calls)))
    outgoing.put(None)
    for _ in responses:
        pass
    return rows


def in_place_row(client, layer, calls):
    """compute_in_place of the same Aggregate, places given as tuples."""
    session = client.open_session()
    region = session.create_region("io", 1 << 16)
    x = region.put(np.random.randn(M, N, C).astype(np.float32))
    h_pre = region.put(np.random.rand(M, N).astype(np.float32))
    y = region.alloc(np.float32, (M, C))

    def place(name, array):
        return (name, F32, array.shape, region.name,
                int(array.ctypes.data) - region.address, array.nbytes)

    tensors = (place("x", x), place("h_pre", h_pre))
    _, _, _, y_region, y_offset, y_bytes = place("y", y)
    outputs = (("y", y_region, y_offset, y_bytes),)
    spec = op_def("aggregate")
    return median_us(lambda: client.compute_in_place(
        spec, layer, tensors, outputs, {}, retry=True), calls)


def transport_row(client, layer, calls):
    """One call of the torch layer's transport on host tensors."""
    import torch

    from mhc_client.torch_transport import _Transport

    transport = _Transport(client, "auto")
    x = torch.randn(M, N, C)
    h_pre = torch.rand(M, N)
    wanted = {"y": ((M, C), torch.float32)}
    return median_us(lambda: transport.run(
        "aggregate", layer, {"x": x, "h_pre": h_pre}, wanted), calls)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", required=True)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()

    rows = []
    layer = f"call-cost-{time.monotonic_ns()}"
    with Client(args.address, native=False) as client:
        client.wait_for_ready()
        client.create_layer(layer, hidden=C, n=N, seed=1)
        try:
            rows += stub_rows(client, layer, args.calls)
        except BaseException:
            client.delete_layer(layer)
            raise
    paths = [("pure Python", False, "off")]
    reason = native.unavailable_reason()
    if reason is None:
        paths += [("native, gRPC", True, "off"),
                  ("native, call ring", True, "on")]
    try:
        for label, use_native, ring in paths:
            os.environ[native.CALL_RING_ENV] = ring
            with Client(args.address, native=use_native) as client:
                rows.append((f"Aggregate on shm, compute_in_place, {label}",
                             in_place_row(client, layer, args.calls)))
                try:
                    rows.append((f"Aggregate, torch transport (arena), {label}",
                                 transport_row(client, layer, args.calls)))
                except ImportError:
                    pass  # no torch
                if ring == "on" and not client.native.stats()["ring_calls"]:
                    raise SystemExit("the call ring was not used")
    finally:
        with Client(args.address) as client:
            client.delete_layer(layer)
    print("| call | median us |\n|---|---|")
    for label, us in rows:
        print(f"| {label} | {us:.0f} |")
    if reason is not None:
        print(f"\nnative rows skipped: {reason}")


if __name__ == "__main__":
    main()
