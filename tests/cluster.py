"""The tests' cluster: the shared loopback harness (``kvrelay.local_cluster``) with workers
sized for tests (one torch thread, a 64 MiB KV cache)."""

from __future__ import annotations

from typing import Any

from kvrelay.local_cluster import Cluster as LocalCluster
from kvrelay.local_cluster import Proc

__all__ = ["WORKER_ARGS", "Cluster", "Proc"]

WORKER_ARGS = ("--num-threads", "1", "--kv-cache-memory", "64MiB")


class Cluster(LocalCluster):
    def __init__(self, *args: Any, worker_args: tuple[str, ...] = (), **kw: Any):
        super().__init__(*args, worker_args=WORKER_ARGS + tuple(worker_args), **kw)
