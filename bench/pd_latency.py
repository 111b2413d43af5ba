"""TTFT and inter-token latency of one request at a time: 1P1D vs ``role=both``, same model.

    NIXL_LOG_LEVEL=WARN .venv/bin/python bench/pd_latency.py [--model DIR] [--prompt-tokens 512]

Starts real processes (router + workers, as `kvrelay router` / `kvrelay worker`) for each
configuration in turn, pinned the way the serving benchmark pins them: 1P1D gets one core per
worker, ``both`` one worker with one core (the same compute per worker), plus ``both`` with two
threads on both cores (the same machine). Sends ``--requests`` greedy requests one after another
over gRPC and reports TTFT and ITL (gaps between streamed messages) medians and p90.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from kvrelay.client import Client, sampling

KVRELAY = [sys.executable, "-m", "kvrelay.cli"]


def start(cmd: list[str], workdir: Path, name: str, cores: str | None) -> tuple[subprocess.Popen,
                                                                                 dict]:
    ready = workdir / f"{name}.ready"
    log = open(workdir / f"{name}.log", "w")  # noqa: SIM115 (the child owns it)
    if cores is not None:
        cmd = ["taskset", "-c", cores, *cmd]
    p = subprocess.Popen([*cmd, "--ready-file", str(ready)], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if ready.exists() and ready.stat().st_size:
            return p, json.loads(ready.read_text())
        if p.poll() is not None:
            break
        time.sleep(0.2)
    p.kill()
    raise SystemExit(f"{name} did not start; see {workdir / (name + '.log')}")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(model: str, workers: list[tuple[str, str, int]], args: argparse.Namespace) -> dict:
    kv = [*KVRELAY, "worker", "--model", model, "--kv-cache-memory", "512MiB", "--port", "0"]
    with tempfile.TemporaryDirectory() as tmp:
        wd = Path(tmp)
        procs = []
        try:
            r, info = start([*KVRELAY, "router", "--model", model, "--port", "0",
                             "--control-port", "0"], wd, "router", None)
            procs.append(r)
            for role, cores, threads in workers:
                p, _ = start([*kv, "--role", role, "--num-threads", str(threads), "--router",
                              f"127.0.0.1:{info['control_port']}"], wd, role, cores)
                procs.append(p)
            ttft, itl = [], []
            with Client(f"127.0.0.1:{info['port']}") as c:
                for i in range(args.warmup + args.requests):
                    ids = [(7 + 31 * i + 17 * k) % 4000 + 10 for k in range(args.prompt_tokens)]
                    t0 = time.perf_counter()
                    stamps = []
                    for msg in c.stream(ids, sampling(args.max_tokens, 0.0, ignore_eos=True),
                                        timeout=120):
                        if msg.token_ids:
                            stamps.append(time.perf_counter())
                    if i < args.warmup:
                        continue
                    ttft.append(stamps[0] - t0)
                    itl += [b - a for a, b in itertools.pairwise(stamps)]
            return {"ttft_p50": statistics.median(ttft), "ttft_p90": pct(ttft, 0.9),
                    "itl_p50": statistics.median(itl), "itl_p90": pct(itl, 0.9)}
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=".bench-out/models/tiny")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    if not Path(args.model, "config.json").exists():
        subprocess.run([*KVRELAY, "demo-model", args.model], check=True)
    configs = {
        "1P1D (1 core each)": [("prefill", "0", 1), ("decode", "1", 1)],
        "both (1 core)": [("both", "0", 1)],
        "both (2 cores)": [("both", "0,1", 2)],
    }
    print(f"model {args.model}; {args.prompt_tokens}-token prompt, {args.max_tokens} tokens out, "
          f"one request at a time, {args.requests} requests; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'config':<22} {'TTFT p50':>9} {'TTFT p90':>9} {'ITL p50':>8} {'ITL p90':>8}  (ms)")
    for name, workers in configs.items():
        m = measure(args.model, workers, args)
        print(f"{name:<22} {m['ttft_p50'] * 1e3:>9.1f} {m['ttft_p90'] * 1e3:>9.1f} "
              f"{m['itl_p50'] * 1e3:>8.2f} {m['itl_p90'] * 1e3:>8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
