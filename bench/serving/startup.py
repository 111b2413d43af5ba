"""Replica start-up: how long a ``kvrelay worker`` takes from exec to ready, and its CPU.

The planner and the autoscaler add replicas by starting workers, so start-up is part of how fast
a pool follows its load. Starts a router, then ``--workers`` prefill workers one at a time
(nothing else starting beside each), with the engine settings the tests use unless given, and
prints per worker: seconds from spawn to its ready file, CPU seconds spent by then, and the
mean at the end.

    .venv/bin/python -m bench.serving.startup --model .bench-out/models/tiny --workers 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.serving.serving_procs import cpu_seconds
from kvrelay.local_cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--workers", type=int, default=5)
    ap.add_argument("--worker-args", default="--num-threads 1 --kv-cache-memory 64MiB")
    ap.add_argument("--fork", action="store_true",
                    help="fork workers from the harness's fork server (as the tests do) instead "
                         "of exec'ing `kvrelay worker` (as a user does); the server's one-time "
                         "import is not counted")
    args = ap.parse_args()
    walls, cpus = [], []
    with tempfile.TemporaryDirectory() as tmp, \
            Cluster(args.model, Path(tmp), prefill=0, decode=0,
                    worker_args=tuple(args.worker_args.split()),
                    fork=args.fork) as cluster:
        for i in range(args.workers):
            t = time.monotonic()
            proc = cluster.add_worker("prefill", worker_id=f"startup-{i}")
            walls.append(time.monotonic() - t)
            cpus.append(cpu_seconds([proc.popen.pid]))
            print(f"worker {i}: ready in {walls[-1]:.2f} s, {cpus[-1]:.2f} CPU s", flush=True)
            cluster.kill(proc)
    print(f"mean: ready in {statistics.mean(walls):.2f} s (min {min(walls):.2f}), "
          f"{statistics.mean(cpus):.2f} CPU s")


if __name__ == "__main__":
    main()
