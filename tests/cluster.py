"""The tests' cluster: the shared loopback harness (``kvrelay.local_cluster``) with workers
sized for tests (one torch thread, a 64 MiB KV cache)."""

from __future__ import annotations

from typing import Any

from kvrelay.forking import Forked
from kvrelay.local_cluster import Cluster as LocalCluster
from kvrelay.local_cluster import Proc

__all__ = ["WORKER_ARGS", "Cluster", "Forked", "Proc"]

WORKER_ARGS = ("--num-threads", "1", "--kv-cache-memory", "64MiB")


class Cluster(LocalCluster):
    def __init__(self, *args: Any, worker_args: tuple[str, ...] = (), **kw: Any):
        super().__init__(*args, worker_args=WORKER_ARGS + tuple(worker_args), **kw)

    def live(self, role: str) -> list[Proc]:
        """The workers of ``role`` still running."""
        return [p for p in self.workers if p.name.startswith(role) and p.alive()]

    def ensure_workers(self, **counts: int) -> None:
        """Start workers until each role has its count running (a module sharing this cluster
        after another killed one of them gets it replaced), then wait until they registered."""
        for role, n in counts.items():
            for _ in range(n - len(self.live(role))):
                self.add_worker(role, wait=False)
        for p in self.workers:
            if p.alive() and p.ready is None:
                self.wait_ready(p)
        self.wait_registered()

    def openai(self, timeout: float = 120.0) -> Any:
        """An OpenAI SDK client of the router's HTTP API (started with ``--http-port``)."""
        import openai

        return openai.OpenAI(base_url=f"{self.http_url}/v1", api_key="unused", max_retries=0,
                             timeout=timeout)
