"""Soak test: a 1P1D cluster under a steady mixed load for a while, watching memory and KV blocks.

Starts a router (gRPC + OpenAI HTTP), one prefill and one decode worker (``kvrelay`` processes
on loopback), then keeps ``--concurrency`` clients busy with a mix of requests for ``--minutes``:
gRPC streams, HTTP completions (streamed and not), chat, prompts of a few to a thousand tokens,
prompts sharing a long prefix (prefix cache), streams the client cancels part way, requests that
hit their deadline, and malformed requests the router must refuse. Every ``--interval`` seconds
it samples the RSS of every process (psutil when installed, else /proc) and every worker's KV
blocks (WorkerControl.GetStatus), printing a table row. At the end it lets the cluster go idle,
takes a last sample, prints start / end / max per process and writes everything to ``--out``.

    .venv/bin/python bench/soak.py --minutes 10 --out bench/results/soak.json

Exit status 1 if a process died or a worker's free KV blocks did not come back to their idle
value (a leak); 0 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

from kvrelay.proto import generate_pb2 as pb
from kvrelay.proto import generate_pb2_grpc, worker_pb2_grpc
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.rpc import CHANNEL_OPTIONS

ROOT = Path(__file__).resolve().parents[1]
SERVED = "demo"
MiB = 2**20


# -- processes ------------------------------------------------------------------------------------
@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    ready_file: Path
    ready: dict[str, Any] = field(default_factory=dict)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


class SoakCluster:
    """Router + prefill + decode worker as ``python -m kvrelay.cli`` processes."""

    def __init__(self, model_dir: str, workdir: Path, worker_args: list[str]):
        self.model_dir = model_dir
        self.workdir = workdir
        self.worker_args = worker_args
        self.env = {**os.environ, "NIXL_LOG_LEVEL": "WARN", "PYTHONUNBUFFERED": "1",
                    "OMP_NUM_THREADS": "1"}
        self.procs: list[Proc] = []

    def _spawn(self, name: str, args: list[str]) -> Proc:
        log, ready = self.workdir / f"{name}.log", self.workdir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        with open(log, "wb") as f:
            popen = subprocess.Popen(
                [sys.executable, "-m", "kvrelay.cli", *args, "--ready-file", str(ready)],
                stdout=f, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                cwd=str(ROOT))
        p = Proc(name, popen, log, ready)
        self.procs.append(p)
        return p

    def _wait_ready(self, p: Proc, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not p.ready_file.exists():
            if not p.alive():
                raise RuntimeError(f"{p.name} exited ({p.popen.returncode}):\n{p.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{p.name} not ready after {timeout:.0f}s:\n{p.tail()}")
            time.sleep(0.1)
        p.ready = json.loads(p.ready_file.read_text())

    def start(self) -> None:
        self.router = self._spawn("router", [
            "router", "--model", self.model_dir, "--served-model-name", SERVED, "--port", "0",
            "--control-port", "0", "--http-port", "0"])
        self._wait_ready(self.router)
        control = f"127.0.0.1:{self.router.ready['control_port']}"
        self.workers = [self._spawn(f"{role}-1", [
            "worker", "--role", role, "--router", control, "--worker-id", f"{role}-1",
            "--model", self.model_dir, *self.worker_args]) for role in ("prefill", "decode")]
        for w in self.workers:
            self._wait_ready(w)
        deadline = time.monotonic() + 60
        while True:  # both registered: the router answers /health
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.http_url + "/health", timeout=5).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("the router never saw both workers")
            time.sleep(0.2)

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.router.ready['port']}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.router.ready['http_port']}"

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.popen.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait(10)


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


# -- load -----------------------------------------------------------------------------------------
KINDS = {  # kind: weight
    "grpc_stream": 4, "grpc_prefix": 2, "grpc_cancel": 1, "grpc_deadline": 1,
    "http_stream": 3, "http_plain": 2, "http_chat": 2, "http_invalid": 1, "grpc_invalid": 1,
}


class Load:
    def __init__(self, cluster: SoakCluster, concurrency: int, seed: int, vocab: int):
        self.cluster = cluster
        self.concurrency = concurrency
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.outcomes: Counter[str] = Counter()
        self.tokens_out = 0
        self.unexpected: list[str] = []
        self.shared_prefix = [self.rng.randrange(10, vocab) for _ in range(512)]
        self._stop = asyncio.Event()

    def _ids(self, rng: random.Random) -> list[int]:
        n = rng.choice([8, 32, 128, 256, 512, 1024])
        return [rng.randrange(10, self.vocab) for _ in range(n)]

    def _note(self, kind: str, ok: bool, what: str = "") -> None:
        self.outcomes[f"{kind}:{'ok' if ok else 'unexpected'}"] += 1
        if not ok and len(self.unexpected) < 50:
            self.unexpected.append(f"{kind}: {what}"[:300])

    async def run(self, seconds: float) -> None:
        async with httpx.AsyncClient(base_url=self.cluster.http_url, timeout=120) as http, \
                grpc.aio.insecure_channel(self.cluster.grpc_address,
                                          options=CHANNEL_OPTIONS) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            until = time.monotonic() + seconds
            await asyncio.gather(*(self._client(k, stub, http, until)
                                   for k in range(self.concurrency)))

    async def _client(self, k: int, stub: Any, http: httpx.AsyncClient, until: float) -> None:
        rng = random.Random(self.rng.random())
        kinds, weights = zip(*KINDS.items(), strict=True)
        while time.monotonic() < until:
            kind = rng.choices(kinds, weights)[0]
            try:
                await getattr(self, "_" + kind)(rng, stub, http)
            except Exception as e:  # counted, never fatal: the soak goes on
                self._note(kind, False, f"{type(e).__name__}: {e}")

    # gRPC
    async def _grpc(self, stub: Any, ids: list[int], max_tokens: int, **kw: Any) -> int:
        req = pb.GenerateRequest(sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True), **kw)
        req.token_ids.ids.extend(ids)
        n = 0
        async for msg in stub.Generate(req, timeout=120):
            n += len(msg.token_ids)
        return n

    async def _grpc_stream(self, rng, stub, http) -> None:
        n = rng.randint(8, 64)
        got = await self._grpc(stub, self._ids(rng), n)
        self.tokens_out += got
        self._note("grpc_stream", got == n, f"{got} of {n} tokens")

    async def _grpc_prefix(self, rng, stub, http) -> None:
        ids = self.shared_prefix + [rng.randrange(10, self.vocab) for _ in range(rng.randint(1,
                                                                                          64))]
        got = await self._grpc(stub, ids, 16)
        self.tokens_out += got
        self._note("grpc_prefix", got == 16, f"{got} of 16 tokens")

    async def _grpc_cancel(self, rng, stub, http) -> None:
        req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=200, temperature=0.0,
                                                            ignore_eos=True))
        req.token_ids.ids.extend(self._ids(rng))
        call = stub.Generate(req, timeout=120)
        stop_after = rng.randint(0, 5)  # 0: before the first token (mid-prefill)
        if stop_after == 0:
            await asyncio.sleep(rng.uniform(0.0, 0.2))
            call.cancel()
        else:
            seen = 0
            async for _ in call:
                seen += 1
                if seen >= stop_after:
                    call.cancel()
                    break
        self._note("grpc_cancel", True)

    async def _grpc_deadline(self, rng, stub, http) -> None:
        try:
            await self._grpc(stub, self._ids(rng), 2000, timeout_ms=rng.randint(50, 500))
            self._note("grpc_deadline", False, "finished 2000 tokens within its deadline")
        except grpc.aio.AioRpcError as e:
            self._note("grpc_deadline", e.code() == grpc.StatusCode.DEADLINE_EXCEEDED,
                       f"{e.code().name} {e.details()}")

    async def _grpc_invalid(self, rng, stub, http) -> None:
        req = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(
            max_tokens=4, temperature=rng.choice([-1.0, 1000.0])))
        try:
            async for _ in stub.Generate(req, timeout=30):
                pass
            self._note("grpc_invalid", False, "served")
        except grpc.aio.AioRpcError as e:
            self._note("grpc_invalid", e.code() == grpc.StatusCode.INVALID_ARGUMENT,
                       f"{e.code().name} {e.details()}")

    # HTTP
    async def _http_stream(self, rng, stub, http) -> None:
        n = rng.randint(8, 64)
        body = {"model": SERVED, "prompt": self._ids(rng), "max_tokens": n, "stream": True,
                "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        got, done = None, False
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                self._note("http_stream", False, f"HTTP {r.status_code}")
                return
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    doc = json.loads(line[6:])
                    if doc.get("usage"):
                        got = doc["usage"]["completion_tokens"]
        self.tokens_out += got or 0
        self._note("http_stream", done and got == n, f"done={done} {got} of {n} tokens")

    async def _http_plain(self, rng, stub, http) -> None:
        n = rng.randint(4, 32)
        r = await http.post("/v1/completions", json={
            "model": SERVED, "prompt": self._ids(rng), "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stop": ["zzzz"]})
        got = r.json().get("usage", {}).get("completion_tokens") if r.status_code == 200 else 0
        self.tokens_out += got or 0
        self._note("http_plain", got == n, f"HTTP {r.status_code} {r.text[:100]}")

    async def _http_chat(self, rng, stub, http) -> None:
        msgs = [{"role": "system", "content": "You are brief."},
                {"role": "user", "content": f"Tell me about the number {rng.randint(0, 999)}."}]
        r = await http.post("/v1/chat/completions", json={
            "model": SERVED, "messages": msgs, "max_tokens": rng.randint(4, 32),
            "temperature": rng.choice([0, 0.7]), "seed": rng.randint(0, 100)})
        ok = r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
        if ok:
            self.tokens_out += r.json()["usage"]["completion_tokens"]
        self._note("http_chat", ok, f"HTTP {r.status_code} {r.text[:100]}")

    async def _http_invalid(self, rng, stub, http) -> None:
        body = rng.choice([{"model": SERVED, "prompt": "", "max_tokens": 4},
                           {"model": SERVED, "prompt": [999999], "max_tokens": 4},
                           {"model": SERVED, "prompt": "x", "max_tokens": 0}])
        r = await http.post("/v1/completions", json=body)
        self._note("http_invalid", r.status_code == 400, f"HTTP {r.status_code}")


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


async def sample(cluster: SoakCluster, t0: float, load: Load | None, phase: str) -> dict[str, Any]:
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


def _row(s: dict[str, Any], names: list[str], wnames: list[str]) -> str:
    def mib(v: int | None) -> str:
        return f"{v / MiB:9.1f}" if v is not None else "     dead"

    rss = " ".join(mib(s["rss_bytes"].get(n)) for n in names)
    free = " ".join(f"{(s['workers'].get(w) or {}).get('free_blocks', -1):9d}" for w in wnames)
    return f"{s['t_s']:8.1f} {s['phase']:>6} {rss} {free} {s['requests']:9d} " \
           f"{s['unexpected']:6d}"


def _header(names: list[str], wnames: list[str]) -> str:
    return (f"{'t_s':>8} {'phase':>6} " + " ".join(f"{n[:9]:>9}" for n in names) + " "
            + " ".join(f"{('free:' + w)[:9]:>9}" for w in wnames)
            + f" {'requests':>9} {'unexp':>6}\n"
            + f"{'':>8} {'':>6} " + " ".join(f"{'RSS MiB':>9}" for _ in names) + " "
            + " ".join(f"{'blocks':>9}" for _ in wnames))


async def soak(args: argparse.Namespace, cluster: SoakCluster) -> dict[str, Any]:
    config = json.loads(Path(args.model_dir, "config.json").read_text())
    vocab = min(int(config["vocab_size"]), 4000)  # the tokenizer's ids, specials aside
    names = [p.name for p in cluster.procs] + ["soak-client"]
    wnames = [w.name for w in cluster.workers]
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()

    def record(s: dict[str, Any]) -> None:
        samples.append(s)
        print(_row(s, names, wnames), flush=True)

    print(_header(names, wnames), flush=True)
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
    cluster = SoakCluster(args.model_dir, workdir, [
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
