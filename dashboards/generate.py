#!/usr/bin/env python3
"""Writes the Grafana dashboards (dashboards/*.json) of mhcd.

The JSON files are generated so that every panel follows the same rules
(datasource variable, namespace/pod/device filters, $__rate_interval, a unit
on every panel); CI checks that the committed files equal this script's
output and queries every expression against a live Prometheus.

  python3 dashboards/generate.py          # rewrite the files
  python3 dashboards/generate.py --check  # exit 1 if a file is stale
"""
import json
import pathlib
import sys

SCHEMA_VERSION = 39
DS = {"type": "prometheus", "uid": "${datasource}"}
POD = 'namespace=~"$namespace", pod=~"$pod"'
DEV = POD + ', device=~"$device"'
RI = "$__rate_interval"


def variables():
    def query(name, label, definition):
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DS,
            "definition": definition,
            "query": {"query": definition, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
            "refresh": 2,
            "sort": 1,
            "current": {},
            "options": [],
            "hide": 0,
        }

    return [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "options": [],
            "refresh": 1,
            "hide": 0,
        },
        query("namespace", "Namespace", "label_values(mhcd_build_info, namespace)"),
        query("pod", "Pod", 'label_values(mhcd_build_info{namespace=~"$namespace"}, pod)'),
        query(
            "device",
            "Device",
            "label_values(mhcd_queue_depth{" + POD + "}, device)",
        ),
    ]


class Board:
    def __init__(self, uid, title, description):
        self.uid, self.title, self.description = uid, title, description
        self.panels = []
        self.x = self.y = 0

    def panel(self, title, unit, targets, kind="timeseries", width=12, height=8,
              description="", extra=None):
        if self.x + width > 24:
            self.x, self.y = 0, self.y + height
        refs = "ABCDEFGH"
        panel = {
            "id": len(self.panels) + 1,
            "type": kind,
            "title": title,
            "description": description,
            "datasource": DS,
            "gridPos": {"h": height, "w": width, "x": self.x, "y": self.y},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {},
            "targets": [
                {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": refs[i]}
                for i, (expr, legend) in enumerate(targets)
            ],
        }
        if kind == "timeseries":
            panel["options"] = {
                "legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                           "calcs": ["lastNotNull", "max"]},
                "tooltip": {"mode": "multi", "sort": "desc"},
            }
        elif kind == "stat":
            panel["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                                  "values": False},
                                "colorMode": "value", "graphMode": "none"}
        if extra:
            panel.update(extra)
        self.panels.append(panel)
        self.x += width
        return panel

    def json(self):
        return {
            "annotations": {"list": []},
            "description": self.description,
            "editable": True,
            "graphTooltip": 1,
            "links": [{"asDropdown": True, "includeVars": True, "keepTime": True,
                       "tags": ["mhcd"], "title": "mhcd", "type": "dashboards"}],
            "panels": self.panels,
            "refresh": "30s",
            "schemaVersion": SCHEMA_VERSION,
            "tags": ["mhcd"],
            "templating": {"list": variables()},
            "time": {"from": "now-1h", "to": "now"},
            "timepicker": {},
            "timezone": "",
            "title": self.title,
            "uid": self.uid,
            "version": 1,
        }


def quantile(q, metric, by, selector):
    return (f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate({metric}_bucket{{{selector}}}[{RI}])))")


def kernels():
    b = Board("mhcd-kernels", "mhcd / Kernel performance",
              "Device time, bandwidth and roofline of every kernel launch.")
    for q, name in ((0.5, "p50"), (0.95, "p95"), (0.99, "p99")):
        b.panel(f"Kernel time {name} by op", "s",
                [(quantile(q, "mhcd_kernel_duration_seconds", "op, direction", DEV),
                  "{{op}} {{direction}}")],
                width=8)
    b.panel("Kernel time heatmap (all ops)", "s",
            [(f"sum by (le) (increase(mhcd_kernel_duration_seconds_bucket{{{DEV}}}[{RI}]))",
              "{{le}}")],
            kind="heatmap", width=12,
            extra={"options": {"calculate": False, "yAxis": {"unit": "s"},
                               "color": {"mode": "scheme", "scheme": "Oranges"},
                               "cellGap": 1, "tooltip": {"show": True}},
                   })
    b.panels[-1]["targets"][0]["format"] = "heatmap"
    b.panel("Roofline: median fraction of copy bandwidth", "percentunit",
            [(quantile(0.5, "mhcd_kernel_roofline_ratio", "op, direction", DEV),
              "{{op}} {{direction}}")],
            description="Achieved bytes/s of a launch over the device's copy bandwidth "
                        "(mhcd_device_copy_bandwidth_bytes_per_second).")
    b.panel("Achieved bandwidth by op", "Bps",
            [(f"sum by (op, direction) (rate(mhcd_kernel_bytes_total{{{DEV}}}[{RI}])) / "
              f"sum by (op, direction) (rate(mhcd_kernel_duration_seconds_sum{{{DEV}}}[{RI}]))",
              "{{op}} {{direction}}")])
    b.panel("Copy bandwidth (roofline denominator)", "Bps",
            [(f"max by (pod, device) (mhcd_device_copy_bandwidth_bytes_per_second{{{DEV}}})",
              "{{pod}} {{device}}")])
    b.panel("Launches per second by op", "ops",
            [(f"sum by (op, direction) (rate(mhcd_kernel_duration_seconds_count{{{DEV}}}[{RI}]))",
              "{{op}} {{direction}}")])
    b.panel("Tokens per launch (p50, p99)", "none",
            [(quantile(0.5, "mhcd_kernel_tokens", "op, direction", DEV), "p50 {{op}} {{direction}}"),
             (quantile(0.99, "mhcd_kernel_tokens", "op, direction", DEV), "p99 {{op}} {{direction}}")])
    b.panel("Kernel time p99 by dtype, layout and n", "s",
            [(quantile(0.99, "mhcd_kernel_duration_seconds", "op, direction, dtype, layout, n", DEV),
              "{{op}} {{direction}} {{dtype}} {{layout}} n={{n}}")])
    return b


def service():
    b = Board("mhcd-service", "mhcd / Service",
              "Requests, errors, latency and queueing of the mhcd gRPC service.")
    b.panel("Serving (scrape up)", "none",
            [(f"up{{{POD}}}", "{{pod}}")], kind="stat", width=6, height=4)
    b.panel("Build", "none",
            [(f"mhcd_build_info{{{POD}}}", "{{pod}} {{version}} {{commit}} {{backend}}")],
            kind="stat", width=18, height=4)
    b.panel("Requests per second by RPC", "reqps",
            [(f"sum by (rpc) (rate(mhcd_requests_total{{{POD}}}[{RI}]))", "{{rpc}}")])
    b.panel("Errors per second by code", "reqps",
            [(f'sum by (code) (rate(mhcd_requests_total{{{POD}, code!="OK"}}[{RI}]))', "{{code}}")])
    b.panel("Error ratio", "percentunit",
            [(f'sum(rate(mhcd_requests_total{{{POD}, code!="OK"}}[{RI}])) / '
              f"sum(rate(mhcd_requests_total{{{POD}}}[{RI}]))", "all codes but OK")])
    b.panel("Request latency p50 / p99 by RPC", "s",
            [(quantile(0.5, "mhcd_request_duration_seconds", "rpc", POD), "p50 {{rpc}}"),
             (quantile(0.99, "mhcd_request_duration_seconds", "rpc", POD), "p99 {{rpc}}")])
    b.panel("In flight and queued", "short",
            [(f"sum by (pod) (mhcd_inflight_requests{{{POD}}})", "in flight {{pod}}"),
             (f"sum by (pod, device) (mhcd_queue_depth{{{DEV}}})", "queued {{pod}} {{device}}")])
    b.panel("Queue wait p50 / p99", "s",
            [(quantile(0.5, "mhcd_queue_wait_seconds", "device", DEV), "p50 {{device}}"),
             (quantile(0.99, "mhcd_queue_wait_seconds", "device", DEV), "p99 {{device}}")])
    b.panel("Optimizer steps per second", "ops",
            [(f"sum by (device, algorithm) (rate(mhcd_optimizer_steps_total{{{DEV}}}[{RI}]))",
              "{{device}} {{algorithm}}")],
            description="OptimizerStep calls that updated parameters.")
    b.panel("Optimizer step time p50 / p99", "s",
            [(quantile(0.5, "mhcd_optimizer_step_duration_seconds", "device, algorithm", DEV),
              "p50 {{device}} {{algorithm}}"),
             (quantile(0.99, "mhcd_optimizer_step_duration_seconds", "device, algorithm", DEV),
              "p99 {{device}} {{algorithm}}")],
            description="Time a step holds its device, including the wait for the "
                        "device when the request returns the gradient norm.")
    b.panel("Data-parallel groups by state", "short",
            [(f"sum by (state) (mhcd_groups{{{POD}}})", "{{state}}")], width=8,
            description="Groups on the daemons (FORMING, READY, FAILED); a FAILED "
                        "group lost a member or timed out and must be re-formed.")
    b.panel("Group all-reduce time p50 / p99", "s",
            [(quantile(0.5, "mhcd_group_collective_seconds", "op", POD), "p50 {{op}}"),
             (quantile(0.99, "mhcd_group_collective_seconds", "op", POD), "p99 {{op}}")],
            width=8,
            description="Collectives of data-parallel groups, issue to completion "
                        "(empty until a group runs one).")
    b.panel("Group bus bandwidth p50", "Bps",
            [(quantile(0.5, "mhcd_group_bus_bandwidth_bytes_per_second", "op", POD),
              "{{op}}")], width=8,
            description="Bus bandwidth of group collectives, comparable across "
                        "group sizes (empty until a group runs one).")
    return b


def determinism():
    b = Board("mhcd-determinism", "mhcd / Determinism",
              "Results of the determinism audit (--determinism_audit_rate, "
              "--batch_invariance_audit_rate).")
    b.panel("Mismatches in range", "none",
            [(f'sum(increase(mhcd_determinism_checks_total{{{POD}, result="mismatch"}}[$__range]))',
              "mismatches")], kind="stat", width=8, height=4)
    b.panel("Largest ulp difference", "none",
            [(f"max(mhcd_determinism_max_ulp_difference{{{POD}}})", "ulp")],
            kind="stat", width=8, height=4)
    b.panel("Last mismatch", "dateTimeFromNow",
            [(f"max(mhcd_determinism_last_mismatch_timestamp_seconds{{{POD}}}) * 1000 > 0 "
              f"or vector(0)", "last")],
            kind="stat", width=8, height=4,
            description="0 (the epoch) when no mismatch was ever seen.")
    b.panel("Checks per second by check and result", "ops",
            [(f"sum by (check, result) (rate(mhcd_determinism_checks_total{{{POD}}}[{RI}]))",
              "{{check}} {{result}}")])
    b.panel("Mismatches by op", "none",
            [(f'sum by (op, direction, check) (increase(mhcd_determinism_checks_total'
              f'{{{POD}, result="mismatch"}}[{RI}]))', "{{op}} {{direction}} {{check}}")])
    b.panel("Max ulp difference by op", "none",
            [(f"max by (op, direction, check) (mhcd_determinism_max_ulp_difference{{{POD}}})",
              "{{op}} {{direction}} {{check}}")])
    b.panel("Audited fraction of launches", "percentunit",
            [(f'sum by (check) (rate(mhcd_determinism_checks_total{{{POD}}}[{RI}])) / '
              f"scalar(sum(rate(mhcd_kernel_duration_seconds_count{{{POD}}}[{RI}])))",
              "{{check}}")])
    return b


def resources():
    b = Board("mhcd-resources", "mhcd / Resources",
              "Device memory, shared memory and process resources of mhcd.")
    b.panel("Device memory", "bytes",
            [(f"sum by (device) (mhcd_parameter_bytes{{{DEV}}})", "parameters {{device}}"),
             (f"sum by (device) (mhcd_gradient_bytes{{{DEV}}})", "gradients {{device}}"),
             (f"sum by (device) (mhcd_optimizer_state_bytes{{{DEV}}})",
              "optimizer state {{device}}"),
             (f"sum by (device) (mhcd_workspace_bytes{{{DEV}}})", "workspace {{device}}"),
             (f"sum by (device) (mhcd_staging_bytes{{{DEV}}})", "staging {{device}}")])
    b.panel("Layers", "short",
            [(f"sum by (device) (mhcd_layers{{{DEV}}})", "{{device}}")])
    b.panel("Shared-memory regions by kind", "short",
            [(f"sum by (kind) (mhcd_shm_regions{{{POD}}})", "{{kind}}")])
    b.panel("Shared-memory bytes by kind", "bytes",
            [(f"sum by (kind) (mhcd_shm_region_bytes{{{POD}}})", "{{kind}}"),
             (f"sum(mhcd_shm_pinned_bytes{{{POD}}})", "page-locked")])
    b.panel("Client GPU memory mapped (CUDA IPC)", "bytes",
            [(f"sum(mhcd_cuda_ipc_mapped_bytes{{{POD}}})", "mapped"),
             (f"sum(mhcd_cuda_ipc_mappings{{{POD}}})", "allocations")])
    b.panel("Host waits for the device", "ops",
            [(f"sum by (device, reason) (rate(mhcd_host_synchronizations_total{{{DEV}}}[{RI}]))",
              "{{device}} {{reason}}")])
    b.panel("Checkpoint throughput", "Bps",
            [(f"sum by (direction) (rate(mhcd_checkpoint_bytes_total{{{POD}}}[{RI}]))",
              "{{direction}}")], width=8,
            description="Bytes of checkpoint files written (save) and of tensor "
                        "data read (load); see docs/checkpoints.md.")
    b.panel("Checkpoint duration p50 / p99", "s",
            [(quantile(0.5, "mhcd_checkpoint_duration_seconds", "direction", POD),
              "p50 {{direction}}"),
             (quantile(0.99, "mhcd_checkpoint_duration_seconds", "direction", POD),
              "p99 {{direction}}")], width=8)
    b.panel("Last checkpoint", "dateTimeFromNow",
            [(f"max by (direction) (mhcd_checkpoint_last_success_timestamp_seconds{{{POD}}}) "
              f"* 1000", "{{direction}}")],
            kind="stat", width=8,
            description="Last successful save and load; 0 (the epoch) when there "
                        "was none since the daemon started.")
    b.panel("Resident memory", "bytes",
            [(f"process_resident_memory_bytes{{{POD}}}", "{{pod}}")], width=8)
    b.panel("CPU (cores)", "short",
            [(f"rate(process_cpu_seconds_total{{{POD}}}[{RI}])", "{{pod}}")], width=8)
    b.panel("Open file descriptors", "short",
            [(f"process_open_fds{{{POD}}}", "open {{pod}}"),
             (f"process_max_fds{{{POD}}}", "limit {{pod}}")], width=8)
    b.panel("Uptime", "s",
            [(f"time() - process_start_time_seconds{{{POD}}}", "{{pod}}")],
            kind="stat", width=24, height=4)
    return b


def main():
    out_dir = pathlib.Path(__file__).resolve().parent
    check = "--check" in sys.argv[1:]
    stale = []
    for board in (kernels(), service(), determinism(), resources()):
        path = out_dir / f"{board.uid}.json"
        text = json.dumps(board.json(), indent=2, sort_keys=True) + "\n"
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print("dashboards stale (run python3 dashboards/generate.py):", *stale)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
