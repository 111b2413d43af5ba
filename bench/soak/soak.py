"""Soak test: a 1P1D cluster under a steady mixed load for a while, watching memory and KV blocks.

Starts a router (gRPC + OpenAI HTTP), one prefill and one decode worker (``kvrelay`` processes
on loopback), then keeps ``--concurrency`` clients busy with a mix of requests for ``--minutes``:
gRPC streams, HTTP completions (streamed and not), chat, prompts of a few to a thousand tokens,
prompts sharing a long prefix (prefix cache), streams the client cancels part way, requests that
hit their deadline, and malformed requests the router must refuse. Every ``--interval`` seconds
it samples the RSS of every process (psutil when installed, else /proc) and every worker's KV
blocks (WorkerControl.GetStatus), printing a table row. At the end it lets the cluster go idle,
takes a last sample, prints start / end / max per process and writes everything to ``--out``.

    .venv/bin/python -m bench.soak.soak --minutes 10 --out bench/results/soak.json

Exit status 1 if a process died or a worker's free KV blocks did not come back to their idle
value (a leak); 0 otherwise.

The parts: ``bench.soak.soak_cluster`` (the processes), ``bench.soak.soak_load`` (the clients),
``bench.soak.soak_sampling`` (RSS, KV blocks, the table and the summary); this module runs them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.soak.soak_cluster import ROOT, soak_cluster
from bench.soak.soak_load import Load
from bench.soak.soak_sampling import flatness as flatness  # where the tests find it
from bench.soak.soak_sampling import (
    format_header,
    format_row,
    print_summary,
    sample,
    summarize,
    worker_status,
)
from kvrelay.local_cluster import Cluster


async def soak(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    config = json.loads(Path(args.model_dir, "config.json").read_text())
    vocab = min(int(config["vocab_size"]), 4000)  # the tokenizer's ids, specials aside
    names = [p.name for p in cluster.procs] + ["soak-client"]
    wnames = [w.name for w in cluster.workers]
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()

    def record(s: dict[str, Any]) -> None:
        samples.append(s)
        print(format_row(s, names, wnames), flush=True)

    print(format_header(names, wnames), flush=True)
    record(await sample(cluster, t0, None, "idle"))
    load = Load(cluster, args.concurrency, args.seed, vocab)
    duration = args.minutes * 60.0
    task = asyncio.get_running_loop().create_task(load.run(duration))
    while not task.done():
        await asyncio.wait([task], timeout=args.interval)
        if not task.done():
            record(await sample(cluster, t0, load, "load"))
            if not all(p.alive() for p in cluster.procs):
                task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    load_s = time.monotonic() - t0
    # Idle again: every worker's free blocks should return to their idle value.
    idle = samples[0]["workers"]
    deadline = time.monotonic() + args.settle
    while time.monotonic() < deadline:
        now = {w: await worker_status(f"127.0.0.1:{p.ready['port']}")
               for w, p in zip(wnames, cluster.workers, strict=True)}
        if all(now[w] and idle[w] and now[w]["free_blocks"] == idle[w]["free_blocks"]
               for w in wnames):
            break
        await asyncio.sleep(0.5)
    record(await sample(cluster, t0, load, "end"))

    window_s = min(args.flat_minutes * 60.0, load_s * 2 / 3)
    summary = summarize(samples, names, wnames, window_s)
    died = [p.name for p in cluster.procs if not p.alive()]
    return {
        "args": {k: v for k, v in vars(args).items()},
        "duration_s": round(load_s, 1),
        "requests": dict(sorted(load.outcomes.items())),
        "requests_total": sum(load.outcomes.values()),
        "requests_per_s": round(sum(load.outcomes.values()) / max(load_s, 1e-9), 2),
        "output_tokens": load.tokens_out,
        "unexpected_examples": load.unexpected,
        "processes_died": died,
        "summary": summary,
        "samples": samples,
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the load runs")
    ap.add_argument("--out", default="bench/results/soak.json", help="JSON written here")
    ap.add_argument("--interval", type=float, default=15.0, help="seconds between samples")
    ap.add_argument("--concurrency", type=int, default=4, help="clients in a loop")
    ap.add_argument("--model-dir", default=str(ROOT / ".bench-out" / "models" / "tiny"),
                    help="checkpoint (the tiny demo model is written there when missing)")
    ap.add_argument("--kv-cache-memory", default="128MiB", help="per worker")
    ap.add_argument("--workdir", default=None, help="process logs (default: a temp dir)")
    ap.add_argument("--settle", type=float, default=60.0,
                    help="seconds to wait, after the load, for KV blocks to come back")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flat-minutes", type=float, default=20.0,
                    help="window at the end of the load whose RSS spread is reported "
                         "(at most 2/3 of the load)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if not Path(args.model_dir, "config.json").exists():
        subprocess.run([sys.executable, "-m", "kvrelay.cli", "demo-model", args.model_dir],
                       check=True, cwd=str(ROOT))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvrelay-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"soak: {args.minutes:g} min, {args.concurrency} clients, logs in {workdir}",
          flush=True)
    cluster = soak_cluster(args.model_dir, workdir, [
        "--num-threads", "1", "--kv-cache-memory", args.kv_cache_memory])

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwind through the finally: stop the cluster

    signal.signal(signal.SIGTERM, on_term)
    try:
        cluster.start()
        doc = asyncio.run(soak(args, cluster))
    finally:
        cluster.stop()
    doc["logs"] = str(workdir)
    doc["exit_codes"] = {p.name: p.popen.returncode for p in cluster.procs}
    print_summary(doc)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {out}")
    leak = not all(v["back_to_start"] for v in doc["summary"]["free_blocks"].values())
    return 1 if doc["processes_died"] or leak else 0


if __name__ == "__main__":
    sys.exit(main())
