"""The soak's cluster: a router with its OpenAI HTTP API, one prefill and one decode worker, as
``kvrelay`` processes on loopback, started by the shared harness (``kvrelay.local_cluster``)."""

from __future__ import annotations

from pathlib import Path

from kvrelay.local_cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]
SERVED = "demo"


def soak_cluster(model_dir: str, workdir: Path, worker_args: list[str]) -> Cluster:
    return Cluster(model_dir, workdir, prefill=1, decode=1, worker_args=tuple(worker_args),
                   router_args=("--served-model-name", SERVED, "--http-port", "0"),
                   heartbeat_s=1.0, ready_timeout_s=180.0)
