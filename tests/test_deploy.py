"""Deployment manifests, images and their docs agree with each other and with the CLI.

Every kustomization under deploy/k8s is rendered with ``kubectl kustomize`` (or a standalone
``kustomize build``) and each object is validated by kubernetes-validate in strict mode against
the oldest Kubernetes we support and the newest schemas it ships. Then the wiring is checked
against the real parser of ``kvrelay``: replica counts per pool, the ports probes and Services
and NetworkPolicies use versus the ports the command lines open, the KVRELAY_* variables versus
the options each subcommand reads, the Dockerfiles' entry point, and every ``kvrelay <command>``
the Dockerfiles, manifests and deploy/README.md use. The KubeRay manifest's standard objects and
pod templates are schema-checked; the RayCluster itself (no schema offline) is checked by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
KUSTOMIZATIONS = ("base", "overlays/cpu-demo", "overlays/gpu")
OVERLAYS = ("overlays/cpu-demo", "overlays/gpu")
RAYCLUSTER = DEPLOY / "kuberay" / "raycluster.yaml"
DOCKERFILES = (DEPLOY / "docker" / "Dockerfile", DEPLOY / "docker" / "Dockerfile.cuda")
README = DEPLOY / "README.md"
MIN_K8S = "1.30.0"  # oldest Kubernetes the manifests claim (gRPC probes, endPort, HPA v2)
NAMESPACE = "kvrelay"
EXTERNAL = {("Secret", "kvrelay-secrets")}  # created by hand (deploy/README.md)
POOLS = ("prefill", "decode")
ROLE_LABEL = "app.kubernetes.io/component"
RAY_COMMANDS = {"serve", "scale", "status"}  # the Ray launcher's (issue 4)
POOL_SERIES = {"prefill": "kvrelay:num_queued_prompt_tokens",
               "decode": "kvrelay:kv_cache_usage_perc"}
# gRPC health service names each server registers (router/server.py, kvrelay/worker.py).
ROLE_SERVICE = {"prefill": "kvrelay.v1.PrefillWorker", "decode": "kvrelay.v1.DecodeWorker"}


# -- rendering and validation ----------------------------------------------------------------------
def _kustomize() -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


@functools.cache
def _render(path: str) -> tuple[dict[str, Any], ...]:
    cmd = _kustomize()
    if cmd is None:
        pytest.skip("neither kubectl nor kustomize on PATH: install kubectl (it bundles "
                    "kustomize) to render deploy/k8s")
    out = subprocess.run([*cmd, str(K8S / path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"{' '.join(cmd)} {path} failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def render(path: str) -> list[dict[str, Any]]:
    return list(_render(path))


def k8s_versions() -> tuple[str, ...]:
    from kubernetes_validate.utils import latest_version

    return (MIN_K8S, latest_version())


def validate(obj: dict[str, Any], where: str) -> None:
    from kubernetes_validate.utils import SchemaNotFoundError, ValidationError
    from kubernetes_validate.utils import validate as kv_validate

    name = f"{where}: {obj['kind']}/{obj.get('metadata', {}).get('name')}"
    for version in k8s_versions():
        try:
            kv_validate(obj, version, strict=True)
        except ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{name} is invalid for Kubernetes {version}: {path}: {e.message}")
        except SchemaNotFoundError as e:
            pytest.fail(f"{name}: {e.message}")


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def pool_deployment(docs: list[dict[str, Any]], pool: str) -> dict[str, Any]:
    found = [d for d in of_kind(docs, "Deployment")
             if d["spec"]["template"]["metadata"]["labels"].get(ROLE_LABEL) == pool]
    assert len(found) == 1, f"expected one Deployment labelled {ROLE_LABEL}={pool}"
    return found[0]


def pod_labels(dep: dict[str, Any]) -> dict[str, str]:
    return dep["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for ex in selector.get("matchExpressions", []):
        key, op, values = ex["key"], ex["operator"], ex.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


# -- the CLI ---------------------------------------------------------------------------------------
def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("kvrelay has no subcommands")


@functools.cache
def cli_env() -> dict[str, frozenset[str]]:
    """Per subcommand, the KVRELAY_* variables it reads: the long options ``cli.opt`` registered
    (which mark their help with ``[env NAME]``), mapped through ``cli.env_name``."""
    from kvrelay.cli import build_parser, env_name

    with cli_environment({}):
        subs = subparsers(build_parser())
    return {name: frozenset(env_name(s) for a in sub._actions for s in a.option_strings
                            if s.startswith("--") and f"[env {env_name(s)}]" in (a.help or ""))
            for name, sub in subs.items()}


def subcommands() -> set[str]:
    from kvrelay.cli import build_parser

    with cli_environment({}):
        return set(subparsers(build_parser()))


@contextlib.contextmanager
def cli_environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ with exactly ``env``'s KVRELAY_* variables (the parser reads them when built)."""
    saved = dict(os.environ)
    try:
        for k in [k for k in os.environ if k.startswith("KVRELAY_")]:
            del os.environ[k]
        os.environ.update({k: v for k, v in env.items() if k.startswith("KVRELAY_")})
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def parse(argv: list[str], env: dict[str, str] | None = None) -> argparse.Namespace:
    """Parse a ``kvrelay`` command line the way the container would, with its environment."""
    from kvrelay.cli import build_parser

    err = io.StringIO()
    with cli_environment(env or {}):
        parser = build_parser()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                ns = parser.parse_args(argv)
        except SystemExit as e:
            if e.code == 0:  # --help
                return argparse.Namespace(command=argv[0])
            pytest.fail(f"kvrelay {shlex.join(argv)} does not parse: {err.getvalue().strip()}")
        sub = subparsers(parser)[argv[0]]
    for a in sub._actions:  # values from the environment skip argparse's choices check
        value = getattr(ns, a.dest, None)
        if a.choices and value is not None and not isinstance(value, list):
            assert value in a.choices, f"kvrelay {argv[0]} {a.dest}={value!r}: not in {a.choices}"
    return ns


# -- containers in the rendered manifests ----------------------------------------------------------
PLACEHOLDER = {"status.podIP": "10.0.0.7", "metadata.name": "pod-0"}


def container_env(docs: list[dict[str, Any]], c: dict[str, Any]) -> dict[str, str]:
    """The variables a container sees, with the values the manifests give (secrets: a stand-in)."""
    env: dict[str, str] = {}

    def config(name: str) -> dict[str, str]:
        return named(docs, "ConfigMap", name).get("data", {})

    for src in c.get("envFrom", []):
        if "configMapRef" in src:
            env.update(config(src["configMapRef"]["name"]))
        else:
            pytest.fail(f"container {c['name']}: envFrom {src} (only ConfigMaps expected)")
    for e in c.get("env", []):
        ref = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in ref:
            env[e["name"]] = config(ref["configMapKeyRef"]["name"])[ref["configMapKeyRef"]["key"]]
        elif "secretKeyRef" in ref:
            env[e["name"]] = "secret-" + ref["secretKeyRef"]["key"].lower()
        else:
            env[e["name"]] = PLACEHOLDER[ref["fieldRef"]["fieldPath"]]
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], a) for a in args]


@dataclasses.dataclass
class Proc:
    """One kvrelay container of a rendered Deployment, its command line parsed."""

    deployment: dict[str, Any]
    container: dict[str, Any]
    env: dict[str, str]
    argv: list[str]
    ns: argparse.Namespace

    @property
    def command(self) -> str:
        return self.argv[0]

    @property
    def pod(self) -> dict[str, Any]:
        return self.deployment["spec"]["template"]["spec"]

    def opened_ports(self) -> dict[int, str]:
        """Port -> what listens there, from the parsed options."""
        ns = self.ns
        if self.command == "router":
            ports = {int(ns.port): "grpc", int(ns.control_port): "control"}
            if ns.http_port not in (None, "", "-1"):
                ports[int(ns.http_port)] = "http"
            return ports
        assert self.command == "worker", self.command
        ports = {int(ns.port): "grpc"}
        if ns.metrics_port not in (None, ""):
            ports[int(ns.metrics_port)] = "metrics"
        return ports

    def health_services(self, port: int) -> set[str]:
        kind = self.opened_ports().get(port)
        if self.command == "router":
            return {"grpc": {"", "kvrelay.v1.Generation"},
                    "control": {"", "kvrelay.v1.Registry"}}.get(kind, set())
        return {"", "kvrelay.v1.WorkerControl", ROLE_SERVICE[self.ns.role]} if kind == "grpc" \
            else set()

    def http_paths(self, port: int) -> set[str]:
        kind = self.opened_ports().get(port)
        return {"http": {"/health", "/metrics"}, "metrics": {"/metrics"}}.get(kind, set())

    def port_number(self, port: int | str) -> int:
        if isinstance(port, int):
            return port
        named_ports = {p["name"]: p["containerPort"] for p in self.container.get("ports", [])}
        assert port in named_ports, f"{self.container['name']}: no container port {port!r}"
        return named_ports[port]


def procs(docs: list[dict[str, Any]]) -> list[Proc]:
    out = []
    for dep in of_kind(docs, "Deployment"):
        for c in dep["spec"]["template"]["spec"]["containers"]:
            assert c["image"].split(":")[0].endswith("kvrelay"), c["image"]
            env = container_env(docs, c)
            argv = expand(c["args"], env)
            out.append(Proc(dep, c, env, argv, parse(argv, env)))
    return out


def pool_proc(docs: list[dict[str, Any]], pool: str) -> Proc:
    [p] = [p for p in procs(docs) if p.deployment is pool_deployment(docs, pool)]
    return p


def router_proc(docs: list[dict[str, Any]]) -> Proc:
    [p] = [p for p in procs(docs) if p.command == "router"]
    return p


def quantity(q: str | int | float) -> float:
    s = str(q)
    for suffix, mult in (("m", 1e-3), ("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30)):
        if s.endswith(suffix):
            return float(s[: -len(suffix)]) * mult
    return float(s)


def kustomization(path: str) -> dict[str, Any]:
    return yaml.safe_load((K8S / path / "kustomization.yaml").read_text())


# -- Kustomize renders -----------------------------------------------------------------------------
@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_renders_and_validates_strictly(path: str) -> None:
    docs = render(path)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy",
            "ServiceAccount"} <= kinds
    for d in docs:
        validate(d, path)
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == NAMESPACE, f"{d['kind']} outside {NAMESPACE}"


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_references_resolve(path: str) -> None:
    docs = render(path)
    have = {(d["kind"], d["metadata"]["name"]) for d in docs} | EXTERNAL
    for dep in of_kind(docs, "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        refs = {("ServiceAccount", pod["serviceAccountName"])}
        for c in pod["containers"] + pod.get("initContainers", []):
            refs |= {("ConfigMap", s["configMapRef"]["name"]) for s in c.get("envFrom", [])}
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                if "configMapKeyRef" in ref:
                    refs.add(("ConfigMap", ref["configMapKeyRef"]["name"]))
                if "secretKeyRef" in ref:
                    refs.add(("Secret", ref["secretKeyRef"]["name"]))
        refs |= {("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])
                 for v in pod["volumes"] if "persistentVolumeClaim" in v}
        assert refs <= have, f"{dep['metadata']['name']} refers to missing {refs - have}"
    if path == "overlays/cpu-demo":  # self-contained: it generates its own demo Secret
        assert any(d["metadata"]["name"].startswith("kvrelay-secrets")
                   for d in of_kind(docs, "Secret"))


@pytest.mark.parametrize("path", OVERLAYS)
def test_pool_replica_counts_differ_and_reach_the_right_deployments(path: str) -> None:
    docs = render(path)
    counts = {r["name"]: r["count"] for r in kustomization(path)["replicas"]}
    for pool in POOLS:
        dep = pool_deployment(docs, pool)
        proc = pool_proc(docs, pool)
        assert proc.command == "worker" and proc.ns.role == pool, proc.argv
        assert dep["spec"]["replicas"] == counts[dep["metadata"]["name"]], pool
    assert pool_deployment(docs, "prefill")["spec"]["replicas"] != \
        pool_deployment(docs, "decode")["spec"]["replicas"]
    [row] = [ln for ln in README.read_text().splitlines()  # the docs' replica table
             if ln.startswith(f"| {path.split('/')[-1]} | `k8s/{path}/kustomization.yaml`")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert [int(c.split()[0]) for c in cells[-2:]] == \
        [pool_deployment(docs, p)["spec"]["replicas"] for p in POOLS], row
    for hpa in of_kind(docs, "HorizontalPodAutoscaler"):  # the overlay's count is the floor
        target = named(docs, "Deployment", hpa["spec"]["scaleTargetRef"]["name"])
        assert hpa["spec"]["minReplicas"] == target["spec"]["replicas"]
        assert hpa["spec"]["maxReplicas"] >= hpa["spec"]["minReplicas"]


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_probes_and_services_hit_ports_the_command_line_opens(path: str) -> None:
    docs = render(path)
    all_procs = procs(docs)
    assert sorted(p.command for p in all_procs) == ["router", "worker", "worker"]
    for p in all_procs:
        opened = p.opened_ports()
        declared = {cp["containerPort"] for cp in p.container["ports"]}
        assert declared == set(opened), f"{p.container['name']}: ports {declared} vs {opened}"
        probes = [p.container.get(k) for k in ("startupProbe", "readinessProbe", "livenessProbe")]
        assert all(probes), f"{p.container['name']} lacks a probe"
        for probe in probes:
            if "grpc" in probe:
                port = probe["grpc"]["port"]
                assert port in opened, f"gRPC probe on {port}, opened: {opened}"
                assert probe["grpc"].get("service", "") in p.health_services(port), probe
            else:
                port = p.port_number(probe["httpGet"]["port"])
                assert probe["httpGet"]["path"] in p.http_paths(port), probe
        if p.command == "router":  # readiness on /health; the HTTP port must be on
            assert p.container["readinessProbe"]["httpGet"]["path"] == "/health"
        else:
            assert p.container["readinessProbe"]["grpc"]["service"] == ROLE_SERVICE[p.ns.role]
    for svc in of_kind(docs, "Service"):
        backends = [p for p in all_procs if selects({"matchLabels": svc["spec"]["selector"]},
                                                    pod_labels(p.deployment))]
        assert backends, f"Service {svc['metadata']['name']} selects no pods"
        for sp in svc["spec"]["ports"]:
            for p in backends:
                assert p.port_number(sp["targetPort"]) in p.opened_ports(), (svc, sp)


def test_health_service_names_match_the_code() -> None:
    server = (ROOT / "router" / "server.py").read_text()
    worker = (ROOT / "kvrelay" / "worker.py").read_text()
    assert '"kvrelay.v1.Generation"' in server and '"kvrelay.v1.Registry"' in server
    for name in (*ROLE_SERVICE.values(), "kvrelay.v1.WorkerControl"):
        assert f'"{name}"' in worker


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_env_vars_are_options_of_the_subcommand(path: str) -> None:
    docs = render(path)
    env_sets = cli_env()
    for p in procs(docs):
        ours = {k for k in p.env if k.startswith("KVRELAY_")}
        unknown = ours - env_sets[p.command]
        assert not unknown, f"{p.container['name']}: `kvrelay {p.command}` ignores {unknown}"
        assert p.env.get("NIXL_LOG_LEVEL", "WARN") == "WARN"
    for dep in of_kind(docs, "Deployment"):
        for c in dep["spec"]["template"]["spec"].get("initContainers", []):
            env = container_env(docs, c)
            argv = expand(c["args"], env)
            parse(argv, env)
            unknown = {k for k in env if k.startswith("KVRELAY_")} - env_sets[argv[0]]
            assert not unknown, f"init container {c['name']}: `kvrelay {argv[0]}` ignores {unknown}"
    from kvrelay.engine.config import parse_bytes

    for p in procs(docs):  # values the parser keeps as strings, checked as the engine will
        if p.command == "worker":
            assert parse_bytes(p.ns.kv_cache_memory) > 0


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_workers_drain_within_the_grace_period(path: str) -> None:
    docs = render(path)
    for pool in POOLS:
        p = pool_proc(docs, pool)
        assert p.pod["terminationGracePeriodSeconds"] > float(p.ns.drain_timeout) + 5, pool
        router, port = p.ns.router[0].rsplit(":", 1)
        control = named(docs, "Service", router)  # heartbeats reach even a not-ready router
        assert control["spec"].get("publishNotReadyAddresses") is True
        assert int(port) in {sp["port"] for sp in control["spec"]["ports"]}
        assert int(port) == int(router_proc(docs).ns.control_port)


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_pods_are_locked_down(path: str) -> None:
    docs = render(path)
    sa = named(docs, "ServiceAccount", "kvrelay")
    assert sa.get("automountServiceAccountToken") is False
    for dep in of_kind(docs, "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "kvrelay"
        assert pod["automountServiceAccountToken"] is False
        assert pod["enableServiceLinks"] is False  # KVRELAY_<SVC>_PORT would reach the CLI
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
            assert sc["readOnlyRootFilesystem"] is True
            for k in ("cpu", "memory"):
                assert quantity(c["resources"]["requests"][k]) <= \
                    quantity(c["resources"]["limits"][k]), (c["name"], k)
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            assert "/models" in mounts and "/tmp" in mounts
        gpus = [c["resources"]["limits"].get("nvidia.com/gpu") for c in pod["containers"]]
        is_worker = pod_labels(dep)[ROLE_LABEL] in POOLS
        assert gpus == ([1] if path == "overlays/gpu" and is_worker else [None])


def test_cpu_demo_generates_the_model_every_pod_loads() -> None:
    docs = render("overlays/cpu-demo")
    assert not of_kind(docs, "PersistentVolumeClaim")
    for p in procs(docs):
        [init] = p.pod["initContainers"]
        argv = expand(init["args"], container_env(docs, init))
        assert argv == ["demo-model", p.ns.model], argv
        [vol] = [v for v in p.pod["volumes"] if v["name"] == "models"]
        assert set(vol) == {"name", "emptyDir"}


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_one_pdb_and_one_headless_service_per_pool(path: str) -> None:
    docs = render(path)
    for pool in POOLS:
        labels = pod_labels(pool_deployment(docs, pool))
        pdbs = [d for d in of_kind(docs, "PodDisruptionBudget")
                if selects(d["spec"]["selector"], labels)]
        assert len(pdbs) == 1 and pdbs[0]["spec"]["maxUnavailable"] == 1, pool
        headless = [d for d in of_kind(docs, "Service") if d["spec"].get("clusterIP") == "None"
                    and selects({"matchLabels": d["spec"]["selector"]}, labels)]
        assert len(headless) == 1, pool


def test_prefill_and_decode_deployments_mirror_each_other() -> None:
    docs = render("base")

    def text(pool: str) -> str:  # without the ConfigMaps' content hashes
        dep = json.dumps(pool_deployment(docs, pool), sort_keys=True, indent=1)
        return re.sub(r'"(kvrelay-[a-z]+)-[a-z0-9]{10}"', r'"\1"', dep)

    decode = text("decode").replace("decode", "prefill").replace("DecodeWorker", "PrefillWorker")
    assert decode == text("prefill")


# -- network policy --------------------------------------------------------------------------------
def ingress_allowed(docs: list[dict[str, Any]], src: dict[str, str], src_ns: str,
                    dst: dict[str, str], port: int) -> bool:
    """Whether the rendered NetworkPolicies let a pod (labels, namespace) reach dst:port."""
    policies = [p for p in of_kind(docs, "NetworkPolicy") if selects(p["spec"]["podSelector"], dst)
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not policies:
        return True

    def port_ok(ports: list[dict[str, Any]] | None) -> bool:
        return not ports or any(p["port"] <= port <= p.get("endPort", p["port"]) for p in ports)

    def peer_ok(peers: list[dict[str, Any]] | None) -> bool:
        if not peers:
            return True
        for peer in peers:
            if "namespaceSelector" in peer:
                ns_ok = selects(peer["namespaceSelector"],
                                {"kubernetes.io/metadata.name": src_ns})
            else:
                ns_ok = src_ns == NAMESPACE
            if ns_ok and selects(peer.get("podSelector", {}), src):
                return True
        return False

    return any(port_ok(r.get("ports")) and peer_ok(r.get("from"))
               for p in policies for r in p["spec"].get("ingress", []))


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_network_policy_matrix(path: str) -> None:
    docs = render(path)
    router = router_proc(docs)
    pods = {name: (pod_labels(pool_deployment(docs, name) if name in POOLS
                              else router.deployment), NAMESPACE)
            for name in ("router", *POOLS)}
    pods["stranger"] = ({"app": "other"}, NAMESPACE)
    pods["client"] = ({"app": "client"}, "default")
    pods["prometheus"] = ({"app.kubernetes.io/name": "prometheus"}, "monitoring")
    worker = pool_proc(docs, "prefill")
    control, metrics = int(worker.ns.port), int(worker.ns.metrics_port)
    ranges = {pool_proc(docs, p).env["UCX_TCP_PORT_RANGE"] for p in POOLS}
    assert len(ranges) == 1, ranges
    lo, hi = (int(x) for x in ranges.pop().split("-"))
    r = router.opened_ports()
    by_kind = {v: k for k, v in r.items()}
    expect = [  # (source, destination, port, allowed)
        ("client", "router", by_kind["grpc"], True), ("client", "router", by_kind["http"], True),
        ("prometheus", "router", by_kind["http"], True),
        ("client", "router", by_kind["control"], False),
        ("stranger", "router", by_kind["control"], False),
        ("prefill", "router", by_kind["control"], True),
        ("decode", "router", by_kind["control"], True),
        ("router", "prefill", control, True), ("router", "decode", control, True),
        ("prefill", "decode", control, True),  # GetTransferInfo (NIXL metadata)
        ("decode", "prefill", control, False), ("client", "prefill", control, False),
        ("stranger", "decode", control, False),
        ("prefill", "decode", lo, True), ("decode", "prefill", hi, True),
        ("decode", "decode", lo, True), ("prefill", "decode", hi + 1, False),
        ("router", "decode", lo, False), ("client", "prefill", lo, False),
        ("prometheus", "prefill", metrics, True), ("prometheus", "decode", metrics, True),
        ("client", "decode", metrics, False), ("router", "prefill", metrics, False),
    ]
    for src, dst, port, want in expect:
        got = ingress_allowed(docs, *pods[src], pods[dst][0], port)
        assert got == want, f"{src} -> {dst}:{port} allowed={got}, expected {want}"


# -- autoscaling -----------------------------------------------------------------------------------
def adapter_metric_names() -> dict[str, str]:
    """Exported series -> the name prometheus-adapter serves it under, per the documented rules."""
    doc = yaml.safe_load((K8S / "prometheus-adapter-rules.yaml").read_text())
    out = {}
    for rule in doc["rules"]["custom"]:
        series = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", rule["seriesQuery"]).group(0)
        m = re.match(rule["name"]["matches"], series)
        assert m, rule
        out[series] = m.expand(re.sub(r"\$\{?(\w+)\}?", r"\\g<\1>", rule["name"]["as"]))
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
        assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
        assert "rate(" not in rule["metricsQuery"]  # gauges
    return out


def exported_series() -> set[str]:
    from prometheus_client import generate_latest

    from kvrelay.engine.engine_core import EngineStats
    from kvrelay.engine.step_cost import StepCostFit
    from kvrelay.worker.metrics import WorkerMetrics

    stats = EngineStats(**{f.name: 1 for f in dataclasses.fields(EngineStats)})
    stats = dataclasses.replace(stats, step_cost=StepCostFit(1e-3, 1e-5, 1e-9, 1e-4, 1e-7, 32),
                                kv_transfer={"held": 1, "hold_ended_notice": 1})
    text = generate_latest(WorkerMetrics(lambda: stats, "prefill", "w").registry).decode()
    return {ln.split("{")[0] for ln in text.splitlines() if ln and not ln.startswith("#")}


def test_hpas_scale_each_pool_on_its_own_exported_metric() -> None:
    docs = render("overlays/gpu")
    names = adapter_metric_names()
    series = exported_series()
    hpas = of_kind(docs, "HorizontalPodAutoscaler")
    assert len(hpas) == 2
    for pool in POOLS:
        dep = pool_deployment(docs, pool)
        [hpa] = [h for h in hpas if h["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]]
        assert hpa["apiVersion"] == "autoscaling/v2"
        [metric] = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods"
        assert POOL_SERIES[pool] in series, f"workers do not export {POOL_SERIES[pool]}"
        assert metric["pods"]["metric"]["name"] == names[POOL_SERIES[pool]]
        assert ":" not in metric["pods"]["metric"]["name"]
        target = quantity(metric["pods"]["target"]["averageValue"])
        assert target > 0 and (pool == "prefill" or target < 1)  # KV usage is a fraction
        pdb = named(docs, "PodDisruptionBudget", dep["metadata"]["name"])
        assert selects(pdb["spec"]["selector"], pod_labels(dep))


# -- images ----------------------------------------------------------------------------------------
def instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", "\n".join(ln for ln in path.read_text().splitlines()
                                            if not ln.lstrip().startswith("#")))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1].strip())
            for ln in text.splitlines() if ln.strip()]


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def constraint(name: str) -> str:
    [pin] = re.findall(rf"^{name}==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    return pin


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile(path: Path) -> None:
    ins = instructions(path)
    [entry] = [json.loads(v) for k, v in ins if k == "ENTRYPOINT"]
    scripts = pyproject()["project"]["scripts"]
    assert entry == ["kvrelay"] and "kvrelay" in scripts
    module, func = scripts["kvrelay"].split(":")
    assert callable(getattr(__import__(module, fromlist=[func]), func))
    args = dict(v.split("=", 1) for k, v in ins if k == "ARG" and "=" in v)
    assert args["TORCH_VERSION"] == constraint("torch")
    cuda = path.name.endswith(".cuda")
    index = r"https://download\.pytorch\.org/whl/" + (r"cu12\d+" if cuda else "cpu")
    assert re.fullmatch(index, args["TORCH_INDEX_URL"]), args["TORCH_INDEX_URL"]
    runs = [v for k, v in ins if k == "RUN"]
    torch_at = [i for i, r in enumerate(runs) if 'torch==${TORCH_VERSION}' in r
                and "${TORCH_INDEX_URL}" in r]
    install = r'pip install\b[^&;]*\s' + (r'"\.\[gpu\]"' if cuda else r"\.") + r"(\s|$)"
    pkg_at = [i for i, r in enumerate(runs) if re.search(install, r)]
    assert torch_at and pkg_at and torch_at[0] < pkg_at[0], "torch first, then the package"
    final = [v for k, v in ins if k == "FROM"][-1]
    assert re.match(r"nvidia/cuda:\S+-runtime-" if cuda else r"python:\S*3\.11-slim", final) or \
        ("${PYTHON_VERSION}-slim" in final and args["PYTHON_VERSION"] == "3.11"), final
    [user] = [v for k, v in ins if k == "USER"]
    assert user.split(":")[0].isdigit() and int(user.split(":")[0]) > 0
    ignore = [ln.strip() for ln in (path.parent / f"{path.name}.dockerignore").read_text()
              .splitlines() if ln.strip() and not ln.startswith("#")]
    assert ignore[0] == "*"
    needed = {"pyproject.toml", "constraints.txt",
              *(f"{d}/" for d in pyproject()["tool"]["setuptools"]["package-dir"].values())}
    assert {f"!{n}" for n in needed} <= set(ignore), "the build context lacks package files"


# -- commands in Dockerfiles, manifests and docs ---------------------------------------------------
def code_of(text: str) -> tuple[list[str], list[str]]:
    """deploy/README.md's fenced code blocks and inline code spans."""
    blocks = re.findall(r"^\s*```[a-z]*\n(.*?)^\s*```", text, re.M | re.S)
    rest = re.sub(r"^\s*```[a-z]*\n.*?^\s*```", "", text, flags=re.M | re.S)
    return blocks, re.findall(r"`([^`\n]+)`", rest)


def command_lines(text: str) -> Iterator[list[str]]:
    """``kvrelay ...`` invocations (and ``docker run IMAGE ...``) in shell text, as argv."""
    text = re.sub(r"\\\n", " ", text)
    for line in text.splitlines():
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        for i, tok in enumerate(tokens):
            prev = tokens[i - 1] if i else ""
            if prev in ("-n", "--namespace", "namespace") or i + 1 >= len(tokens):
                continue
            if tok == "kvrelay" or re.fullmatch(r"kvrelay:[\w.-]+", tok):
                argv = []
                for t in tokens[i + 1:]:
                    if t in ("&", "&&", "|", "||", ";", ">"):
                        break
                    argv.append(t)
                if argv and re.fullmatch(r"[a-z][a-z-]*", argv[0]):
                    yield argv


def used_commands() -> dict[str, list[list[str]]]:
    """Where each ``kvrelay`` subcommand is used: full argv lists (parsed by the tests)."""
    used: dict[str, list[list[str]]] = {}

    def add(argv: list[str]) -> None:
        used.setdefault(argv[0], []).append(argv)

    for path in DOCKERFILES:
        for argv in command_lines(path.read_text().replace("#", "")):
            add(argv)
    for path in KUSTOMIZATIONS:  # (their command lines parse, with their env, further up)
        if _kustomize() is None:
            continue
        for dep in of_kind(render(path), "Deployment"):
            pod = dep["spec"]["template"]["spec"]
            for c in pod["containers"] + pod.get("initContainers", []):
                used.setdefault(c["args"][0], [])
    for argv in command_lines(head_script()):
        add(argv)
    blocks, spans = code_of(README.read_text())
    for argv in (a for b in blocks for a in command_lines(b)):
        add(argv)
    for span in spans:
        m = re.match(r"kvrelay ([a-z][a-z-]*)", span)
        if m:
            used.setdefault(m.group(1), [])
    return used


def test_subcommands_used_exist_and_their_command_lines_parse() -> None:
    used = used_commands()
    assert {"router", "worker", "demo-model", "generate"} <= set(used)
    missing = set(used) - subcommands() - RAY_COMMANDS
    assert not missing, f"kvrelay has no subcommand {missing}"
    for sub, argvs in used.items():
        if sub in RAY_COMMANDS:
            continue
        for argv in argvs:
            parse([a for a in argv if not a.startswith("$(")] or argv)


@pytest.mark.xfail("serve" not in subcommands(), reason="kvrelay serve lands with issue 4",
                   strict=False)
def test_ray_launcher_subcommands_exist_and_parse() -> None:
    used = used_commands()
    assert "serve" in used and "scale" in used
    assert set(used) & RAY_COMMANDS <= subcommands()
    for sub in RAY_COMMANDS & set(used):
        for argv in used[sub]:
            parse(argv)


# -- KubeRay ---------------------------------------------------------------------------------------
def raycluster_docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(RAYCLUSTER.read_text()) if d]


def raycluster() -> dict[str, Any]:
    [rc] = [d for d in raycluster_docs() if d["kind"] == "RayCluster"]
    return rc


def head_script() -> str:
    head = raycluster()["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    return "\n".join(head["args"])


def serve_command() -> argparse.Namespace:
    [argv] = [a for a in command_lines(head_script()) if a[0] == "serve"]
    head = raycluster()["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value", "secret") for e in head.get("env", [])}
    return parse(argv, env)


def test_kuberay_standard_objects_and_pod_templates_validate() -> None:
    docs = raycluster_docs()
    assert {d["kind"] for d in docs} == {"RayCluster", "Service"}
    for d in docs:
        assert d["metadata"]["namespace"] == NAMESPACE
        if d["kind"] != "RayCluster":
            validate(d, RAYCLUSTER.name)
    spec = raycluster()["spec"]
    groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g)
                                                   for g in spec["workerGroupSpecs"]]
    for name, group in groups:
        validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
                  "template": group["template"]}, f"{RAYCLUSTER.name} {name} group")


def test_kuberay_cluster_structure() -> None:
    rc = raycluster()
    assert rc["apiVersion"] == "ray.io/v1"
    assert rc["spec"]["rayVersion"] == constraint("ray")
    assert rc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    spec = rc["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["authOptions"]["mode"] == "token"  # Ray's own endpoints run code on request
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == set(POOLS)
    ns = serve_command()
    assert ns.address == "auto"
    counts = {"prefill": int(ns.prefill), "decode": int(ns.decode)}
    assert counts["prefill"] != counts["decode"]
    wanted = {"prefill": json.loads(ns.prefill_resources),
              "decode": json.loads(ns.decode_resources)}
    for group in [spec["headGroupSpec"], *groups.values()]:
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        pod = group["template"]["spec"]
        assert pod["enableServiceLinks"] is False
        c = pod["containers"][0]
        # overwrite-container-cmd: the container runs KubeRay's `ray start` itself, through
        # eval (the generated command carries shell quoting for --resources).
        assert c["command"][:2] == ["/bin/bash", "-c"]
        assert re.search(r'eval "(exec )?\$KUBERAY_GEN_RAY_START_CMD"', "\n".join(c["args"]))
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert "/models" in mounts and ns.model.startswith("/models/")
    for pool, g in groups.items():
        advertised = json.loads(json.loads(g["rayStartParams"]["resources"].strip("'")))
        assert advertised == wanted[pool], pool
        assert g["minReplicas"] <= g["replicas"] == counts[pool] <= g["maxReplicas"]
        c = g["template"]["spec"]["containers"][0]
        assert float(ns.cpus_per_replica) <= quantity(c["resources"]["limits"]["cpu"])
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert not {k for k in env if k.startswith("KVRELAY_")}, "actors take no CLI env"
        assert env["NIXL_LOG_LEVEL"] == "WARN" and re.fullmatch(r"\d+-\d+",
                                                                env["UCX_TCP_PORT_RANGE"])
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    unknown = {e["name"] for e in head["env"] if e["name"].startswith("KVRELAY_")} \
        - cli_env().get("serve", frozenset())
    assert not unknown, f"`kvrelay serve` ignores {unknown}"
    [svc] = [d for d in raycluster_docs() if d["kind"] == "Service"]
    assert svc["spec"]["selector"] == {"ray.io/cluster": rc["metadata"]["name"],
                                       "ray.io/node-type": "head"}
    head_ports = {p["containerPort"] for p in head["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == \
        {int(ns.grpc_port), int(ns.http_port)}
    assert {int(ns.grpc_port), int(ns.http_port), int(ns.control_port)} <= head_ports


def test_secret_example() -> None:
    [secret] = list(yaml.safe_load_all((K8S / "base" / "secret.example.yaml").read_text()))
    validate(secret, "secret.example.yaml")
    keys = set(secret["stringData"])
    assert keys == {"KVRELAY_API_KEYS", "KVRELAY_CLUSTER_TOKEN"}
    assert keys <= cli_env()["router"] and "KVRELAY_CLUSTER_TOKEN" in cli_env()["worker"]
    assert all("CHANGE-ME" in v for v in secret["stringData"].values())
    for path in KUSTOMIZATIONS:  # a template only: applying a kustomization never ships it
        k = kustomization(path)
        assert "secret.example.yaml" not in k.get("resources", []) + k.get("components", [])
