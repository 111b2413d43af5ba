"""What the deployment tests share: rendering every kustomization and validating it, the
CLI's parser and environment, the processes the rendered manifests start.

Deployment manifests, images and their docs agree with each other and with the CLI.

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
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
KUSTOMIZATIONS = ("base", "overlays/cpu-demo", "overlays/cpu-demo-tp", "overlays/gpu")
OVERLAYS = ("overlays/cpu-demo", "overlays/cpu-demo-tp", "overlays/gpu")
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
# gRPC health service names each server registers (router/server.py, worker/process.py).
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
            if ns.metrics_port not in (None, ""):
                ports[int(ns.metrics_port)] = "metrics"
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
        if self.command == "router":  # the public port's /metrics is no scrape target
            return {"http": {"/health"}, "metrics": {"/metrics"}}.get(kind, set())
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


