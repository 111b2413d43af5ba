"""P->D hand-off latency of one request at a time on an idle cluster: TTFT stage by stage.

    NIXL_LOG_LEVEL=WARN .venv/bin/python -m bench.transfer.pd_latency [--model DIR] \\
        [--prompt-tokens 32 512]

Starts real processes (router + workers, as `kvrelay router` / `kvrelay worker`) for each
configuration in turn, pinned the way the serving benchmark pins them: 1P1D gets one core per
worker; "prefill alone" is one ``role=both`` worker on the prefill worker's core (the same
compute, no hand-off). Sends ``--requests`` greedy requests one after another over gRPC per
prompt length and reports, for 1P1D, where the time to first token goes, then the hand-off
overhead = TTFT(1P1D) - TTFT(prefill alone), p50 and p90 (ms).

The stages come from the router's timing fields and trace (``Timing``, trace events) and from the
workers' ``kvrelay.common.timeline`` marks (``time.monotonic()``, one clock for every process of the
host), which the workers log when ``KVRELAY_DEBUG_LOGGERS=kvrelay.common.timeline``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from kvrelay.client import sampling
from kvrelay.local_cluster import Cluster as LocalCluster

KVRELAY = [sys.executable, "-m", "kvrelay.cli"]
MARK_RE = re.compile(r"mark (\S+) (\S+) ([0-9.]+)$")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


@dataclass
class Sample:
    """One request: the client's view, the router's timing and trace, the workers' marks."""

    ttft: float  # client, seconds
    itl: list[float]
    timing: dict[str, float]
    trace: dict[str, float]  # event -> ms since the router received the request (first one)
    marks: dict[str, float] = field(default_factory=dict)  # event -> monotonic seconds


def read_marks(workdir: Path) -> dict[str, dict[str, float]]:
    """request id (the client's, before the lifecycle's pass suffix) -> event -> time."""
    marks: dict[str, dict[str, float]] = {}
    for log in workdir.glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            m = MARK_RE.search(line)
            if m:
                rid = m.group(2).split(".")[0]
                marks.setdefault(rid, {}).setdefault(m.group(1), float(m.group(3)))
    return marks


class Cluster:
    """A router and its workers as real processes (the shared loopback harness, each worker
    pinned to its cores); ``close()`` stops them and reads the marks."""

    def __init__(self, model: str, workers: list[tuple[str, str, int]], wd: Path,
                 router_args: tuple[str, ...] = ()) -> None:
        self.wd = wd
        self.cluster = LocalCluster(model, wd, prefill=0, decode=0, router_args=router_args,
                                    env={"KVRELAY_DEBUG_LOGGERS": "kvrelay.timeline"},
                                    heartbeat_s=1.0, ready_timeout_s=120.0)
        try:
            self.cluster.start()
            procs = [self.cluster.add_worker(
                role, wait=False, cores=cores,
                extra=("--kv-cache-memory", "512MiB", "--port", "0", "--num-threads",
                       str(threads))) for role, cores, threads in workers]
            for p in procs:
                self.cluster.wait_ready(p)
            self.cluster.wait_registered()
        except BaseException:
            self.cluster.stop()
            raise
        self.client = self.cluster.client()
        self.samples: dict[int, list[Sample]] = {}
        self.ids: dict[int, list[str]] = {}

    def request(self, n: int, i: int, args: argparse.Namespace, record: bool) -> None:
        prompt = [(7 + 31 * i + 17 * k + 101 * n) % 4000 + 10 for k in range(n)]
        rid = f"pd{n}-{i}"
        t0 = time.monotonic()
        stamps: list[float] = []
        last = None
        for msg in self.client.stream(prompt, sampling(args.max_tokens, 0.0, ignore_eos=True),
                                      request_id=rid, timeout=120):
            if msg.token_ids:
                stamps.append(time.monotonic())
            last = msg
        if not record:
            return
        t = last.timing
        trace: dict[str, float] = {}
        for e in last.trace:
            trace.setdefault(e.name, e.t_ms)
        self.samples.setdefault(n, []).append(Sample(
            stamps[0] - t0, [b - a for a, b in itertools.pairwise(stamps)],
            {f.name: getattr(t, f.name) for f in t.DESCRIPTOR.fields}, trace))
        self.ids.setdefault(n, []).append(rid)

    def close(self) -> None:
        if hasattr(self, "client"):
            self.client.close()
        self.cluster.stop()
        marks = read_marks(self.wd)
        for n, samples in self.samples.items():
            for rid, s in zip(self.ids[n], samples, strict=True):
                s.marks = marks.get(rid, {})


Config = tuple[list[tuple[str, str, int]], tuple[str, ...]]  # workers, router arguments


def measure(model: str, configs: dict[str, Config],
            args: argparse.Namespace) -> dict[str, dict[int, list[Sample]]]:
    """Every configuration up at once (an idle cluster burns no CPU), requests alternating
    between them, so that drifting background load hits each alike."""
    with tempfile.TemporaryDirectory() as tmp:
        clusters: dict[str, Cluster] = {}
        try:
            for name, (workers, router_args) in configs.items():
                wd = Path(tmp, f"c{len(clusters)}")
                wd.mkdir()
                clusters[name] = Cluster(model, workers, wd, router_args)
            for n in args.prompt_tokens:
                for i in range(args.warmup + args.requests):
                    for c in clusters.values():
                        c.request(n, i, args, record=i >= args.warmup)
                        time.sleep(args.gap)
        finally:
            for c in clusters.values():
                c.close()
        return {name: c.samples for name, c in clusters.items()}


def _mark(a: str, b: str) -> Callable[[Sample], float | None]:
    def f(s: Sample) -> float | None:
        if a in s.marks and b in s.marks:
            return (s.marks[b] - s.marks[a]) * 1e3
        return None
    return f


def _ahead(s: Sample) -> bool:
    """The Prefill left beside the Reserve (``--prefill-ahead``)."""
    return s.trace.get("destination") is not None


def _late_destination(s: Sample) -> float | None:
    """How long a prefill sent ahead waited, after its compute, for its destination."""
    if not _ahead(s) or "prefill_destination" not in s.marks or "kv_finished" not in s.marks:
        return None
    return max(0.0, (s.marks["prefill_destination"] - s.marks["kv_finished"]) * 1e3)


# (label, ms of one request or None), in the order the time passes; the TTFT rows come first.
STAGES: list[tuple[str, Callable[[Sample], float | None]]] = [
    ("router queue (receipt -> first RPC sent)",
     lambda s: min(s.trace["prefill_start"], s.trace["reserved"] - s.timing["reserve_ms"])),
    ("reserve round trip, before the Prefill",
     lambda s: None if _ahead(s) else s.timing["reserve_ms"]),
    ("reserve round trip, beside the prefill",
     lambda s: s.timing["reserve_ms"] if _ahead(s) else None),
    ("router: reserved -> Prefill sent",
     lambda s: None if _ahead(s) else s.trace["prefill_start"] - s.trace["reserved"]),
    ("P: Prefill call in -> scheduled",
     lambda s: s.timing["queue_ms"] - s.trace["prefill_start"]),
    ("prefill compute", lambda s: s.timing["prefill_ms"]),
    ("destination named after the compute ended", _late_destination),
    ("KV write tail (compute end -> writes done)", _mark("kv_finished", "kv_written")),
    ("notification send", _mark("kv_written", "kv_notified")),
    ("P notices delivery (notified -> engine)", _mark("kv_notified", "kv_sent_seen")),
    ("P: engine -> Prefill reply", _mark("kv_sent_seen", "prefill_rpc_out")),
    ("Prefill RPC transport (both ways)",
     lambda s: (s.trace["prefill_end"] - s.trace["prefill_start"])
     - (s.marks["prefill_rpc_out"] - s.marks["prefill_rpc_in"]) * 1e3
     if "prefill_rpc_out" in s.marks else None),
    ("router: Prefill reply -> first token out",
     lambda s: s.trace["first_token"] - s.trace["prefill_end"]),
    ("client <-> router gRPC (ingress + egress)",
     lambda s: s.ttft * 1e3 - s.timing["ttft_ms"]),
    ("= TTFT at the client", lambda s: s.ttft * 1e3),
    # after the first token: the decode worker takes over
    ("notification delivery (P sent -> D noticed)", _mark("kv_notified", "kv_received")),
    ("D: KV noticed -> Decode call in", _mark("kv_received", "decode_rpc_in")),
    ("D: Decode call in -> first decode token out", _mark("decode_rpc_in", "decode_first_out")),
    ("router: first token -> first decode token",
     lambda s: s.trace["decode_first"] - s.trace["first_token"]
     if "decode_first" in s.trace else None),
]
# The TTFT stages a role=both worker does not have (compute and client/router excluded): a
# Reserve before the Prefill, the wait for a late destination, the KV write tail, the
# notification, the engine noticing it, the Prefill call's transport.
_HANDOFF = ("reserve round trip, before the Prefill", "router: reserved -> Prefill sent",
            "destination named after the compute ended",
            "KV write tail (compute end -> writes done)", "notification send",
            "P notices delivery (notified -> engine)", "P: engine -> Prefill reply",
            "Prefill RPC transport (both ways)")


def _handoff(s: Sample) -> float | None:
    total = 0.0
    for label, f in STAGES:
        if label in _HANDOFF:
            try:
                v = f(s)
            except KeyError:
                return None
            total += v or 0.0
    return total


STAGES.insert(next(i for i, (lb, _) in enumerate(STAGES) if lb.startswith("= TTFT")) + 1,
              ("hand-off stages in TTFT (sum, no compute)", _handoff))


def breakdown(res: dict[int, list[Sample]]) -> list[str]:
    ns = sorted(res)
    head = f"{'stage (ms)':<46}" + "".join(f"{f'{n} tok p50':>12}{'p90':>7}" for n in ns)
    lines = [head]
    for label, f in STAGES:
        row = f"{label:<46}"
        for n in ns:
            vals = []
            for s in res[n]:
                try:
                    v = f(s)
                except KeyError:
                    v = None
                if v is not None:
                    vals.append(v)
            row += f"{statistics.median(vals):>12.2f}{pct(vals, 0.9):>7.2f}" if vals \
                else f"{'-':>12}{'-':>7}"
        lines.append(row)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=".bench-out/models/tiny")
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[32, 512])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gap", type=float, default=0.02, help="idle seconds between requests")
    args = ap.parse_args()
    if not Path(args.model, "config.json").exists():
        subprocess.run([*KVRELAY, "demo-model", args.model], check=True)
    print(f"model {args.model}; prompts of {args.prompt_tokens} tokens, {args.max_tokens} tokens "
          f"out, one request at a time, {args.requests} requests each; load average "
          f"{os.getloadavg()[0]:.2f}")
    pd_workers = [("prefill", "0", 1), ("decode", "1", 1)]
    configs: dict[str, Config] = {
        "1P1D, Prefill ahead": (pd_workers, ("--prefill-ahead",)),
        "1P1D": (pd_workers, ()),
        "prefill alone (both)": ([("both", "0", 1)], ()),
    }
    res = measure(args.model, configs, args)
    alone = res["prefill alone (both)"]
    for name in ("1P1D", "1P1D, Prefill ahead"):
        print(f"{name} (1 core each), per-stage breakdown:")
        for line in breakdown(res[name]):
            print(line)
    print(f"{'':<30} {'TTFT p50':>9} {'TTFT p90':>9} {'ITL p50':>8} {'ITL p90':>8}  (ms)")
    for name, r in res.items():
        for n in sorted(r):
            ttft = [s.ttft * 1e3 for s in r[n]]
            itl = [g * 1e3 for s in r[n] for g in s.itl]
            print(f"{f'{name}, {n} tok':<30} {statistics.median(ttft):>9.2f} "
                  f"{pct(ttft, 0.9):>9.2f} {statistics.median(itl):>8.2f} {pct(itl, 0.9):>8.2f}")
    for name in ("1P1D", "1P1D, Prefill ahead"):
        for n in sorted(res[name]):
            a = [s.ttft * 1e3 for s in res[name][n]]
            b = [s.ttft * 1e3 for s in alone[n]]
            print(f"hand-off overhead ({name}), {n}-token prompt: p50 "
                  f"{statistics.median(a) - statistics.median(b):.2f} ms, p90 "
                  f"{pct(a, 0.9) - pct(b, 0.9):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
