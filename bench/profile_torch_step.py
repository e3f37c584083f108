"""Where the host time of the torch layer's step goes: a cProfile of
`out = layer(x); out.backward(g)` through the daemon, in steady state, after
the same steps timed without the profiler.

    python3 bench/profile_torch_step.py --address=unix:/run/mhcd.sock \
        --shape=1,512,1024 --n=4 [--steps=300] [--top=28]

Needs a CUDA device here and a CUDA daemon on this node (--allow_shm);
mhc_client (and its native extension) on PYTHONPATH.
"""

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_torch import make_layer  # noqa: E402

from mhc_client import Client  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", required=True)
    ap.add_argument("--shape", default="1,512,1024", help="B,T,C")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--top", type=int, default=28)
    args = ap.parse_args()
    b, t, c = (int(v) for v in args.shape.split(","))
    device = torch.device("cuda", torch.cuda.current_device())
    with Client(args.address) as client:
        layer = make_layer(client, c, args.n, device, 1, transport="ipc")
        x = torch.randn(b, t, args.n, c, device=device, dtype=torch.bfloat16,
                        requires_grad=True)
        g = torch.randn_like(x)

        def step():
            x.grad = None
            layer(x).backward(g)

        for _ in range(20):
            step()
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize(device)
        ms = 1e3 * (time.perf_counter() - start) / args.steps
        print(f"step {ms:.3f} ms without the profiler")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize(device)
        profile.disable()
        if client.native is not None:
            print("native path:", client.native.stats())
        stats = pstats.Stats(profile)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumtime").print_stats(args.top)


if __name__ == "__main__":
    main()
