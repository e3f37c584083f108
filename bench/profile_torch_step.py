"""Where the host time of the torch layer's step goes: a cProfile of
`out = layer(x); out.backward(g)` through the daemon, in steady state, after
the same steps timed without the profiler, and PyTorch's own floor for such
a step: two autograd functions shaped like the layer's (the same inputs,
saved tensors and outputs allocated), doing no work and no daemon call.

    python3 bench/profile_torch_step.py --address=unix:/run/mhcd.sock \
        --shape=1,512,1024 --n=4 [--steps=300] [--top=28] \
        [--backward-thread=caller]

--backward-thread as in bench/e2e_torch.py. Needs a CUDA device here and a
CUDA daemon on this node (--allow_shm); mhc_client (and its native
extension) on PYTHONPATH.
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


class _EmptyPre(torch.autograd.Function):
    """The pre's autograd shape: x in; y, h_pre, h_post, h_res out; x and
    the kept projection saved; dx out of the backward."""

    @staticmethod
    def forward(ctx, x, logits):
        lead, n, c = x.shape[:-2], x.shape[-2], x.shape[-1]
        new = lambda *shape, dtype=torch.float32: torch.empty(  # noqa: E731
            lead + shape, dtype=dtype, device=x.device)
        y, h_pre, h_post, h_res = (new(c, dtype=x.dtype), new(n), new(n),
                                   new(n, n))
        ctx.save_for_backward(x, new(logits), new())
        ctx.mark_non_differentiable(h_pre)
        return y, h_pre, h_post, h_res

    @staticmethod
    def backward(ctx, dy, _dh_pre, dh_post, dh_res):
        x, _, _ = ctx.saved_tensors
        return torch.empty_like(x), None


class _EmptyPost(torch.autograd.Function):
    """The post's: f, x, h_post, h_res in; x_next out; df, dh_post, dh_res
    out of the backward (dx goes to the pre's backward)."""

    @staticmethod
    def forward(ctx, f, x, h_post, h_res):
        ctx.save_for_backward(f, x, h_post, h_res)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dx_next):
        f, _, h_post, h_res = ctx.saved_tensors
        return (torch.empty_like(f), None, torch.empty_like(h_post),
                torch.empty_like(h_res))


def time_steps(step, device, steps):
    for _ in range(20):
        step()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize(device)
    return 1e3 * (time.perf_counter() - start) / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", required=True)
    ap.add_argument("--shape", default="1,512,1024", help="B,T,C")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--top", type=int, default=28)
    ap.add_argument("--backward-thread", default="device",
                    choices=("device", "caller"))
    args = ap.parse_args()
    if args.backward_thread == "caller":
        torch.autograd.set_multithreading_enabled(False)
    b, t, c = (int(v) for v in args.shape.split(","))
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(b, t, args.n, c, device=device, dtype=torch.bfloat16,
                    requires_grad=True)
    g = torch.randn_like(x)

    def floor_step():
        x.grad = None
        y, _, h_post, h_res = _EmptyPre.apply(x, args.n * args.n + 2 * args.n)
        _EmptyPost.apply(y, x, h_post, h_res).backward(g)

    floor_ms = time_steps(floor_step, device, args.steps)
    print(f"PyTorch floor {floor_ms:.3f} ms a step (autograd functions of the "
          f"layer's shape, outputs allocated, no work)")
    with Client(args.address) as client:
        layer = make_layer(client, c, args.n, device, 1, transport="ipc")

        def step():
            x.grad = None
            layer(x).backward(g)

        ms = time_steps(step, device, args.steps)
        print(f"step {ms:.3f} ms without the profiler "
              f"(backward thread: {args.backward_thread})")
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
