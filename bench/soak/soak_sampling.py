"""The soak test's measurements: RSS per process (psutil when installed, else /proc), every
worker's KV blocks (WorkerControl.GetStatus), the sample table, and the end-of-run summary
(start / end / max RSS, its spread over the last window of load, KV blocks back to idle).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import grpc

from bench.soak.soak_load import Load
from kvrelay.local_cluster import Cluster
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

MiB = 2**20


# -- memory ---------------------------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    """``pid`` and its descendants (a worker may start helpers)."""
    try:
        import psutil

        proc = psutil.Process(pid)
        return [pid, *(c.pid for c in proc.children(recursive=True))]
    except ImportError:
        pass
    except Exception:
        return [pid]
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def rss_bytes(pid: int, *, tree: bool = True) -> int | None:
    """Resident memory of ``pid`` (and its descendants with ``tree``), None when it is gone."""
    total, found = 0, False
    for p in _children(pid) if tree else [pid]:
        try:
            import psutil

            total += psutil.Process(p).memory_info().rss
            found = True
            continue
        except ImportError:
            pass
        except Exception:
            continue
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    found = True
                    break
        except OSError:
            continue
    return total if found else None

# -- sampling -------------------------------------------------------------------------------------
async def worker_status(address: str) -> dict[str, int] | None:
    try:
        async with grpc.aio.insecure_channel(address) as ch:
            s = await worker_pb2_grpc.WorkerControlStub(ch).GetStatus(wpb.GetStatusRequest(),
                                                                      timeout=10)
    except grpc.aio.AioRpcError:
        return None
    ld = s.load
    return {"free_blocks": ld.free_blocks, "num_blocks": ld.num_blocks, "running": ld.running,
            "waiting": ld.waiting, "waiting_for_kv": ld.waiting_for_kv}


async def sample(cluster: Cluster, t0: float, load: Load | None, phase: str) -> dict[str, Any]:
    procs = {p.name: p for p in cluster.procs}
    procs_rss = {name: rss_bytes(p.popen.pid) if p.alive() else None
                 for name, p in procs.items()}
    procs_rss["soak-client"] = rss_bytes(os.getpid(), tree=False)  # the cluster is its children
    workers = {w.name: await worker_status(f"127.0.0.1:{w.ready['port']}")
               for w in cluster.workers}
    return {"t_s": round(time.monotonic() - t0, 1), "phase": phase, "rss_bytes": procs_rss,
            "workers": workers,
            "requests": sum(load.outcomes.values()) if load else 0,
            "unexpected": sum(v for k, v in load.outcomes.items() if k.endswith(":unexpected"))
            if load else 0}


def format_row(s: dict[str, Any], names: list[str], wnames: list[str]) -> str:
    def mib(v: int | None) -> str:
        return f"{v / MiB:9.1f}" if v is not None else "     dead"

    rss = " ".join(mib(s["rss_bytes"].get(n)) for n in names)
    free = " ".join(f"{(s['workers'].get(w) or {}).get('free_blocks', -1):9d}" for w in wnames)
    return f"{s['t_s']:8.1f} {s['phase']:>6} {rss} {free} {s['requests']:9d} " \
           f"{s['unexpected']:6d}"


def format_header(names: list[str], wnames: list[str]) -> str:
    return (f"{'t_s':>8} {'phase':>6} " + " ".join(f"{n[:9]:>9}" for n in names) + " "
            + " ".join(f"{('free:' + w)[:9]:>9}" for w in wnames)
            + f" {'requests':>9} {'unexp':>6}\n"
            + f"{'':>8} {'':>6} " + " ".join(f"{'RSS MiB':>9}" for _ in names) + " "
            + " ".join(f"{'blocks':>9}" for _ in wnames))


# -- summary ---------------------------------------------------------------------------------------
def summarize(samples: list[dict[str, Any]], names: list[str], wnames: list[str],
              window_s: float) -> dict[str, Any]:
    """Per process its RSS (MiB) at the start, first under load, at the end, its max, growth and
    spread over the last ``window_s`` of load; per worker its free KV blocks."""
    summary: dict[str, Any] = {"rss_mib": {}, "free_blocks": {}, "flat_window_s": window_s}
    for n in names:
        vals = [s["rss_bytes"].get(n) for s in samples]
        seen = [v for v in vals if v is not None]
        under_load = [s["rss_bytes"].get(n) for s in samples if s["phase"] == "load"]
        under_load = [v for v in under_load if v is not None]
        summary["rss_mib"][n] = {
            "start": _mib(vals[0]), "first_under_load": _mib(under_load[0] if under_load
                                                               else None),
            "end": _mib(vals[-1]), "max": _mib(max(seen) if seen else None),
            "growth_end_vs_first_under_load": _mib(vals[-1] - under_load[0])
            if under_load and vals[-1] is not None else None,
            "last_window": flatness(samples, n, window_s)}
    for w in wnames:
        vals = [(s["workers"].get(w) or {}).get("free_blocks") for s in samples]
        seen = [v for v in vals if v is not None]
        summary["free_blocks"][w] = {
            "total": (samples[0]["workers"].get(w) or {}).get("num_blocks"),
            "start": vals[0], "end": vals[-1], "min": min(seen) if seen else None,
            "max": max(seen) if seen else None, "back_to_start": vals[0] == vals[-1]}
    return summary


def flatness(samples: list[dict[str, Any]], name: str, window_s: float) -> dict[str, Any] | None:
    """RSS of ``name`` over the load samples of the last ``window_s`` seconds of load: min, max
    and the half-spread around their midpoint, in percent (flat within +-5% means <= 5)."""
    load = [s for s in samples if s["phase"] == "load" and s["rss_bytes"].get(name)]
    if not load:
        return None
    t_end = load[-1]["t_s"]
    vals = [s["rss_bytes"][name] for s in load if s["t_s"] >= t_end - window_s]
    lo, hi = min(vals), max(vals)
    return {"samples": len(vals), "min": _mib(lo), "max": _mib(hi),
            "pct": round(100 * (hi - lo) / (hi + lo), 2)}


def _mib(v: int | None) -> float | None:
    return round(v / MiB, 1) if v is not None else None


def print_summary(doc: dict[str, Any]) -> None:
    s = doc["summary"]
    print(f"\n{doc['requests_total']} requests in {doc['duration_s']:.0f}s "
          f"({doc['requests_per_s']}/s), {doc['output_tokens']} tokens out")
    print("outcomes: " + ", ".join(f"{k}={v}" for k, v in doc["requests"].items()))
    print(f"\n{'process':<14} {'start':>9} {'1st load':>9} {'end':>9} {'max':>9} {'growth':>9}"
          f" {'flat +-%':>9}   (RSS MiB; growth = end - first sample under load; flat: "
          f"half-spread over the last {s['flat_window_s'] / 60:.0f} min of load)")
    for n, v in s["rss_mib"].items():
        flat = (v.get("last_window") or {}).get("pct")
        cells = [v["start"], v["first_under_load"], v["end"], v["max"],
                 v["growth_end_vs_first_under_load"], flat]
        print(f"{n:<14} " + " ".join(f"{c:9.1f}" if c is not None else f"{'-':>9}"
                                     for c in cells))
    print(f"\n{'worker':<14} {'total':>7} {'start':>7} {'end':>7} {'min':>7}  KV blocks free")
    for w, v in s["free_blocks"].items():
        print(f"{w:<14} {v['total']!s:>7} {v['start']!s:>7} {v['end']!s:>7} {v['min']!s:>7}  "
              + ("back to start" if v["back_to_start"] else "NOT back to start (leak?)"))
    if doc["processes_died"]:
        print("DIED: " + ", ".join(doc["processes_died"]))
    if doc["unexpected_examples"]:
        print("unexpected outcomes, first ones:\n  " + "\n  ".join(doc["unexpected_examples"]))
