#!/usr/bin/env python3
"""Checks the dashboards and alert rules against a live Prometheus.

Run by validate.sh once Prometheus has scraped mhcd under load:
- every dashboard follows the house rules (current schemaVersion, the
  datasource/namespace/pod/device variables, a unit and the datasource
  variable on every panel, $__rate_interval instead of fixed windows);
- every variable query and every panel expression is valid PromQL and
  returns at least one finite value;
- every alert expression is valid and Prometheus evaluates it without error;
- every metric a panel or rule names is one the daemon exports (present in
  Prometheus), so a dashboard naming a metric that does not exist fails.
"""
import argparse
import json
import math
import pathlib
import re
import sys
import urllib.parse
import urllib.request

import yaml

SCHEMA_VERSION = 39
VARIABLES = {"datasource", "namespace", "pod", "device"}
# Values a Grafana user would get with "All" selected and a 1 s scrape.
SUBSTITUTIONS = {
    "$__rate_interval": "30s",
    "$__range": "5m",
    "$__interval": "5s",
    "$namespace": ".*",
    "$pod": ".*",
    "$device": ".*",
}
METRIC = re.compile(r"\b((?:mhcd|process)_[a-z0-9_]+)\b")
# Families that get samples only once a data-parallel group ran a collective,
# which needs two GPUs: the CPU daemon this check scrapes never exports them.
# Their names are checked against the daemon's source instead, and panels
# drawn from them alone may be empty.
GROUP_ONLY = {"mhcd_group_collective_seconds",
              "mhcd_group_collective_bytes_total",
              "mhcd_group_bus_bandwidth_bytes_per_second"}
METRICS_SOURCE = pathlib.Path(__file__).resolve().parents[2] / "server" / "metrics.cc"


def base_name(name):
    return re.sub(r"_(bucket|count|sum)$", "", name)
WINDOW = re.compile(r"\[(\d+[smhd])\]")


def substitute(expr):
    for key, value in SUBSTITUTIONS.items():
        expr = expr.replace(key, value)
    return expr


class Prometheus:
    def __init__(self, url):
        self.url = url.rstrip("/")

    def get(self, path, **params):
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            body = json.load(e)
        if body.get("status") != "success":
            raise ValueError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr):
        return self.get("/api/v1/query", query=expr)


def finite_values(data):
    if data["resultType"] == "scalar":
        values = [data["result"][1]]
    else:
        values = [sample["value"][1] for sample in data["result"]]
    return [v for v in map(float, values) if math.isfinite(v)]


def check_metric_names(prom, where, expr, errors, seen):
    for name in sorted(set(METRIC.findall(expr))):
        if base_name(name) in GROUP_ONLY:
            if f'"{base_name(name)}"' not in METRICS_SOURCE.read_text():
                errors.append(f"{where}: metric {name} is not defined by mhcd")
            continue
        if name in seen:
            if not seen[name]:
                errors.append(f"{where}: metric {name} is not exported by mhcd")
            continue
        data = prom.query(f'count({{__name__="{name}"}})')
        seen[name] = bool(data["result"])
        if not seen[name]:
            errors.append(f"{where}: metric {name} is not exported by mhcd")


def check_dashboard(prom, path, errors, seen):
    board = json.loads(path.read_text())
    name = path.name
    if board.get("schemaVersion") != SCHEMA_VERSION:
        errors.append(f"{name}: schemaVersion {board.get('schemaVersion')}, "
                      f"expected {SCHEMA_VERSION}")
    variables = {v["name"]: v for v in board.get("templating", {}).get("list", [])}
    missing = VARIABLES - variables.keys()
    if missing:
        errors.append(f"{name}: missing variables {sorted(missing)}")
    queries = 0
    for var in variables.values():
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["definition"])
        if not m:
            errors.append(f"{name}: variable {var['name']}: expected label_values(...)")
            continue
        expr = substitute(f"count by ({m.group(2)}) ({m.group(1)})")
        try:
            result = prom.query(expr)["result"]
        except ValueError as e:
            errors.append(f"{name}: variable {var['name']}: {e}")
            continue
        if not any(s["metric"].get(m.group(2)) for s in result):
            errors.append(f"{name}: variable {var['name']} has no values")
        check_metric_names(prom, f"{name}: variable {var['name']}", m.group(1),
                           errors, seen)
    for panel in board["panels"]:
        where = f"{name}: panel '{panel['title']}'"
        if not panel.get("fieldConfig", {}).get("defaults", {}).get("unit"):
            errors.append(f"{where}: no unit")
        if panel.get("datasource", {}).get("uid") != "${datasource}":
            errors.append(f"{where}: datasource is not ${{datasource}}")
        if not panel.get("targets"):
            errors.append(f"{where}: no targets")
        for target in panel.get("targets", []):
            expr = target["expr"]
            queries += 1
            if WINDOW.search(expr):
                errors.append(f"{where}: fixed range window in {expr!r}; "
                              "use $__rate_interval")
            check_metric_names(prom, where, expr, errors, seen)
            try:
                values = finite_values(prom.query(substitute(expr)))
            except ValueError as e:
                errors.append(f"{where}: invalid query {expr!r}: {e}")
                continue
            group_only = all(base_name(m) in GROUP_ONLY
                             for m in METRIC.findall(expr))
            if not values and not group_only:
                errors.append(f"{where}: no data for {substitute(expr)!r}")
    return queries


def check_rules(prom, path, errors, seen):
    count = 0
    for group in yaml.safe_load(path.read_text())["groups"]:
        for rule in group["rules"]:
            count += 1
            where = f"{path.name}: {rule.get('alert') or rule.get('record')}"
            try:
                prom.query(rule["expr"])
            except ValueError as e:
                errors.append(f"{where}: invalid expression: {e}")
            check_metric_names(prom, where, rule["expr"], errors, seen)
    # The rules Prometheus itself loaded and evaluated.
    loaded = 0
    for group in prom.get("/api/v1/rules")["groups"]:
        for rule in group["rules"]:
            loaded += 1
            if rule.get("health") != "ok":
                errors.append(f"{path.name}: {rule['name']}: health "
                              f"{rule.get('health')}: {rule.get('lastError')}")
    if loaded != count:
        errors.append(f"{path.name}: Prometheus loaded {loaded} rules, file has {count}")
    return count


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", required=True)
    parser.add_argument("--dashboards", required=True, type=pathlib.Path)
    parser.add_argument("--rules", required=True, type=pathlib.Path)
    args = parser.parse_args()
    prom = Prometheus(args.prometheus)
    errors, seen = [], {}
    boards = sorted(args.dashboards.glob("*.json"))
    if not boards:
        errors.append(f"no dashboards in {args.dashboards}")
    queries = sum(check_dashboard(prom, b, errors, seen) for b in boards)
    rules = check_rules(prom, args.rules, errors, seen)
    for error in errors:
        print("check_queries: FAIL:", error)
    print(f"check_queries: {len(boards)} dashboards, {queries} panel queries, "
          f"{rules} rules, {len(seen)} metric names: "
          f"{'FAIL' if errors else 'ok'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
