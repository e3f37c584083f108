"""Checkpoint throughput: a DeepSeek-V4-sized model of 61 mHC layers
(C=7168, n=4, preset deepseek_v4) saved and loaded by one mhcd, into each
directory given (e.g. local disk and /dev/shm). For every target it reports
the file size and the median over --repeats of the daemon-side seconds and
the client's wall time of SaveCheckpoint (parameters only, and with
gradients; MB is the file) and LoadCheckpoint (replace=True; MB is the
tensor data read). Saves include the fsyncs;
loads read what the save just wrote, so they come from the page cache.

    python3 bench/checkpoint_bench.py --mhcd=build/server/mhcd \\
        --dirs=/var/tmp,/dev/shm [--layers=61 --hidden=7168 --n=4]

mhc_client and its generated modules must be on PYTHONPATH. Each target
gets a fresh subdirectory (removed afterwards) and its own daemon.
"""

import argparse
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from mhc_client import Client


def start_daemon(mhcd, state_dir, sock_dir, backend, threads):
    address = f"unix:{sock_dir}/mhcd.sock"
    proc = subprocess.Popen(
        [mhcd, f"--listen={address}", "--metrics_listen=", f"--backend={backend}",
         f"--threads={threads}", f"--state_dir={state_dir}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("mhcd: ready"):
            return proc, address
    raise RuntimeError("mhcd did not start")


def timed(fn):
    start = time.perf_counter()
    response = fn()
    return response, time.perf_counter() - start


def bench_target(args, target):
    state = Path(tempfile.mkdtemp(prefix="mhcd-ckpt-bench-", dir=target))
    sock_dir = tempfile.mkdtemp(prefix="mhcd-ckpt-sock-")
    proc, address = start_daemon(args.mhcd, state, sock_dir, args.backend,
                                 args.threads)
    rows = []
    try:
        with Client(address, timeout=600) as client:
            client.wait_for_ready(30)
            for i in range(args.layers):
                client.create_layer(f"layer{i:02d}", args.hidden, n=args.n,
                                    seed=i)
            for gradients in (False, True):
                name = "with-grads" if gradients else "params"
                saves, loads = [], []
                for _ in range(args.repeats):
                    saved, wall = timed(lambda: client.save_checkpoint(
                        name, gradients=gradients))
                    saves.append((saved.seconds, wall, saved.bytes))
                    loaded, wall = timed(lambda: client.load_checkpoint(
                        name, replace=True))
                    loads.append((loaded.seconds, wall, loaded.bytes))
                for what, samples in (("save", saves), ("load", loads)):
                    daemon_s = statistics.median(s[0] for s in samples)
                    wall_s = statistics.median(s[1] for s in samples)
                    rows.append((target, name, what, samples[0][2], daemon_s,
                                 wall_s))
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mhcd", required=True)
    parser.add_argument("--dirs", default="/var/tmp,/dev/shm",
                        help="comma-separated parent directories to write into")
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(f"# {args.layers} layers, C={args.hidden}, n={args.n}, "
          f"backend={args.backend}, host {socket.gethostname()}")
    print("| target | checkpoint | op | MB | daemon s | client s | GB/s (client) |")
    print("|---|---|---|---|---|---|---|")
    for target in args.dirs.split(","):
        for target_dir, name, what, size, daemon_s, wall_s in bench_target(
                args, target):
            print(f"| {target_dir} | {name} | {what} | {size / 1e6:.1f} | "
                  f"{daemon_s:.3f} | {wall_s:.3f} | {size / wall_s / 1e9:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
