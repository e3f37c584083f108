#!/usr/bin/env python3
"""Checks the project's own rules on the rendered overlays and the images.

The schema check (check_schemas.js) says each object is well formed; this one
says the objects fit together and fit mhcd:

- every daemon flag is one server/flags.cc defines; --backend is explicit and
  equals the pod's mhcd.io/expected-backend label (MhcdNotOnCuda reads it),
  and the image tag is the project version, with -cuda for --backend=cuda;
- one image everywhere in an overlay (daemon, init and client containers),
  from one repository across overlays, never :latest;
- gRPC startup, readiness and liveness probes on the daemon's TCP port, the
  ports named grpc and metrics on what --listen / --metrics_listen bind;
- terminationGracePeriodSeconds > --drain_timeout;
- requests (cpu, memory) and a memory limit on every container;
- the unix socket: --allow_shm with it, every client names the same
  unix:PATH, mounts the same volume (same pod volume, or the same hostPath)
  at the same directory, runs as the daemon's user (clients create their
  shared-memory regions mode 0600) and shares /dev/shm with the daemon
  (one pod's memory-backed emptyDir, or both in the host IPC namespace);
- the restricted Pod Security Standard for every pod in a namespace that
  enforces it; in one that does not, still no privileged container, no
  privilege escalation, capabilities dropped, a seccomp profile;
- the PodMonitor selects the daemons' pods and sets the job label the alert
  rules match; the PrometheusRule is deploy/prometheus/alerts.yml and the
  dashboard ConfigMaps are dashboards/*.json, labelled for the sidecar;
- Services and NetworkPolicies select the daemon pods and name their ports;
- the Dockerfiles: multi-stage, a numeric non-root USER, a HEALTHCHECK,
  the CUDA devel and runtime bases of one version, no :latest base.

  check_invariants.py RENDERED_DIR         # RENDERED_DIR/<overlay>.yaml
  check_invariants.py --self-test RENDERED_DIR

--self-test breaks the rendered objects one rule at a time and fails unless
every break is caught, so that no rule above is a check that cannot fail.
"""
import copy
import pathlib
import re
import subprocess
import sys
import tempfile

import yaml

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet", "Job", "Pod"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def project_version():
    m = re.search(r"project\(mhcd VERSION ([0-9.]+)", (ROOT / "CMakeLists.txt").read_text())
    return m.group(1)


def defined_flags():
    names = set()
    for path in (ROOT / "server").glob("*.cc"):
        names.update(re.findall(r"ABSL_FLAG\(\s*[\w:<>]+\s*,\s*(\w+)\s*,", path.read_text()))
    return names


def duration_seconds(text):
    """absl duration (30s, 500ms, 1m30s, 1h) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    parts = re.findall(r"([0-9.]+)(ms|us|ns|h|m|s)", text)
    if not parts or "".join(a + b for a, b in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(a) * units[b] for a, b in parts)


def flag_values(args):
    out = {}
    for arg in args:
        if arg.startswith("--"):
            name, _, value = arg[2:].partition("=")
            out[name] = value if "=" in arg else "true"
    return out


def pod_of(obj):
    """(pod metadata, pod spec) of a workload."""
    if obj["kind"] == "Pod":
        return obj["metadata"], obj["spec"]
    if obj["kind"] == "Job":
        template = obj["spec"]["template"]
    else:
        template = obj["spec"]["template"]
    return template.get("metadata", {}), template["spec"]


def all_containers(spec):
    return [("init", c) for c in spec.get("initContainers", [])] + \
           [("main", c) for c in spec.get("containers", [])]


def effective(pod_sc, container, key):
    sc = container.get("securityContext") or {}
    if key in sc:
        return sc[key]
    return (pod_sc or {}).get(key)


def matches(selector, labels):
    return all(labels.get(k) == v for k, v in (selector or {}).items())


class Checker:
    def __init__(self):
        self.errors = []
        self.version = project_version()
        self.flags = defined_flags()
        self.alerts = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
        self.dashboards = {p.name: p.read_text()
                           for p in sorted((ROOT / "dashboards").glob("*.json"))}

    def err(self, where, message):
        self.errors.append(f"{where}: {message}")

    # -- one overlay ---------------------------------------------------------
    def check_overlay(self, name, docs):
        w = name
        namespaces = [d for d in docs if d["kind"] == "Namespace"]
        enforce = None
        if len(namespaces) == 1:
            enforce = namespaces[0]["metadata"].get("labels", {}).get(
                "pod-security.kubernetes.io/enforce")
        else:
            self.err(w, f"expected one Namespace, found {len(namespaces)}")
        workloads = [d for d in docs if d["kind"] in WORKLOADS]
        images = set()
        daemons = []   # (obj, pod metadata, pod spec, container)
        pods = []
        for obj in workloads:
            meta, spec = pod_of(obj)
            pods.append((obj, meta, spec))
            for _, c in all_containers(spec):
                images.add(c.get("image"))
                if any(a.startswith("--listen=") for a in c.get("args", [])):
                    daemons.append((obj, meta, spec, c))
        if len(images) != 1:
            self.err(w, f"one image expected in the overlay, found {sorted(map(str, images))}")
        image = next(iter(images)) if images else ""
        if not daemons:
            self.err(w, "no daemon container (one with --listen=)")
        for obj, meta, spec, c in daemons:
            self.check_daemon(f"{w}: {obj['kind']}/{obj['metadata']['name']}/{c['name']}",
                              meta, spec, c, image)
        for obj, meta, spec in pods:
            where = f"{w}: {obj['kind']}/{obj['metadata']['name']}"
            self.check_pod_security(where, spec, enforce)
            for _, c in all_containers(spec):
                self.check_resources(f"{where}/{c['name']}", c)
        self.check_sockets(w, pods, daemons)
        self.check_monitoring(w, docs, daemons)
        self.check_services(w, docs, daemons)
        return image

    def check_daemon(self, w, meta, spec, c, image):
        flags = flag_values(c.get("args", []))
        for flag in flags:
            if flag not in self.flags:
                self.err(w, f"--{flag} is not a flag of mhcd (server/flags.cc)")
        backend = flags.get("backend")
        if backend not in ("cpu", "cuda", "reference"):
            self.err(w, f"--backend must be explicit (cpu or cuda), got {backend!r}")
        expected = meta.get("labels", {}).get("mhcd.io/expected-backend")
        if expected != backend:
            self.err(w, f"label mhcd.io/expected-backend={expected!r} but --backend={backend!r}")
        repo, _, tag = image.rpartition(":")
        want_tag = self.version + ("-cuda" if backend == "cuda" else "")
        if "/" not in repo or tag != want_tag:
            self.err(w, f"image {image!r}: expected REGISTRY/NAME:{want_tag}")
        listen = flags.get("listen", "").split(",")
        tcp = [a for a in listen if a and not a.startswith("unix:")]
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        grpc_port = None
        if len(tcp) != 1 or not tcp[0].startswith("0.0.0.0:"):
            self.err(w, f"--listen needs one 0.0.0.0:PORT address (probes), got {listen}")
        else:
            grpc_port = int(tcp[0].rsplit(":", 1)[1])
            if ports.get("grpc") != grpc_port:
                self.err(w, f"port named grpc is {ports.get('grpc')}, --listen binds {grpc_port}")
        metrics = flags.get("metrics_listen", "")
        if not metrics.startswith("0.0.0.0:") or ports.get("metrics") != int(metrics.rsplit(":", 1)[1]):
            self.err(w, f"port named metrics {ports.get('metrics')} does not match "
                        f"--metrics_listen={metrics!r} (it must bind 0.0.0.0)")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = c.get(probe)
            if not p or "grpc" not in p:
                self.err(w, f"{probe}: a grpc probe is required")
            elif p["grpc"].get("port") != grpc_port:
                self.err(w, f"{probe}: grpc port {p['grpc'].get('port')}, daemon on {grpc_port}")
        try:
            drain = duration_seconds(flags.get("drain_timeout", "30s"))
        except ValueError as e:
            self.err(w, str(e))
            drain = 30
        grace = spec.get("terminationGracePeriodSeconds", 30)
        if not grace > drain:
            self.err(w, f"terminationGracePeriodSeconds {grace} must exceed --drain_timeout ({drain:g}s)")

    def check_resources(self, w, c):
        r = c.get("resources") or {}
        for section, key in (("requests", "cpu"), ("requests", "memory"), ("limits", "memory")):
            if key not in (r.get(section) or {}):
                self.err(w, f"resources.{section}.{key} missing")

    def check_pod_security(self, w, spec, enforce):
        psc = spec.get("securityContext") or {}
        if enforce not in ("restricted", "baseline", "privileged"):
            self.err(w, f"namespace must set pod-security.kubernetes.io/enforce, got {enforce!r}")
        if (psc.get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
            self.err(w, "pod seccompProfile must be RuntimeDefault or Localhost")
        for kind, c in all_containers(spec):
            cw = f"{w}/{c['name']}"
            sc = c.get("securityContext") or {}
            if sc.get("privileged"):
                self.err(cw, "privileged container")
            if sc.get("allowPrivilegeEscalation") is not False:
                self.err(cw, "allowPrivilegeEscalation must be false")
            caps = sc.get("capabilities") or {}
            if "ALL" not in (caps.get("drop") or []):
                self.err(cw, "capabilities must drop ALL")
            if enforce == "restricted":
                if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
                    self.err(cw, f"restricted: capabilities added {caps.get('add')}")
                if effective(psc, c, "runAsNonRoot") is not True:
                    self.err(cw, "restricted: runAsNonRoot must be true")
                if effective(psc, c, "runAsUser") == 0:
                    self.err(cw, "restricted: runAsUser 0")
        if enforce == "restricted":
            for key in ("hostNetwork", "hostPID", "hostIPC"):
                if spec.get(key):
                    self.err(w, f"restricted: {key}")
            for v in spec.get("volumes", []):
                kinds = set(v) - {"name"}
                if not kinds <= RESTRICTED_VOLUMES:
                    self.err(w, f"restricted: volume {v['name']} of type {sorted(kinds)}")

    def check_sockets(self, w, pods, daemons):
        for obj, meta, spec, c in daemons:
            flags = flag_values(c.get("args", []))
            sockets = [a for a in flags.get("listen", "").split(",") if a.startswith("unix:")]
            dw = f"{w}: {obj['kind']}/{obj['metadata']['name']}"
            if not sockets:
                if "allow_shm" in flags:
                    self.err(dw, "--allow_shm without a unix: socket")
                continue
            if "allow_shm" not in flags:
                self.err(dw, "a unix socket without --allow_shm")
            address = sockets[0]
            directory = str(pathlib.PurePosixPath(address[len("unix:"):]).parent)
            dsrc = self.mount_source(spec, c, directory)
            if dsrc is None:
                self.err(dw, f"no volume mounted at {directory} (socket directory)")
                continue
            duid = effective(spec.get("securityContext"), c, "runAsUser")
            dshm = self.mount_source(spec, c, "/dev/shm")
            clients = 0
            for cobj, cmeta, cspec in pods:
                for _, cc in all_containers(cspec):
                    if cc is c:
                        continue
                    text = " ".join(cc.get("command", []) + cc.get("args", []) +
                                    [str(e.get("value", "")) for e in cc.get("env", [])])
                    named = set(re.findall(r"unix:[^\s\"',;]+", text))
                    if not named:
                        continue
                    clients += 1
                    cw = f"{w}: {cobj['kind']}/{cobj['metadata']['name']}/{cc['name']}"
                    if named != {address}:
                        self.err(cw, f"client names {sorted(named)}, the daemon listens on {address}")
                    csrc = self.mount_source(cspec, cc, directory)
                    same_pod = cspec is spec
                    if csrc is None:
                        self.err(cw, f"no volume mounted at {directory}")
                    elif same_pod and csrc != dsrc:
                        self.err(cw, f"socket volume {csrc} differs from the daemon's {dsrc}")
                    elif not same_pod and (csrc[0] != "hostPath" or csrc != dsrc):
                        self.err(cw, f"socket volume {csrc} is not the daemon's hostPath {dsrc}")
                    cuid = effective(cspec.get("securityContext"), cc, "runAsUser")
                    if cuid != duid:
                        self.err(cw, f"runs as {cuid}, the daemon as {duid} (shm regions are 0600)")
                    if same_pod:
                        cshm = self.mount_source(cspec, cc, "/dev/shm")
                        if dshm is None or cshm != dshm or dshm[0] != "emptyDir:Memory":
                            self.err(cw, "daemon and client must mount one memory-backed "
                                         "emptyDir at /dev/shm")
                    elif not (spec.get("hostIPC") and cspec.get("hostIPC")):
                        self.err(cw, "a shared-memory client in another pod needs hostIPC "
                                     "on both pods (/dev/shm of the host)")
            if clients == 0:
                self.err(dw, f"no example client uses {address}")

    @staticmethod
    def mount_source(spec, c, path):
        for m in c.get("volumeMounts", []):
            if m["mountPath"] == path:
                vol = next((v for v in spec.get("volumes", []) if v["name"] == m["name"]), None)
                if vol is None:
                    return ("missing", m["name"])
                if "hostPath" in vol:
                    return ("hostPath", vol["hostPath"]["path"])
                if "emptyDir" in vol:
                    kind = "emptyDir:Memory" if (vol["emptyDir"] or {}).get("medium") == "Memory" \
                        else "emptyDir"
                    return (kind, vol["name"])
                return (sorted(set(vol) - {"name"})[0], vol["name"])
        return None

    def check_monitoring(self, w, docs, daemons):
        monitors = [d for d in docs if d["kind"] == "PodMonitor"]
        if len(monitors) != 1:
            self.err(w, f"expected one PodMonitor, found {len(monitors)}")
            return
        pm = monitors[0]["spec"]
        job_label = pm.get("jobLabel")
        jobs = set(re.findall(r'job="([^"]+)"', yaml.safe_dump(self.alerts)))
        for obj, meta, spec, c in daemons:
            labels = meta.get("labels", {})
            dw = f"{w}: {obj['kind']}/{obj['metadata']['name']}"
            if not matches(pm.get("selector", {}).get("matchLabels"), labels):
                self.err(dw, "PodMonitor does not select the daemon's pod")
            job = labels.get(job_label) if job_label else None
            if not job or any(j != job for j in jobs):
                self.err(dw, f"job from PodMonitor jobLabel {job_label!r} is {job!r}; "
                             f"alerts.yml matches job {sorted(jobs)}")
            ports = {p.get("name") for p in c.get("ports", [])}
            for ep in pm.get("podMetricsEndpoints", []):
                if ep.get("port") not in ports:
                    self.err(dw, f"PodMonitor port {ep.get('port')!r} not a daemon port")
        rules = [d for d in docs if d["kind"] == "PrometheusRule"]
        if len(rules) != 1 or rules[0]["spec"].get("groups") != self.alerts["groups"]:
            self.err(w, "PrometheusRule spec.groups differ from deploy/prometheus/alerts.yml")
        seen = {}
        for d in docs:
            if d["kind"] == "ConfigMap" and "grafana_dashboard" in d["metadata"].get("labels", {}):
                if d["metadata"]["labels"]["grafana_dashboard"] != "1":
                    self.err(w, f"ConfigMap {d['metadata']['name']}: grafana_dashboard must be \"1\"")
                seen.update(d.get("data", {}))
        if seen != self.dashboards:
            self.err(w, "dashboard ConfigMaps differ from dashboards/*.json")

    def check_services(self, w, docs, daemons):
        daemon_labels = [meta.get("labels", {}) for _, meta, _, _ in daemons]
        daemon_ports = set()
        for _, _, _, c in daemons:
            daemon_ports |= {p.get("name") for p in c.get("ports", [])}
        for d in docs:
            where = f"{w}: {d['kind']}/{d['metadata']['name']}"
            if d["kind"] == "Service":
                if not any(matches(d["spec"].get("selector"), l) for l in daemon_labels):
                    self.err(where, "selects no daemon pod")
                for p in d["spec"].get("ports", []):
                    if isinstance(p.get("targetPort"), str) and p["targetPort"] not in daemon_ports:
                        self.err(where, f"targetPort {p['targetPort']} is no daemon port")
            if d["kind"] == "NetworkPolicy":
                sel = d["spec"]["podSelector"].get("matchLabels")
                if not any(matches(sel, l) for l in daemon_labels):
                    self.err(where, "selects no daemon pod")
                for rule in d["spec"].get("ingress", []):
                    for p in rule.get("ports", []):
                        if isinstance(p.get("port"), str) and p["port"] not in daemon_ports:
                            self.err(where, f"port {p['port']} is no daemon port")

    # -- everything ----------------------------------------------------------
    def check_all(self, rendered):
        images = {}
        for name, docs in rendered.items():
            images[name] = self.check_overlay(name, docs)
        repos = {i.rpartition(":")[0] for i in images.values()}
        if len(repos) > 1:
            self.err("overlays", f"one image repository expected, found {sorted(repos)}")

    def check_dockerfiles(self, texts=None):
        for name, backend in (("Dockerfile", "cpu"), ("Dockerfile.cuda", "cuda")):
            w = f"deploy/{name}"
            text = (texts or {}).get(name) or (ROOT / "deploy" / name).read_text()
            text = re.sub(r"\\\n", " ", text)
            lines = [l.strip() for l in text.splitlines() if l.strip() and not l.startswith("#")]
            froms = [l.split()[1] for l in lines if l.upper().startswith("FROM ")]
            if len(froms) < 2:
                self.err(w, "must be multi-stage (a build and a runtime stage)")
            if any(f.endswith(":latest") or ":" not in f for f in froms):
                self.err(w, f"base images need explicit tags: {froms}")
            final = lines[max(i for i, l in enumerate(lines) if l.upper().startswith("FROM ")):]
            users = [l.split()[1] for l in final if l.upper().startswith("USER ")]
            if not users or not re.fullmatch(r"[1-9][0-9]*(:[1-9][0-9]*)?", users[-1]):
                self.err(w, "the runtime stage needs a numeric non-root USER")
            if not any(l.upper().startswith("HEALTHCHECK ") and "health" in l for l in final):
                self.err(w, "the runtime stage needs a HEALTHCHECK (mhcctl health)")
            cmd = next((l for l in reversed(final) if l.upper().startswith("CMD ")), "")
            if f"--backend={backend}" not in cmd:
                self.err(w, f"CMD must run --backend={backend}")
            if backend == "cuda":
                args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
                want = [f"nvidia/cuda:${{CUDA_VERSION}}-{kind}-${{UBUNTU}}" for kind in ("devel", "runtime")]
                if [f for f in froms] != want or "CUDA_VERSION" not in args:
                    self.err(w, f"stages must be {want} with ARG CUDA_VERSION, got {froms}")


def load(directory):
    rendered = {}
    for path in sorted(pathlib.Path(directory).glob("*.yaml")):
        rendered[path.stem] = [d for d in yaml.safe_load_all(path.read_text()) if d]
    if not rendered:
        raise SystemExit(f"check_invariants: no rendered overlays in {directory}")
    return rendered


def run(rendered, dockerfiles=True):
    checker = Checker()
    checker.check_all(rendered)
    if dockerfiles:
        checker.check_dockerfiles()
    return checker.errors


def find(docs, kind, name=None):
    return next(d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name))


def daemon_container(docs):
    for d in docs:
        if d["kind"] in WORKLOADS:
            for _, c in all_containers(pod_of(d)[1]):
                if any(a.startswith("--listen=") for a in c.get("args", [])):
                    return d, c
    raise LookupError("no daemon")


def self_test(rendered):
    """Each mutation must make run() report an error containing its text."""
    def args(docs):
        return daemon_container(docs)[1]["args"]

    def set_arg(docs, prefix, value):
        a = args(docs)
        a[:] = [x for x in a if not x.startswith(prefix)] + ([value] if value else [])

    def client_of(docs):
        d, c = daemon_container(docs)
        for w in docs:
            if w["kind"] in WORKLOADS:
                for _, cc in all_containers(pod_of(w)[1]):
                    if cc is not c and "unix:" in " ".join(cc.get("command", []) + [
                            str(e.get("value", "")) for e in cc.get("env", [])]):
                        return w, cc
        raise LookupError("no socket client")

    def retag(docs, image):
        for w in docs:
            if w["kind"] in WORKLOADS:
                for _, c in all_containers(pod_of(w)[1]):
                    c["image"] = image

    def env_set(c, name, value):
        for e in c.get("env", []):
            if e["name"] == name:
                e["value"] = value

    m = []
    for name in rendered:
        m += [
            (name, "exceed --drain_timeout", lambda d: set_arg(d, "--drain_timeout", "--drain_timeout=60s")),
            (name, "not a flag of mhcd", lambda d: set_arg(d, "--no_such_flag", "--no_such_flag=1")),
            (name, "--backend must be explicit", lambda d: set_arg(d, "--backend", "--backend=auto")),
            (name, "readinessProbe: a grpc probe", lambda d: daemon_container(d)[1].pop("readinessProbe")),
            (name, "startupProbe: grpc port", lambda d: daemon_container(d)[1]["startupProbe"]["grpc"].update(port=1)),
            (name, "expected REGISTRY/NAME", lambda d: retag(d, "mhcd:latest")),
            (name, "one image expected", lambda d: daemon_container(d)[1].update(image="x/mhcd:0")),
            (name, "resources.limits.memory", lambda d: daemon_container(d)[1]["resources"]["limits"].pop("memory")),
            (name, "allowPrivilegeEscalation", lambda d: daemon_container(d)[1]["securityContext"].pop("allowPrivilegeEscalation")),
            (name, "PodMonitor jobLabel", lambda d: find(d, "PodMonitor")["spec"].pop("jobLabel")),
            (name, "differ from deploy/prometheus/alerts.yml",
             lambda d: find(d, "PrometheusRule")["spec"]["groups"][0]["rules"].pop()),
            (name, "differ from dashboards", lambda d: d.remove(find(d, "ConfigMap"))),
            (name, "mhcd.io/expected-backend", lambda d: pod_of(daemon_container(d)[0])[0]["labels"].pop("mhcd.io/expected-backend")),
        ]
        if find(rendered[name], "Namespace")["metadata"]["labels"].get(
                "pod-security.kubernetes.io/enforce") == "restricted":
            m.append((name, "restricted: hostIPC", lambda d: pod_of(daemon_container(d)[0])[1].update(hostIPC=True)))
        if any(a.startswith("--listen=") and "unix:" in a for a in args(rendered[name])):
            m += [
                (name, "the daemon listens on", lambda d: env_set(client_of(d)[1], "MHCD_ADDRESS", "unix:/tmp/other.sock")),
                (name, "a unix socket without --allow_shm", lambda d: set_arg(d, "--allow_shm", None)),
                (name, "shm regions are 0600", lambda d: client_of(d)[1].setdefault("securityContext", {}).update(runAsUser=4242)),
                (name, "no volume mounted at /run/mhcd", lambda d: client_of(d)[1].pop("volumeMounts")),
            ]
    failures = []
    for name, expect, mutate in m:
        broken = copy.deepcopy(rendered)
        mutate(broken[name])
        errors = run(broken, dockerfiles=False)
        if not any(expect in e for e in errors):
            failures.append(f"{name}: breaking '{expect}' was not caught (errors: {errors[:3]})")
    for text, expect in (("USER 10001:10001", "numeric non-root USER"),
                         ("HEALTHCHECK", "needs a HEALTHCHECK")):
        checker = Checker()
        original = (ROOT / "deploy" / "Dockerfile.cuda").read_text()
        checker.check_dockerfiles({"Dockerfile.cuda": original.replace(
            text, "LABEL x=y" if text == "HEALTHCHECK" else "USER root")})
        if not any(expect in e for e in checker.errors):
            failures.append(f"Dockerfile.cuda: breaking '{expect}' was not caught")
    for f in failures:
        print(f"check_invariants: self-test: {f}", file=sys.stderr)
    print(f"check_invariants: self-test: {len(m) + 2 - len(failures)} of {len(m) + 2} "
          "breaks caught")
    return not failures


def main(argv):
    if argv[1:2] == ["--self-test"]:
        return 0 if self_test(load(argv[2])) else 1
    rendered = load(argv[1])
    errors = run(rendered)
    for e in errors:
        print(f"check_invariants: {e}", file=sys.stderr)
    if errors:
        print(f"check_invariants: FAIL ({len(errors)} errors)", file=sys.stderr)
        return 1
    print(f"check_invariants: {len(rendered)} overlays ok ({', '.join(rendered)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
