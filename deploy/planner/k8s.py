"""``kvrelay planner``: the same planner without Ray, as its own small process (Kubernetes).

Every interval it scrapes the router's /metrics (``--router-metrics``), builds the observation
(``observer.py``: TTFT and per-request ITL p90 from the interval's histogram buckets), decides,
and publishes the decision on its own /metrics (``kvrelay:planner_*``). Then, by ``--apply``:

* ``scale`` (default): patches the ``scale`` subresource of the prefill and decode Deployments
  (in-cluster service account; RBAC: get/patch ``deployments/scale``, get ``deployments``).
  A pool whose Deployment has fewer ready replicas than it asks for is "changing": the planner
  holds it until the rollout is done (as the Ray controller holds a pool mid-change). Do not
  keep an HPA on the same Deployments: two controllers would fight.
* ``metric``: patches nothing; an HPA per pool follows ``kvrelay:planner_desired_replicas``
  (an External metric through prometheus-adapter, target type Value).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import ssl
import time
import urllib.request
from typing import Any

from kvrelay.deploy.planner.observer import Snapshot, observe, parse
from kvrelay.deploy.planner.signals import POOLS

logger = logging.getLogger(__name__)
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def _read(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip()


class DeploymentScaler:
    """Replica counts of two Deployments through the Kubernetes API (in-cluster config)."""

    def __init__(self, namespace: str, names: dict[str, str], api: str | None = None,
                 sa_dir: str = SA_DIR):
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        self.api = api or (f"https://{host}:{port}" if host else "")
        if not self.api:
            raise RuntimeError("not in a cluster: pass --k8s-api (and a token file)")
        self.namespace, self.names = namespace, names
        # A projected (bound) service-account token expires and is rotated in place by the
        # kubelet (about hourly): read it again for every call, never once at start.
        self.token_path = os.path.join(sa_dir, "token")
        ca = os.path.join(sa_dir, "ca.crt")
        self.ctx = ssl.create_default_context(cafile=ca if os.path.exists(ca) else None)

    @property
    def token(self) -> str | None:
        """The service account's token as the kubelet last wrote it (None: no file)."""
        return _read(self.token_path)

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(self.api + path, method=method,
                                     data=None if body is None else json.dumps(body).encode())
        token = self.token
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        if body is not None:
            req.add_header("Content-Type", "application/merge-patch+json")
        ctx = self.ctx if self.api.startswith("https") else None
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return json.loads(r.read())

    def _path(self, pool: str) -> str:
        return f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{self.names[pool]}"

    def read(self) -> tuple[dict[str, int], tuple[str, ...]]:
        """(desired replicas per pool, pools still rolling out)."""
        counts, changing = {}, []
        for pool in POOLS:
            d = self._call("GET", self._path(pool))
            want = int(d.get("spec", {}).get("replicas", 0))
            ready = int(d.get("status", {}).get("readyReplicas", 0) or 0)
            counts[pool] = want
            if ready != want:
                changing.append(pool)
        return counts, tuple(changing)

    def scale(self, pool: str, n: int) -> None:
        self._call("PATCH", self._path(pool) + "/scale", {"spec": {"replicas": n}})


def _scrape(url: str, token: str | None) -> str:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def add_options(p: argparse.ArgumentParser) -> None:
    from kvrelay.common.options import opt
    from kvrelay.deploy.planner.cli import add_planner_options

    add_planner_options(p, slo_options=True)
    opt(p, "--router-metrics", default="http://kvrelay-router-control:9100/metrics",
        help="the router's Prometheus /metrics URL (its scrape port, --metrics-port; not the "
             "public HTTP port, where /metrics is not served once API keys are set)")
    opt(p, "--apply", default="scale", choices=["scale", "metric"],
        help="scale: patch the Deployments' replicas; metric: only publish the desired counts")
    opt(p, "--namespace", default=None, help="default: the pod's own namespace")
    opt(p, "--prefill-deployment", default="kvrelay-prefill")
    opt(p, "--decode-deployment", default="kvrelay-decode")
    opt(p, "--k8s-api", default=None, help="API server URL (default: in-cluster)")
    opt(p, "--metrics-port", type=int, default=9400, help="the planner's own /metrics")
    opt(p, "--log-level", default="INFO")


def cmd_planner(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry, start_http_server

    from kvrelay.common.logs import setup_logging
    from kvrelay.deploy.planner.cli import build_planner
    from kvrelay.deploy.planner.metrics import PlannerMetrics
    from kvrelay.deploy.planner.planner import Planner

    setup_logging("planner", args.log_level)
    args.planner = True
    spec = build_planner(args)
    ns = args.namespace
    if ns is None:
        f = os.path.join(SA_DIR, "namespace")
        ns = _read(f) or "kvrelay"
    scaler = None
    if args.apply == "scale":
        scaler = DeploymentScaler(ns, {"prefill": args.prefill_deployment,
                                       "decode": args.decode_deployment}, args.k8s_api)
    registry = CollectorRegistry()
    metrics = PlannerMetrics(registry)
    start_http_server(int(args.metrics_port), registry=registry)
    token = os.environ.get("KVRELAY_METRICS_TOKEN")
    run_loop(Planner(spec.profile, spec.config), lambda: _scrape(args.router_metrics, token),
             scaler, metrics, spec.config.interval_s)
    return 0


def run_loop(planner: Any, scrape: Any, scaler: DeploymentScaler | None, metrics: Any,
             interval_s: float, iterations: int | None = None) -> None:
    prev: Snapshot | None = None
    was_changing: set[str] = set()
    i = 0
    while iterations is None or i < iterations:
        i += 1
        time.sleep(interval_s)
        try:
            cur = parse(scrape(), time.monotonic())
            counts, changing = scaler.read() if scaler else (None, ())
        except Exception as e:
            logger.warning("planner: could not read the load or the Deployments: %r", e)
            continue
        for pool in was_changing - set(changing):
            planner.change_done(pool, cur.t)
        was_changing = set(changing)
        if prev is None:
            prev = cur
            continue
        obs = observe(prev, cur, counts, changing)
        prev = cur
        d = planner.decide(obs)
        current = {p: obs.replicas(p) for p in POOLS}
        metrics.record(d, current)
        logger.info("planner: %s", d.reason)
        if scaler is None:
            continue
        for pool in POOLS:
            if d.target(pool) != current[pool] and pool not in changing:
                try:
                    scaler.scale(pool, d.target(pool))
                    was_changing.add(pool)
                except Exception as e:
                    logger.warning("planner: scaling %s to %d failed: %r", pool,
                                   d.target(pool), e)
