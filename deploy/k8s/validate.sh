#!/usr/bin/env bash
# Checks the Kubernetes deployment and the images without a cluster or a
# container engine, with the pinned tools of deploy/tools (installed by
# scripts/install_deps.sh):
#  1. the generated monitoring objects are current (generate.py --check);
#  2. dockerfilelint on deploy/Dockerfile and deploy/Dockerfile.cuda;
#  3. every overlay renders (kubectl kustomize);
#  4. every rendered object validates against the Kubernetes and Prometheus
#     Operator schemas, unknown fields included (check_schemas.js), and a
#     broken object is rejected;
#  5. promtool check rules on the rendered PrometheusRule's groups;
#  6. the project's invariants (check_invariants.py), and its self-test,
#     which breaks each rule once and expects it caught.
#
#   deploy/k8s/validate.sh [OUT_DIR]   # OUT_DIR keeps the rendered overlays
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "${HERE}/../.." && pwd)"
TOOLS="${ROOT}/deploy/tools"
KUBECTL="${TOOLS}/bin/kubectl"
PYTHON=python3
[[ -x /usr/bin/python3 ]] && PYTHON=/usr/bin/python3

step() { echo "k8s-validate: $*"; }
fail() {
  echo "k8s-validate: FAIL: $*" >&2
  exit 1
}
[[ -x "${KUBECTL}" && -d "${TOOLS}/node_modules" ]] ||
  fail "deploy tools missing: run scripts/install_deps.sh (or deploy/tools/install.sh)"
command -v promtool >/dev/null || fail "promtool not found (scripts/install_deps.sh installs it)"

WORK="$(mktemp -d /tmp/mhcd-k8s-XXXXXX)"
trap 'rm -rf "${WORK}"' EXIT
OUT="${1:-${WORK}/rendered}"
mkdir -p "${OUT}"

step "generated objects match deploy/prometheus/alerts.yml and dashboards/"
"${PYTHON}" "${HERE}/generate.py" --check || fail "stale generated objects"

step "dockerfilelint $(node -p "require('${TOOLS}/node_modules/dockerfilelint/package.json').version")"
for dockerfile in "${ROOT}/deploy/Dockerfile" "${ROOT}/deploy/Dockerfile.cuda"; do
  node "${TOOLS}/node_modules/dockerfilelint/bin/dockerfilelint" "${dockerfile}" ||
    fail "dockerfilelint ${dockerfile#"${ROOT}/"}"
done

step "render overlays ($("${KUBECTL}" version --client | tr '\n' ' '))"
overlays=()
for dir in "${HERE}"/overlays/*/; do
  name="$(basename "${dir}")"
  "${KUBECTL}" kustomize "${dir}" >"${OUT}/${name}.yaml" || fail "kustomize ${name}"
  overlays+=("${name}")
done
[[ ${#overlays[@]} -ge 4 ]] || fail "expected 4 overlays, found ${overlays[*]}"

step "schemas (kubernetes-models, @kubernetes-models/prometheus-operator, typescript)"
node "${HERE}/check_schemas.js" "${OUT}"/*.yaml || fail "schemas"
# The schema check must reject a misspelt field and a mistyped value.
sed -e '0,/terminationGracePeriodSeconds:/s//terminationGracePeriod:/' \
  "${OUT}/gpu-node.yaml" >"${WORK}/typo.yaml"
sed -e '0,/periodSeconds: \([0-9]*\)$/s//periodSeconds: "\1"/' \
  "${OUT}/cpu.yaml" >"${WORK}/type.yaml"
for broken in typo type; do
  cmp -s "${WORK}/${broken}.yaml" "${OUT}/$([[ ${broken} == typo ]] && echo gpu-node || echo cpu).yaml" &&
    fail "self-test: the ${broken} mutation changed nothing"
  if node "${HERE}/check_schemas.js" "${WORK}/${broken}.yaml" >/dev/null 2>&1; then
    fail "self-test: check_schemas.js accepted a ${broken} error"
  fi
done

step "promtool check rules on the rendered PrometheusRule"
for name in "${overlays[@]}"; do
  "${PYTHON}" - "${OUT}/${name}.yaml" "${WORK}/${name}-rules.yml" <<'PY'
import sys, yaml
rule = next(d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] == "PrometheusRule")
yaml.safe_dump({"groups": rule["spec"]["groups"]}, open(sys.argv[2], "w"))
PY
  promtool check rules "${WORK}/${name}-rules.yml" >/dev/null || fail "promtool ${name}"
done

step "invariants"
"${PYTHON}" "${HERE}/check_invariants.py" "${OUT}" || fail "invariants"
"${PYTHON}" "${HERE}/check_invariants.py" --self-test "${OUT}" || fail "invariants self-test"
step "ok (${overlays[*]})"
