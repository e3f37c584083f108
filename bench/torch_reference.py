"""Eager PyTorch implementation of one mHC layer (pre + post), the
in-house baseline that bench/gpu_bench.cc is compared with: layer forward and
forward+backward (backward by autograd) at the benchmark configs
(bench/configs.json), eager and torch.compile, timed with CUDA events, L2
flushed before every repetition, median. Prints JSON lines in
mhc_gpu_bench's schema. The math is mhc_client.eager's (preset deepseek_v4
with gamma), in fp32 for bf16 activations; it needs the client package's
dependencies (grpcio, protobuf, numpy).

    python3 bench/torch_reference.py [--configs=all|first|I,J] [--reps=10]
        [--no-compile] [--compile-budget-s=180]
    python3 bench/torch_reference.py --selftest   # CPU: gradients, bf16
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
# This checkout's client package when no other is importable.
sys.path.append(str(HERE.parent / "client" / "python"))
from mhc_client import LayerSpec, eager  # noqa: E402

N_STREAMS = 4
CONFIGS = [tuple(c) for c in
           json.loads((HERE / "configs.json").read_text())["layer"]]
LAYER_SPEC = LayerSpec(n=N_STREAMS, has_gamma=True).resolved("deepseek_v4")


def layer(x, f, phi, gamma, alpha, beta):
    """(y, x_next) of x [M, n, C] and f [M, C] in x's dtype, computed in
    fp32 (float64 inputs stay float64)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x.to(compute)
    params = {"phi": phi, "gamma": gamma, "alpha": alpha, "beta": beta}
    y, _, h_post, h_res = eager.pre(xc, params, LAYER_SPEC)
    x_next = eager.post(f.to(compute), xc, h_post, h_res, LAYER_SPEC)
    return y.to(x.dtype), x_next.to(x.dtype)


def make_inputs(m, c, device, dtype, seed=0, requires_grad=False):
    n = N_STREAMS
    k, nl = n * c, 2 * n + n * n
    g = torch.Generator(device=device).manual_seed(seed)
    # Generated where they are used: gigabytes at the large configs.
    gen_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    def rnd(*shape, lo=-1.0, hi=1.0):
        return (torch.rand(*shape, generator=g, dtype=gen_dtype,
                           device=device) * (hi - lo) + lo)

    scale = 1.0 / k ** 0.5
    t = {
        "x": rnd(m, n, c).to(device, dtype),
        "f": rnd(m, c).to(device, dtype),
        "phi": rnd(nl, k, lo=-scale, hi=scale),
        "gamma": rnd(k, lo=0.5, hi=1.5),
        "alpha": rnd(3, lo=0.5, hi=1.5),
        "beta": rnd(nl),
    }
    pdtype = torch.float64 if dtype == torch.float64 else torch.float32
    for name in ("phi", "gamma", "alpha", "beta"):
        t[name] = t[name].to(device, pdtype)
    for v in t.values():
        v.requires_grad_(requires_grad)
    return t


def selftest():
    """Backward (autograd) vs float64 finite differences; the bf16 / fp32
    path (what is timed) vs float64. The forward math itself is checked
    against the daemon's float64 reference by the client's tests."""
    torch.manual_seed(0)
    small = make_inputs(3, 2, "cpu", torch.float64, seed=1, requires_grad=True)
    inputs = tuple(small[k] for k in ("x", "f", "phi", "gamma", "alpha", "beta"))
    ok = torch.autograd.gradcheck(
        lambda *a: torch.cat([o.reshape(-1) for o in layer(*a)]), inputs,
        eps=1e-6, atol=1e-7, rtol=1e-6)
    print(f"backward (autograd) vs float64 finite differences: {ok}")

    low = make_inputs(16, 64, "cpu", torch.bfloat16, seed=2)
    hi = {k: v.double() for k, v in low.items()}
    y_lo, xn_lo = layer(**low)
    y_hi, xn_hi = layer(**hi)
    for name, a, b in (("y", y_lo, y_hi), ("x_next", xn_lo, xn_hi)):
        rel = ((a.double() - b).abs().max() / b.abs().max()).item()
        print(f"bf16 {name} vs float64: relative error {rel:.2e}")
        assert rel < 1e-2, rel
    print("selftest passed")


def copy_gbps():
    a = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    best = None
    for i in range(6):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        if i:
            best = s.elapsed_time(e) if best is None else min(
                best, s.elapsed_time(e))
    return 2 * a.numel() / (best * 1e-3) / 1e9


def median_us(fn, reps, warmup=2, reset=None):
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    times = []
    for r in range(warmup + reps):
        if reset is not None:
            reset()
        flush.zero_()
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        if r >= warmup:
            times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


def layer_bytes(m, c, direction):
    """Same counts as mhc_gpu_bench: bf16 activations, per-token H values."""
    n = N_STREAMS
    k, mix = n * c, 4 * (n + n * n)
    if direction == "forward":
        return m * (6 * k + 4 * c + 2 * mix)
    return m * (16 * k + 10 * c + 5 * mix)


def run_config(cfg, impl, fn, reps, copy):
    b, tt, c = cfg
    m = b * tt
    t = make_inputs(m, c, "cuda", torch.bfloat16, seed=m + c)
    dy = torch.rand(m, c, device="cuda", dtype=torch.bfloat16) * 2 - 1
    dx_next = torch.rand(m, N_STREAMS, c, device="cuda",
                         dtype=torch.bfloat16) * 2 - 1
    leaves = list(t.values())

    def fwd():
        with torch.no_grad():
            fn(**t)

    def fwd_bwd():
        y, x_next = fn(**t)
        torch.autograd.backward([y, x_next], [dy, dx_next])

    def reset():
        for v in leaves:
            v.grad = None

    for v in leaves:
        v.requires_grad_(True)
    out = []
    for direction, body in (("forward", fwd), ("forward_backward", fwd_bwd)):
        start = time.time()
        body()  # compiles on first use
        torch.cuda.synchronize()
        first_s = time.time() - start
        us = median_us(body, reps, reset=reset)
        nbytes = layer_bytes(m, c, direction)
        gbps = nbytes / (us * 1e3)
        rec = {"impl": impl, "op": "layer", "direction": direction,
               "config": f"{b},{tt},{c}", "M": m, "n": N_STREAMS, "C": c,
               "dtype": "bf16", "mode": "default", "us": round(us, 2),
               "bytes": nbytes, "gbps": round(gbps, 1),
               "pct_copy": round(100 * gbps / copy, 1),
               "first_call_s": round(first_s, 1)}
        print(json.dumps(rec), flush=True)
        out.append(rec)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="all")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-budget-s", type=float, default=180.0)
    ap.add_argument("--selftest", action="store_true")
    args = ap.parse_args()
    if args.selftest:
        selftest()
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    if args.configs == "all":
        picked = list(range(len(CONFIGS)))
    elif args.configs == "first":
        picked = [0]
    else:
        picked = [int(i) for i in args.configs.split(",")]
    copy = copy_gbps()
    print(json.dumps({"impl": "torch", "op": "copy_d2d",
                      "device": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "gbps": round(copy, 1)}),
          flush=True)
    rows = {}
    for i in picked:
        for rec in run_config(CONFIGS[i], "torch_eager", layer, args.reps,
                              copy):
            rows[(rec["config"], "eager", rec["direction"])] = rec["us"]
        torch.cuda.empty_cache()

    compiled = None if args.no_compile else torch.compile(layer, dynamic=True)
    spent = 0.0
    for i in picked:
        cfg = f"{CONFIGS[i][0]},{CONFIGS[i][1]},{CONFIGS[i][2]}"
        if compiled is None or spent > args.compile_budget_s:
            why = "disabled" if compiled is None else "compile budget spent"
            print(json.dumps({"impl": "torch_compile", "op": "layer",
                              "config": cfg, "skipped": why}), flush=True)
            continue
        start = time.time()
        try:
            for rec in run_config(CONFIGS[i], "torch_compile", compiled,
                                  args.reps, copy):
                rows[(cfg, "compile", rec["direction"])] = rec["us"]
        except Exception as e:  # a compiler failure is a result, not a crash
            print(json.dumps({"impl": "torch_compile", "op": "layer",
                              "config": cfg,
                              "skipped": f"{type(e).__name__}: {e}"[:300]}),
                  flush=True)
            compiled = None
        spent += time.time() - start
        torch.cuda.empty_cache()
    if compiled is not None:
        t = make_inputs(64, 1024, "cuda", torch.bfloat16, seed=3)
        with torch.no_grad():
            ye, xe = layer(**t)
            yc, xc = compiled(**t)
        rel = max(((a.float() - b.float()).abs().max() /
                   b.float().abs().max()).item()
                  for a, b in ((yc, ye), (xc, xe)))
        print(("FAIL" if rel > 1e-2 else "ok") +
              f" torch.compile vs eager: relative error {rel:.2e}")

    print(f"\n{'config':>16} {'eager fwd':>10} {'eager f+b':>10} "
          f"{'compile fwd':>12} {'compile f+b':>12}   (us)")
    for i in picked:
        cfg = f"{CONFIGS[i][0]},{CONFIGS[i][1]},{CONFIGS[i][2]}"
        cells = [rows.get((cfg, impl, d)) for impl in ("eager", "compile")
                 for d in ("forward", "forward_backward")]
        print(f"{cfg:>16} " + " ".join(
            f"{('%.0f' % v) if v else 'skipped':>{w}}"
            for v, w in zip(cells, (10, 10, 12, 12))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
