#!/usr/bin/env bash
# Validates the observability artefacts with the real tools:
#  1. dashboards/*.json are what dashboards/generate.py writes;
#  2. promtool check rules / test rules on alerts.yml, check config on
#     prometheus.yml (its Kubernetes discovery swapped for a static target
#     when this promtool lacks it, as Debian's does);
#  3. promtool check metrics on a live scrape of mhcd;
#  4. a real Prometheus on loopback scrapes mhcd under a short bounded load,
#     then every dashboard and rule expression is queried through its HTTP
#     API (check_queries.py) and the key panels are rendered to PNG.
#
#   validate.sh MHCD MHCCTL [PNG_DIR]
#
# PNG_DIR defaults to a temporary directory (the PNG is checked, then
# discarded). Ports are picked on 127.0.0.1 at run time; every process this
# script starts is stopped on exit.
set -euo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: $0 MHCD MHCCTL [PNG_DIR]" >&2
  exit 2
fi
MHCD="$(realpath "$1")"
MHCCTL="$(realpath "$2")"
PNG_DIR="${3:-}"
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "${HERE}/../.." && pwd)"
# Debian's interpreter, which has python3-yaml and python3-matplotlib.
PYTHON=python3
[[ -x /usr/bin/python3 ]] && PYTHON=/usr/bin/python3
LOAD_ROUNDS="${LOAD_ROUNDS:-12}"

WORK="$(mktemp -d /tmp/mhcd-validate-XXXXXX)"
PIDS=()
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do
    kill -TERM "${pid}" 2>/dev/null || true
  done
  for pid in "${PIDS[@]}"; do
    wait "${pid}" 2>/dev/null || true
  done
  rm -rf "${WORK}"
}
trap cleanup EXIT

step() { echo "validate: $*"; }
fail() {
  echo "validate: FAIL: $*" >&2
  exit 1
}
for tool in promtool prometheus curl; do
  command -v "${tool}" >/dev/null || fail "${tool} not found (scripts/install_deps.sh installs it)"
done

step "dashboards match dashboards/generate.py"
"${PYTHON}" "${ROOT}/dashboards/generate.py" --check || fail "stale dashboards"

step "promtool check rules / test rules"
promtool check rules "${HERE}/alerts.yml" >/dev/null || fail "check rules"
(cd "${HERE}" && promtool test rules alerts_test.yml) || fail "test rules"

step "promtool check config prometheus.yml"
if ! promtool check config "${HERE}/prometheus.yml" >"${WORK}/config.log" 2>&1; then
  grep -q "kubernetes_sd_configs not found" "${WORK}/config.log" ||
    { cat "${WORK}/config.log" >&2; fail "check config"; }
  # This promtool was built without Kubernetes discovery: check everything
  # else (relabelling, rule files) with a static target in its place.
  "${PYTHON}" - "${HERE}/prometheus.yml" "${WORK}/prometheus-static.yml" <<'PY'
import sys, yaml
config = yaml.safe_load(open(sys.argv[1]))
for job in config["scrape_configs"]:
    if job.pop("kubernetes_sd_configs", None) is not None:
        job["static_configs"] = [{"targets": ["127.0.0.1:9464"]}]
config["rule_files"] = [sys.argv[1].rsplit("/", 1)[0] + "/" + f for f in config["rule_files"]]
yaml.safe_dump(config, open(sys.argv[2], "w"))
PY
  promtool check config "${WORK}/prometheus-static.yml" >/dev/null ||
    fail "check config (static variant)"
  echo "validate: note: promtool lacks kubernetes_sd_configs; checked the rest"
fi

step "Kubernetes daemons match the scrape config"
"${PYTHON}" - "${ROOT}/deploy/k8s/overlays" <<'PY' || fail "deploy/k8s"
import pathlib, sys, yaml
# prometheus.yml keeps pods labelled app.kubernetes.io/name=mhcd on the
# container port named "metrics", and mhcd must listen beyond loopback.
# (deploy/k8s/validate.sh checks the rendered overlays in full.)
found = 0
for f in sorted(pathlib.Path(sys.argv[1]).glob("*/*.yaml")):
    for d in yaml.safe_load_all(f.read_text()):
        if not d or d.get("kind") not in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
            continue
        pod = d["spec"]["template"]
        spec = pod["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            if not any(a.startswith("--listen=") for a in c.get("args", [])):
                continue
            found += 1
            assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "mhcd", f
            port = next(p for p in c["ports"] if p["name"] == "metrics")
            assert f"--metrics_listen=0.0.0.0:{port['containerPort']}" in c["args"], f
assert found >= 4, f"{found} daemon containers in deploy/k8s/overlays"
PY

step "start mhcd"
"${MHCD}" --listen="unix:${WORK}/mhcd.sock" --metrics_listen=127.0.0.1:0 \
  --backend=cpu --threads=2 --determinism_audit_rate=0.5 \
  --batch_invariance_audit_rate=0.5 --state_dir="${WORK}/state" \
  >"${WORK}/mhcd.out" 2>"${WORK}/mhcd.err" &
PIDS+=($!)
for _ in $(seq 300); do
  grep -q "^mhcd: ready" "${WORK}/mhcd.out" 2>/dev/null && break
  kill -0 "${PIDS[0]}" 2>/dev/null || { cat "${WORK}/mhcd.err" >&2; fail "mhcd exited"; }
  sleep 0.1
done
grep -q "^mhcd: ready" "${WORK}/mhcd.out" || fail "mhcd not ready in 30 s"
METRICS="$(sed -n 's|^mhcd: metrics on http://\(.*\)/metrics$|\1|p' "${WORK}/mhcd.out")"
ADDRESS="unix:${WORK}/mhcd.sock"
ctl() { "${MHCCTL}" --address="${ADDRESS}" "$@" >/dev/null; }

# Bounded load: LOAD_ROUNDS rounds of small forward+backward layers over the
# dtypes and layouts, each followed by an optimizer step, one Execute-free
# error per round (NOT_FOUND), and a checkpoint saved and loaded back.
load() {
  local round dtypes=(bf16 fp32 fp16) presets=(deepseek_v4 transformer_engine)
  local optimizers=(adamw sgd)
  for ((round = 0; round < LOAD_ROUNDS; round++)); do
    ctl run --tokens=$((16 + 8 * round)) --hidden=128 --iterations=2 \
      --dtype="${dtypes[round % 3]}" --preset="${presets[round % 2]}" \
      --optimizer="${optimizers[round % 2]}"
    ctl layer show no-such-layer 2>/dev/null && fail "expected NOT_FOUND" || true
    ctl checkpoint save ci
    ctl checkpoint load ci --replace
    sleep 0.5
  done
}
ctl run --tokens=8 --hidden=32
ctl layer create --name=kept --hidden=64

step "promtool check metrics on a live scrape"
curl -fsS "http://${METRICS}/metrics" >"${WORK}/scrape.txt"
promtool check metrics <"${WORK}/scrape.txt" || fail "promtool check metrics"
for family in mhcd_kernel_duration_seconds mhcd_determinism_checks_total \
  process_cpu_seconds_total mhcd_build_info; do
  grep -q "^# TYPE ${family} " "${WORK}/scrape.txt" || fail "scrape lacks ${family}"
done

step "start Prometheus on loopback"
PROM_PORT="$("${PYTHON}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
PROM="http://127.0.0.1:${PROM_PORT}"
cat >"${WORK}/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - ${HERE}/alerts.yml
scrape_configs:
  - job_name: mhcd
    static_configs:
      - targets: ["${METRICS}"]
        labels: {namespace: ci, pod: mhcd-ci}
YAML
prometheus --config.file="${WORK}/prometheus.yml" \
  --storage.tsdb.path="${WORK}/tsdb" --web.listen-address="127.0.0.1:${PROM_PORT}" \
  --log.level=warn >"${WORK}/prometheus.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 300); do
  curl -fsS "${PROM}/-/ready" >/dev/null 2>&1 && break
  kill -0 "${PIDS[1]}" 2>/dev/null || { cat "${WORK}/prometheus.log" >&2; fail "prometheus exited"; }
  sleep 0.1
done
curl -fsS "${PROM}/-/ready" >/dev/null || fail "prometheus not ready in 30 s"

# Discovery hands targets to the scrape loop a few seconds after start;
# load before the first scrape would be invisible to rate().
for _ in $(seq 300); do
  curl -fsS "${PROM}/api/v1/query?query=up" 2>/dev/null | grep -q '"value"' && break
  sleep 0.1
done

step "load (${LOAD_ROUNDS} rounds)"
load
sleep 3  # a few more scrapes and rule evaluations after the load

step "query every dashboard panel and rule through Prometheus"
"${PYTHON}" "${HERE}/check_queries.py" --prometheus "${PROM}" \
  --dashboards "${ROOT}/dashboards" --rules "${HERE}/alerts.yml" ||
  fail "dashboard or rule queries"

step "render panels"
OUT="${PNG_DIR:-${WORK}/png}"
"${PYTHON}" "${ROOT}/dashboards/render_panels.py" --prometheus "${PROM}" \
  --out "${OUT}" --minutes 1
[[ -s "${OUT}/mhcd-panels.png" ]] || fail "no PNG"
step "ok"
