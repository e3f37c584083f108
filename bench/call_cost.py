"""What one call costs a Python client, by call form: the round trip of a
tiny Aggregate whose tensors are in a shared-memory region (so only the
request travels), as a unary RPC and as messages of one persistent
ExecuteStream sent in lockstep, beside a unary GetServerInfo. Medians over
--calls calls after a warm-up, in microseconds. Compare with the C++
client's round trip of the same request shape in `mhc_rpc_bench` (its 1 KiB
shared-memory row).

    python3 bench/call_cost.py --address=unix:/run/mhcd.sock [--calls=2000]

The daemon needs --allow_shm; mhc_client and its generated modules must be
on PYTHONPATH.
"""

import argparse
import queue
import statistics
import time

import numpy as np

from mhc_client import Client
from mhc_client._proto import service_pb2

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", required=True)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()

    client = Client(args.address)
    client.wait_for_ready()
    layer = f"call-cost-{time.monotonic_ns()}"
    client.create_layer(layer, hidden=C, n=N, seed=1)
    session = client.open_session()
    try:
        region = session.create_region("io", 1 << 16)
        x = region.put(np.random.randn(M, N, C).astype(np.float32))
        h_pre = region.put(np.random.rand(M, N).astype(np.float32))
        y = region.alloc(np.float32, (M, C))
        request = client.build_request("aggregate", layer, x=x, h_pre=h_pre,
                                       out={"y": y})
        metadata = [("mhc-session-id", session.id)]
        stub = client._stub

        unary = median_us(lambda: stub.Aggregate(request, metadata=metadata),
                          args.calls)
        info = median_us(
            lambda: stub.GetServerInfo(service_pb2.GetServerInfoRequest()),
            args.calls)

        batch = service_pb2.ExecuteRequest()
        op = batch.ops.add(id="a")
        op.aggregate.CopyFrom(request)
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

        stream = median_us(stream_call, args.calls)
        outgoing.put(None)
        for _ in responses:
            pass
        print(f"| call | median us |\n|---|---|\n"
              f"| GetServerInfo, unary | {info:.0f} |\n"
              f"| Aggregate on shm, unary | {unary:.0f} |\n"
              f"| Aggregate on shm, ExecuteStream message | {stream:.0f} |")
    finally:
        session.close()
        client.delete_layer(layer)
        client.close()


if __name__ == "__main__":
    main()
