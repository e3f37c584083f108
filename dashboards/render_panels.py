#!/usr/bin/env python3
"""Renders the key dashboard panels to PNG from a Prometheus, with matplotlib.

The expressions come from the dashboard JSON files themselves, so the picture
shows exactly what Grafana would. deploy/prometheus/validate.sh runs it
against its test Prometheus; docs/img/mhcd-panels.png in docs/operations.md was made
that way (validate.sh MHCD MHCCTL docs/img).

  render_panels.py --prometheus http://127.0.0.1:9090 --out docs/img
"""
import argparse
import json
import math
import pathlib
import sys
import time
import urllib.parse
import urllib.request

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
# (dashboard, panel title, y scale factor, y label)
PANELS = [
    ("mhcd-kernels", "Kernel time p50 by op", 1e6, "microseconds"),
    ("mhcd-kernels", "Kernel time p99 by op", 1e6, "microseconds"),
    ("mhcd-kernels", "Roofline: median fraction of copy bandwidth", 100, "% of copy bandwidth"),
    ("mhcd-kernels", "Achieved bandwidth by op", 1e-9, "GB/s"),
    ("mhcd-service", "Requests per second by RPC", 1, "requests/s"),
    ("mhcd-determinism", "Checks per second by check and result", 1, "checks/s"),
]
SUBSTITUTIONS = {
    "$__rate_interval": "30s",
    "$__range": "5m",
    "$__interval": "5s",
    "$namespace": ".*",
    "$pod": ".*",
    "$device": ".*",
}


def substitute(expr):
    for key, value in SUBSTITUTIONS.items():
        expr = expr.replace(key, value)
    return expr


def legend(template, labels):
    out = template
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out


def query_range(url, expr, start, end, step):
    params = urllib.parse.urlencode(
        {"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{params}", timeout=30) as r:
        body = json.load(r)
    if body["status"] != "success":
        raise ValueError(body.get("error"))
    return body["data"]["result"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", required=True)
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--minutes", type=float, default=2.0,
                        help="time range ending now")
    args = parser.parse_args()
    url = args.prometheus.rstrip("/")
    end = time.time()
    start = end - args.minutes * 60
    boards = {}
    fig, axes = plt.subplots(3, 2, figsize=(13, 11), constrained_layout=True)
    for ax, (uid, title, scale, unit) in zip(axes.flat, PANELS):
        if uid not in boards:
            boards[uid] = json.loads((HERE / f"{uid}.json").read_text())
        panel = next(p for p in boards[uid]["panels"] if p["title"] == title)
        lines = 0
        for target in panel["targets"]:
            for series in query_range(url, substitute(target["expr"]), start, end, 1):
                points = [(float(t) - end, float(v) * scale) for t, v in series["values"]
                          if math.isfinite(float(v))]
                if not points:
                    continue
                xs, ys = zip(*points)
                ax.plot(xs, ys, label=legend(target["legendFormat"], series["metric"]))
                lines += 1
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("seconds before now")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        if lines:
            ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("mhcd dashboards (cpu backend, short load)", fontsize=13)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "mhcd-panels.png"
    fig.savefig(path, dpi=80)
    print(f"render_panels: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
