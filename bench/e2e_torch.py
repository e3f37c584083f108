"""End-to-end benchmark of the torch layer through the daemon, as a user runs
it: `mhc_client.torch.MhcLayer` (identity sublayer, bf16 activations, preset
deepseek_v4) forward and forward+backward, against the same layer computed
in this process by the eager reference (mhc_client.eager with autograd,
mixing in fp32), and against the daemon's own kernel time for those steps
(its Prometheus histogram mhcd_kernel_duration_seconds).

A step is `out = layer(x); out.backward(g)` with x [B, T, n, C] and a fixed
upstream gradient g; the forward-only figure runs `layer(x)` under
torch.no_grad(). Wall clock over the timed steps, with the device
synchronised only before the first and after the last. Each (n, transport)
is first checked against a float64 reference on a small config, and a path
that fails it is not timed. One JSON line per (config, n, transport), then
a markdown table; the exit code counts failed checks and errors.

    python3 bench/e2e_torch.py --unix=unix:/run/mhcd.sock \
        --tcp=127.0.0.1:50051 --metrics=http://127.0.0.1:9464/metrics \
        [--configs=all|0,2|4x4096x4096] [--n=4,8] [--transports=ipc,inline] \
        [--warmup=5] [--steps=20] [--budget-s=10] [--out=FILE.jsonl] \
        [--backward-thread=caller]
    python3 bench/e2e_torch.py --check --unix=... [--tcp=...]
    python3 bench/e2e_torch.py --device=cpu --configs=1x64x128 --n=4 \
        --transports=auto,inline ...   # smoke test against a CPU daemon

Transports: "ipc" goes over the unix socket (CUDA IPC), "inline" over TCP
(tensors inside the messages; configs whose messages exceed the daemon's
limit are reported as skipped), "auto" over the unix socket (the layer's
own choice). Needs mhc_client and its generated stubs on PYTHONPATH.

--backward-thread: "device" (PyTorch's default) runs the backward of CUDA
tensors on autograd's worker thread for the device, the caller waiting for
it; "caller" runs it on the calling thread
(torch.autograd.set_multithreading_enabled(False)), which saves two thread
hand-offs a step. Both the daemon layer and the eager baseline are timed
under the setting given. Steps short enough to be bound by the host also
vary with how the process's threads land on cores: pin it (taskset) to
compare runs.
"""

import argparse
import json
import re
import sys
import time
import urllib.request
from pathlib import Path

import torch
from torch import nn

CONFIGS = [tuple(c) for c in json.loads(
    (Path(__file__).resolve().parent / "configs.json").read_text())["e2e"]]
CHECK_CONFIG = (2, 48, 256)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PRESET = "deepseek_v4"
# Outputs and dx carry one bf16 rounding; parameter gradients sum rounded
# per-token terms, hence the looser bound.
TOL_ACT, TOL_PARAM = 2e-2, 5e-2
# --backward-thread of this run, for the result lines.
BACKWARD_THREAD = ["device"]


# ----------------------------------------------------------------- metrics


def scrape(url):
    """Totals from the daemon's Prometheus text: kernel seconds and launches,
    request seconds, requests by RPC."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {"kernel_s": 0.0, "launches": 0.0, "request_s": 0.0, "requests": 0.0,
           "by_rpc": {}}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if "}" in line:
            cut = line.rindex("}") + 1
            head, rest = line[:cut], line[cut:].split()
        else:
            parts = line.split()
            head, rest = parts[0], parts[1:]
        if not rest:
            continue
        name, value = head.split("{", 1)[0], float(rest[0])
        if name == "mhcd_kernel_duration_seconds_sum":
            out["kernel_s"] += value
        elif name == "mhcd_kernel_duration_seconds_count":
            out["launches"] += value
        elif name == "mhcd_request_duration_seconds_sum":
            out["request_s"] += value
        elif name == "mhcd_requests_total":
            out["requests"] += value
            m = re.search(r'rpc="([^"]*)"', head)
            key = m.group(1) if m else "?"
            out["by_rpc"][key] = out["by_rpc"].get(key, 0.0) + value
    return out


def settled_scrape(url):
    """A scrape once the counts stop moving: a daemon may record a launch's
    device time after it has answered the request."""
    last = scrape(url)
    deadline = time.time() + 2.0
    while time.time() < deadline:
        time.sleep(0.05)
        now = scrape(url)
        if (now["launches"], now["requests"]) == (last["launches"],
                                                  last["requests"]):
            return now
        last = now
    return last


def delta(before, after, steps):
    methods = {k: round((v - before["by_rpc"].get(k, 0.0)) / steps, 2)
               for k, v in after["by_rpc"].items()
               if v != before["by_rpc"].get(k, 0.0)}
    return {"kernel_ms": (after["kernel_s"] - before["kernel_s"]) * 1e3 / steps,
            "request_ms": (after["request_s"] - before["request_s"]) * 1e3 / steps,
            "launches": (after["launches"] - before["launches"]) / steps,
            "calls": (after["requests"] - before["requests"]) / steps,
            "by_rpc": methods}


# ------------------------------------------------------------------ timing


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(fn, device, warmup, steps, budget_s):
    """Runs the warm-up steps and returns how many steps to time so that the
    timed loop stays near budget_s (at least 3): slow paths (large inline
    messages) would otherwise take minutes per row."""
    start = time.perf_counter()
    for i in range(warmup):
        fn()
        if i >= 1 and time.perf_counter() - start > budget_s / 2:
            break
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    one = time.perf_counter() - t0
    return max(3, min(steps, int(budget_s / max(one, 1e-6))))


def time_ms(fn, device, steps):
    return time_wall_and_host(fn, device, steps)[0]


def time_wall_and_host(fn, device, steps):
    """(ms per step, host ms per step): the wall time with the device
    drained, and the time the host took to issue the steps. Equal when the
    host, not the device, bounds the step."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    issued = time.perf_counter()
    sync(device)
    return ((time.perf_counter() - t0) * 1e3 / steps,
            (issued - t0) * 1e3 / steps)


def oom_error():
    return getattr(torch.cuda, "OutOfMemoryError", RuntimeError)


def is_oom(e):
    return isinstance(e, oom_error()) or "out of memory" in str(e)


# ------------------------------------------------------------------ layers


def reference_params(layer, device, dtype=torch.float32):
    """The daemon layer's parameters as leaves of their own that take
    gradients."""
    return {k: getattr(layer, k).detach().to(device=device, dtype=dtype)
            .clone().requires_grad_(True) for k in layer.param_names}


def make_layer(client, c, n, device, seed, transport="auto"):
    from mhc_client.torch import MhcLayer
    layer = MhcLayer(client, c, n=n, sublayer=nn.Identity(), preset=PRESET,
                     seed=seed, transport=transport)
    return layer.to(device)


def inline_bytes(m, n, c, itemsize):
    """Largest message of the layer's four calls sent inline: a backward call
    carries x, dx_next (M n C) and dy / f (M C) plus fp32 mixing values."""
    nl = 2 * n + n * n
    return (2 * n + 1) * m * c * itemsize + m * (2 * n + n * n + nl + 1) * 4 * 2


# ------------------------------------------------------------------- check


def rel_err(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def check_path(client, transport, n, dtype, device, seed=11):
    """Output and gradients of the daemon layer against float64 autograd of
    mhc_client.eager on the same (rounded) inputs, over three steps: the
    second repeats the first (steady state), the third follows an in-place
    parameter update like an optimizer's."""
    from mhc_client import eager
    b, t, c = CHECK_CONFIG
    gen = torch.Generator(device="cpu").manual_seed(seed + n)
    layer = make_layer(client, c, n, device, seed, transport)
    rec = {"check": True, "config": f"{b},{t},{c}", "M": b * t, "n": n,
           "transport": transport, "dtype": str(dtype).split(".")[-1]}
    try:
        k = n * c
        with torch.no_grad():  # away from the near-identity initialisation
            layer.phi.copy_(torch.randn(layer.phi.shape, generator=gen) * 2 / k ** 0.5)
            layer.alpha.copy_(torch.rand(layer.alpha.shape, generator=gen) + 0.5)
            layer.beta.copy_(torch.randn(layer.beta.shape, generator=gen) * 0.5)
        x = (torch.randn(b, t, n, c, generator=gen)).to(device, dtype)
        x.requires_grad_(True)
        g = torch.randn(b, t, n, c, generator=gen).to(device, dtype)
        errs, worst = [], 0.0
        for step in range(3):
            if step == 2:
                with torch.no_grad():
                    for name in layer.param_names:
                        p = getattr(layer, name)
                        p.add_(torch.randn(p.shape, generator=gen).to(p) * 0.1
                               * p.abs().mean())
            x.grad = None
            for p in layer.parameters():
                p.grad = None
            with torch.no_grad():
                out_nograd = layer(x)
            out = layer(x)
            out.backward(g)

            p64 = reference_params(layer, "cpu", torch.float64)
            x64 = x.detach().cpu().double().requires_grad_(True)
            out64 = eager.layer(x64, p64, layer.spec, nn.Identity())
            out64.backward(g.detach().cpu().double())
            e = {"out": rel_err(out, out64), "out_no_grad": rel_err(out_nograd, out64),
                 "dx": rel_err(x.grad, x64.grad)}
            limits = {"out": TOL_ACT, "out_no_grad": TOL_ACT, "dx": TOL_ACT}
            for name in layer.param_names:
                grad = getattr(layer, name).grad
                # A gradient that never reaches .grad fails the check.
                e["d" + name] = (1e9 if grad is None
                                 else rel_err(grad, p64[name].grad))
                limits["d" + name] = TOL_PARAM
            errs.append({kk: float(f"{vv:.3g}") for kk, vv in e.items()})
            for kk, vv in e.items():
                worst = max(worst, vv / limits[kk])
        rec.update(ok=bool(worst <= 1.0), worst_of_limit=round(worst, 3),
                   rel_err_by_step=errs)
        return rec
    finally:
        layer.close()


# ------------------------------------------------------------------- bench


def eager_times(x, g, layer, device, args):
    from mhc_client import eager
    p = reference_params(layer, device)

    def run():
        # The mixing in fp32; the sublayer's input and the output in x's dtype.
        return eager.layer(x, p, layer.spec, nn.Identity(),
                           compute_dtype=torch.float32)

    def fwd():
        with torch.no_grad():
            run()

    def step():
        x.grad = None
        run().backward(g)

    try:
        n_fwd = warm_up(fwd, device, args.warmup, args.steps, args.budget_s)
        fwd_ms = time_ms(fwd, device, n_fwd)
        n_step = warm_up(step, device, args.warmup, args.steps, args.budget_s)
        step_ms = time_ms(step, device, n_step)
        return {"eager_fwd_ms": round(fwd_ms, 3), "eager_step_ms": round(step_ms, 3)}
    except Exception as e:  # noqa: BLE001  (an OOM is a result)
        if not is_oom(e):
            raise
        return {"eager_fwd_ms": None, "eager_step_ms": None,
                "eager_skipped": "out of memory"}
    finally:
        x.grad = None
        p.clear()  # frees the baseline's parameter copies and gradients
        if device.type == "cuda":
            torch.cuda.empty_cache()


def daemon_times(layer, x, g, device, args):
    def fwd():
        with torch.no_grad():
            layer(x)

    def step():
        x.grad = None
        layer(x).backward(g)

    out = {}
    for key, fn in (("fwd", fwd), ("step", step)):
        steps = warm_up(fn, device, args.warmup, args.steps, args.budget_s)
        before = settled_scrape(args.metrics) if args.metrics else None
        ms, host_ms = time_wall_and_host(fn, device, steps)
        out[key] = {"ms": ms, "host_ms": host_ms, "steps": steps}
        if before is not None:
            out[key].update(delta(before, settled_scrape(args.metrics), steps))
    x.grad = None
    return out


def row(cfg, n, transport, **fields):
    """A result line; every field of the schema is present, null when not
    measured (skipped rows, no metrics URL)."""
    b, t, c = cfg
    rec = {"config": f"{b},{t},{c}", "M": b * t, "n": n, "C": c,
           "transport": transport, "backward_thread": BACKWARD_THREAD[0]}
    rec.update({k: None for k in ("fwd_ms", "step_ms", "kernel_ms", "ratio",
                                  "eager_fwd_ms", "eager_step_ms",
                                  "calls_per_step")})
    rec.update(fields)
    return rec


def bench_row(clients, cfg, n, transport, x, g, eager, args, device, dtype):
    b, t, c = cfg
    m = b * t
    rec = row(cfg, n, transport, address=clients[transport].address,
              dtype=args.dtype, **eager)
    client = clients[transport]
    if transport == "inline" or (transport == "auto" and not client.is_local):
        limit = min(args.max_message_bytes,
                    client.server_info().limits.get("max_message_bytes") or (1 << 30))
        need = inline_bytes(m, n, c, x.element_size())
        if need > limit:
            rec["skipped"] = (f"inline message of {need / 2**20:.0f} MiB exceeds "
                              f"the {limit / 2**20:.0f} MiB limit")
            return rec
    from mhc_client import errors
    layer = make_layer(client, c, n, device, args.seed, transport)
    try:
        r = daemon_times(layer, x, g, device, args)
    except errors.ResourceExhausted as e:
        rec["skipped"] = f"ResourceExhausted: {e}"[:300]
        return rec
    except Exception as e:  # noqa: BLE001
        if not is_oom(e):
            raise
        rec["skipped"] = "out of memory"
        return rec
    finally:
        layer.close()
        x.grad = None
    fwd, step = r["fwd"], r["step"]
    rec.update(fwd_ms=round(fwd["ms"], 3), step_ms=round(step["ms"], 3),
               step_host_ms=round(step["host_ms"], 3), steps=step["steps"])
    if "kernel_ms" in step:
        rec.update(
            kernel_fwd_ms=round(fwd["kernel_ms"], 3),
            kernel_ms=round(step["kernel_ms"], 3),
            ratio=round(step["ms"] / step["kernel_ms"], 2) if step["kernel_ms"] > 0 else None,
            fwd_ratio=round(fwd["ms"] / fwd["kernel_ms"], 2) if fwd["kernel_ms"] > 0 else None,
            daemon_request_ms=round(step["request_ms"], 3),
            calls_per_step=round(step["calls"], 2),
            calls_per_fwd=round(fwd["calls"], 2),
            launches_per_step=round(step["launches"], 2),
            rpcs_per_step=step["by_rpc"])
    if rec.get("eager_step_ms"):
        rec["vs_eager_step"] = round(rec["eager_step_ms"] / rec["step_ms"], 2)
    return rec


def run_bench(clients, args, device, dtype, checked):
    """All rows; returns them and the number of rows that failed with an
    error other than a message limit or an out-of-memory (both skips)."""
    rows, failures = [], 0
    for cfg in args.configs:
        b, t, c = cfg
        for n in args.n:
            gen = torch.Generator(device=device).manual_seed(b * t + c + n)
            x = torch.randn(b, t, n, c, device=device, generator=gen).to(dtype)
            x.requires_grad_(True)
            g = torch.randn(b, t, n, c, device=device, generator=gen).to(dtype)
            eager = None
            for transport in args.transports:
                try:
                    if checked.get((n, transport)) is False:
                        rec = row(cfg, n, transport,
                                  skipped="failed its correctness check")
                    else:
                        if eager is None:
                            eager = {} if args.no_eager else eager_baseline(
                                clients[transport], x, g, n, device, args)
                        rec = bench_row(clients, cfg, n, transport, x, g, eager,
                                        args, device, dtype)
                except Exception as e:  # noqa: BLE001  (reported, counted)
                    failures += 1
                    rec = row(cfg, n, transport, skipped="error",
                              error=f"{type(e).__name__}: {e}"[:500])
                emit(rec, args)
                rows.append(rec)
            del x, g
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows, failures


def eager_baseline(client, x, g, n, device, args):
    """The in-process baseline, with the daemon layer's parameters."""
    probe = make_layer(client, x.shape[-1], n, device, args.seed)
    try:
        return eager_times(x, g, probe, device, args)
    finally:
        probe.close()


# ------------------------------------------------------------------ output


def emit(rec, args):
    line = json.dumps(rec)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


def fmt(v, spec="{:.2f}"):
    return "-" if v is None else spec.format(v)


def table(rows):
    head = ("| config (B,T,C) | n | transport | fwd ms | step ms | kernel ms "
            "| wall / kernel | eager fwd ms | eager step ms | eager / step "
            "| RPCs / step |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['config']} | {r['n']} | {r['transport']} | "
                         f"{'error: ' + r['error'] if r.get('error') else 'skipped: ' + r['skipped']}"
                         " | | | | | | | |")
            continue
        lines.append(
            f"| {r['config']} | {r['n']} | {r['transport']} | {fmt(r['fwd_ms'])} "
            f"| {fmt(r['step_ms'])} | {fmt(r.get('kernel_ms'))} "
            f"| {fmt(r.get('ratio'))} | {fmt(r.get('eager_fwd_ms'))} "
            f"| {fmt(r.get('eager_step_ms'))} | {fmt(r.get('vs_eager_step'))} "
            f"| {fmt(r.get('calls_per_step'), '{:g}')} |")
    return "\n".join(lines)


# -------------------------------------------------------------------- main


def parse_configs(text):
    if text == "all":
        return list(CONFIGS)
    out = []
    for item in text.split(","):
        item = item.strip()
        if "x" in item:
            b, t, c = (int(v) for v in item.split("x"))
            out.append((b, t, c))
        else:
            out.append(CONFIGS[int(item)])
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--unix", default="",
                    help="daemon address for ipc/auto, unix:/path")
    ap.add_argument("--tcp", default="",
                    help="daemon address for inline, host:port (default: --unix)")
    ap.add_argument("--metrics", default="",
                    help="daemon's Prometheus URL, http://host:port/metrics")
    ap.add_argument("--configs", default="all",
                    help="all, indices into %s, or BxTxC items, comma-separated"
                    % ", ".join("x".join(map(str, c)) for c in CONFIGS))
    ap.add_argument("--n", default="4,8", help="stream counts, comma-separated")
    ap.add_argument("--transports", default="",
                    help="ipc, inline, auto (default: ipc,inline on CUDA, "
                         "auto,inline on CPU)")
    ap.add_argument("--device", default="",
                    help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="most timed steps")
    ap.add_argument("--budget-s", type=float, default=10.0,
                    help="aim for this many seconds per timed loop")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0, help="RPC deadline")
    ap.add_argument("--max-message-bytes", type=int, default=1 << 30)
    ap.add_argument("--check", action="store_true",
                    help="only the correctness check (small config)")
    ap.add_argument("--no-check", action="store_true",
                    help="time without checking first")
    ap.add_argument("--no-eager", action="store_true",
                    help="skip the in-process baseline")
    ap.add_argument("--backward-thread", default="device",
                    choices=("device", "caller"),
                    help="where autograd runs the backward (see above)")
    ap.add_argument("--out", default="", help="also append JSON lines here")
    ap.add_argument("--table", default="", help="also write the table here")
    args = ap.parse_args(argv)
    args.configs = parse_configs(args.configs)
    args.n = [int(v) for v in args.n.split(",") if v]
    return args


def main(argv=None):
    args = parse_args(argv)
    if not args.device:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"error": "--device=cuda but torch sees no CUDA device"}))
        return 1
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = DTYPES[args.dtype]
    if args.backward_thread == "caller":
        if not hasattr(torch.autograd, "set_multithreading_enabled"):
            print(json.dumps({"error": "--backward-thread=caller needs torch >= 2.0"}))
            return 1
        # Thread-local: this thread takes every step.
        torch.autograd.set_multithreading_enabled(False)
    BACKWARD_THREAD[0] = args.backward_thread
    transports = [t for t in (args.transports or (
        "ipc,inline" if device.type == "cuda" else "auto,inline")).split(",") if t]
    for t in transports:
        if t not in ("ipc", "inline", "auto"):
            print(json.dumps({"error": f"unknown transport {t}"}))
            return 1
    args.transports = transports
    if not args.unix and not args.tcp:
        print(json.dumps({"error": "give --unix and/or --tcp"}))
        return 1

    import mhc_client
    clients, made = {}, {}
    for t in transports:
        # inline over TCP as a remote user would; ipc needs the local socket.
        address = (args.tcp or args.unix) if t == "inline" else (args.unix or args.tcp)
        if address not in made:
            client = mhc_client.Client(address, timeout=args.timeout,
                                       max_message_bytes=args.max_message_bytes)
            client.wait_for_ready(30)
            made[address] = client
        clients[t] = made[address]
    failures = 0
    try:
        info = next(iter(made.values())).server_info()
        emit({"torch": torch.__version__,
              "device": (torch.cuda.get_device_name(device)
                         if device.type == "cuda" else "cpu"),
              "daemon": info.version, "backend": info.backend,
              "daemon_devices": [d.name for d in info.devices],
              "addresses": {t: c.address for t, c in clients.items()},
              "metrics": args.metrics or None}, args)

        checked = {}
        if args.check or not args.no_check:
            for n in args.n:
                for t in transports:
                    try:
                        rec = check_path(clients[t], t, n, dtype, device)
                    except Exception as e:  # noqa: BLE001  (a failure, reported)
                        rec = {"check": True, "n": n, "transport": t, "ok": False,
                               "error": f"{type(e).__name__}: {e}"[:500]}
                    checked[(n, t)] = rec["ok"]
                    failures += 0 if rec["ok"] else 1
                    emit(rec, args)
        if args.check:
            print(f"e2e_torch check: {failures} failed")
            return min(failures, 125)

        rows, errors = run_bench(clients, args, device, dtype, checked)
        failures += errors
        md = table(rows)
        print("\n" + md)
        if args.table:
            with open(args.table, "w") as f:
                f.write(md + "\n")
        print(f"e2e_torch: {len(rows)} rows, "
              f"{sum('skipped' in r for r in rows)} skipped, {failures} failed")
        return min(failures, 125)
    finally:
        for client in made.values():
            client.close()


if __name__ == "__main__":
    sys.exit(main())
