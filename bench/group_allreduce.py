#!/usr/bin/env python3
"""All-reduce latency of a data-parallel group's gradients through mhcd.

Starts two daemons, one GPU each (or one daemon serving both GPUs with
--one-daemon), creates LAYERS layers of (C, n) on every rank, and times:

- fused: one AllReduceGradients over all the layers (NCCL groups the
  per-layer all-reduces into one launch sequence);
- per layer: a group holding one layer, all-reduced LAYERS times in a row,
  which is what a client making one call per layer pays.

Prints a table and JSON lines (median of --repeats, wall time of the
calls as the client sees them, and the daemon's own seconds).

    bench/group_allreduce.py --mhcd=BUNDLE/bin/mhcd [--layers=61]
        [--hidden=7168] [--n=4] [--repeats=20] [--one-daemon]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "python"))
import mhc_client  # noqa: E402


def start(binary: str, devices: str, extra: List[str]) -> Any:
    work = tempfile.mkdtemp(prefix="mhcd-group-")
    address = f"unix:{work}/mhcd.sock"
    proc = subprocess.Popen([binary, "--backend=cuda", f"--devices={devices}",
                             f"--listen={address}", "--metrics_listen=",
                             *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("mhcd: ready"):
            return proc, address
    raise RuntimeError(f"mhcd --devices={devices} did not start")


def together(*calls: Callable[[], Any]) -> List[Any]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mhcd", required=True)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--one-daemon", action="store_true")
    ap.add_argument("--nccl-library", default=os.environ.get(
        "MHCD_NCCL_LIBRARY", ""))
    args = ap.parse_args()
    extra = [f"--nccl_library={args.nccl_library}"] if args.nccl_library else []

    procs = []
    if args.one_daemon:
        proc, address = start(args.mhcd, "0,1", extra)
        procs.append(proc)
        clients = [mhc_client.Client(address, timeout=600)]
        devices = ["cuda:0", "cuda:1"]
    else:
        clients = []
        for device in ("0", "1"):
            proc, address = start(args.mhcd, device, extra)
            procs.append(proc)
            clients.append(mhc_client.Client(address, timeout=600))
        devices = ["", ""]
    try:
        names = [[f"r{rank}_l{i}" for i in range(args.layers)] for rank in (0, 1)]
        owner = [clients[0], clients[0]] if args.one_daemon else clients
        for rank in (0, 1):
            for name in names[rank]:
                owner[rank].create_layer(name, hidden=args.hidden, n=args.n,
                                         seed=1, device=devices[rank])

        def form(group: str, layers: List[List[str]]) -> None:
            if args.one_daemon:
                info = clients[0].create_group(
                    group, 2, {0: (devices[0], layers[0]),
                               1: (devices[1], layers[1])}, wait=True)
                assert info.state == "READY", info.error
                return
            info = clients[0].create_group(group, 2, {0: ("", layers[0])})
            joined = clients[1].join_group(group, 2, info.unique_id,
                                           {1: ("", layers[1])}, wait=True)
            assert joined.state == "READY", joined.error

        form("fused", names)
        form("single", [names[0][:1], names[1][:1]])

        def all_reduce(group: str) -> Any:
            return together(*[lambda c=c: c.all_reduce_gradients(group)
                              for c in clients])[0]

        rows = []
        for mode, group, calls in (("fused", "fused", 1),
                                   ("per_layer", "single", args.layers)):
            for _ in range(3):
                all_reduce(group)
            walls, daemon_s, bus = [], [], []
            for _ in range(args.repeats):
                start_t = time.perf_counter()
                seconds = 0.0
                for _ in range(calls):
                    r = all_reduce(group)
                    seconds += r.seconds
                walls.append(time.perf_counter() - start_t)
                daemon_s.append(seconds)
                bus.append(r.bus_bytes_per_second)
            row = dict(mode=mode, layers=args.layers, hidden=args.hidden,
                       n=args.n, calls=calls,
                       bytes_per_rank=r.bytes * calls,
                       wall_ms=statistics.median(walls) * 1e3,
                       daemon_ms=statistics.median(daemon_s) * 1e3,
                       bus_gbps=statistics.median(bus) / 1e9,
                       topology="1 daemon, 2 GPUs" if args.one_daemon
                       else "2 daemons, 1 GPU each")
            rows.append(row)
            print(json.dumps(row), flush=True)
        print("| topology | mode | calls | MB per rank | wall ms | daemon ms "
              "| bus GB/s (last call) |")
        print("|---|---|---|---|---|---|---|")
        for row in rows:
            print(f"| {row['topology']} | {row['mode']} | {row['calls']} | "
                  f"{row['bytes_per_rank'] / 1e6:.1f} | {row['wall_ms']:.2f} | "
                  f"{row['daemon_ms']:.2f} | {row['bus_gbps']:.1f} |")
    finally:
        for c in clients:
            c.close()
        for proc in procs:
            proc.terminate()
            proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
