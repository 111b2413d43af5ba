"""Routing-policy benchmark (issue 8): every ``--routing-policy`` on one cluster configuration.

One configuration, 2 prefill + 1 decode workers (1 thread each) and the router, on the demo model
(``--base``: the ~150M one). For each policy the whole cluster is started fresh (caches cold,
the same for every policy), then two workloads run in this order:

* ``multi_turn``: chat sessions sharing a system prompt; each turn sends the whole history (the
  system prompt, every user message, every reply exactly as generated) plus a new user message,
  after a think time. Sessions start as a Poisson process.
* ``mixed``: fresh prompts, 90 % short and 10 % long (``bench.serving.workloads``), Poisson
arrivals.

Requests go through the router's gRPC API (greedy, ``ignore_eos``): its replies carry the token
ids the next turn appends, and its trace says where each request ran. Measured per policy and
workload: TTFT (client side: send -> first token) p50/p99, TPOT p50/p99, end-to-end p50, the
prompt tokens the workers computed (the router's ``kvrelay:router_prompt_tokens_computed``
counters, both pools) against those routed, the share of requests the fast lane ran; then the
ratios to ``round_robin``. Prints a table and writes ``--out`` (JSON).

    .venv/bin/python -m bench.routing.policies                       # ~15 min on a quiet 2-core box
    .venv/bin/python -m bench.routing.policies --quick               # plumbing only

What is measured per request and how it is summarized and tabled is
``bench/routing/routing_results.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import re
import shlex
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.routing.routing_results import Result, brief, mean_runs, summarize, table
from bench.serving.serving_configs import kvrelay_cmd
from bench.serving.serving_procs import Deployment, Proc, free_port, wait_file, wait_registered
from bench.serving.workloads import make_requests, poisson_arrivals, read_vocab
from kvrelay.common.rpc import CHANNEL_OPTIONS
from kvrelay.proto import generate_pb2 as pb
from kvrelay.proto import generate_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]

logger = logging.getLogger("bench.routing.policies")

POLICIES = ("round_robin", "least_loaded", "prefix_aware", "auto")
WORKLOADS = ("multi_turn", "mixed")


@dataclass
class Settings:
    model_dir: str
    workdir: str
    policies: tuple[str, ...] = POLICIES
    workloads: tuple[str, ...] = WORKLOADS
    prefill: int = 2
    decode: int = 1
    kv_cache_mib: int = 256
    seed: int = 0
    # multi_turn
    sessions: int = 24
    turns: int = 6
    session_rate: float = 1.0  # sessions started per second (Poisson)
    system_tokens: int = 256
    user_tokens: tuple[int, int] = (64, 192)  # uniform range of a user message
    reply_tokens: int = 48
    think_s: float = 1.0  # mean think time between a reply and the next turn (exponential)
    # mixed
    mixed_requests: int = 60
    mixed_rate: float = 1.5
    worker_args: tuple[str, ...] = ()  # more flags for every worker (e.g. KV tiers)
    request_timeout_s: float = 180.0
    router_log_level: str = "INFO"
    startup_timeout_s: float = 300.0


# -- the cluster ---------------------------------------------------------------------------------
def start_cluster(st: Settings, policy: str) -> tuple[Deployment, dict[str, Any]]:
    work = Path(st.workdir) / policy
    work.mkdir(parents=True, exist_ok=True)
    for f in work.glob("*.ready"):
        f.unlink()
    dep = Deployment(f"routing-{policy}")
    env = {"NIXL_LOG_LEVEL": "WARN", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    http = free_port()
    dep.spawn(Proc("router", kvrelay_cmd(
        "router", "--model", st.model_dir, "--port", "0", "--control-port", "0",
        "--http-port", str(http), "--routing-policy", policy, "--log-level", st.router_log_level,
        "--ready-file", str(work / "router.ready")), env, work / "router.log"))
    ready = wait_file(work / "router.ready", dep, st.startup_timeout_s)
    control = f"127.0.0.1:{ready['control_port']}"
    engine = ["--model", st.model_dir, "--dtype", "float32", "--device", "cpu",
              "--kv-cache-memory", f"{st.kv_cache_mib}MiB", "--num-threads", "1",
              "--max-model-len", "4096", "--seed", str(st.seed), *st.worker_args]
    names = [f"prefill-{i + 1}" for i in range(st.prefill)] + \
        [f"decode-{i + 1}" for i in range(st.decode)]
    for name in names:
        dep.spawn(Proc(name, kvrelay_cmd(
            "worker", "--role", name.split("-")[0], "--router", control, "--worker-id", name,
            "--ready-file", str(work / f"{name}.ready"), *engine), env, work / f"{name}.log"))
    for name in names:
        wait_file(work / f"{name}.ready", dep, st.startup_timeout_s)
    # routable: listed by the router (`auto` lists a worker once it has measured it)
    wait_registered(control, len(names), dep, st.startup_timeout_s)
    return dep, {"grpc": f"127.0.0.1:{ready['port']}", "http": http, "control": control}


def scrape(http_port: int) -> dict[str, float]:
    """The router's routing counters, summed over workers, by metric and pool."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read()
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        m = re.match(r'^(kvrelay:router_[a-z_]+_total)\{.*pool="(\w+)".*\} (\S+)$', line)
        if m:
            key = f"{m.group(1)}:{m.group(2)}"
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


# -- requests ------------------------------------------------------------------------------------
async def generate(stub: generate_pb2_grpc.GenerationStub, prompt: list[int], max_tokens: int,
                   kind: str, t0: float, timeout_s: float) -> Result:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    sent = time.perf_counter()
    res = Result(kind, len(prompt), sent - t0)
    first: float | None = None
    try:
        async for msg in stub.Generate(req, timeout=timeout_s):
            if msg.token_ids and first is None:
                first = time.perf_counter()
            res.token_ids.extend(msg.token_ids)
            if msg.finish_reason:
                res.cached_tokens = msg.usage.cached_prompt_tokens
                names = [e.name for e in msg.trace]
                res.local = "local_start" in names and "prefill_start" not in names
                res.prefill_worker = next((e.worker for e in msg.trace
                                           if e.name == "prefill_end"), "")
    except grpc.aio.AioRpcError as e:
        res.error = f"{e.code().name}: {e.details()}"
        return res
    end = time.perf_counter()
    if first is None:
        res.error = "no tokens"
        return res
    res.ttft_ms = (first - sent) * 1e3
    res.e2e_ms = (end - sent) * 1e3
    if len(res.token_ids) > 1:
        res.tpot_ms = (res.e2e_ms - res.ttft_ms) / (len(res.token_ids) - 1)
    return res


async def run_multi_turn(address: str, st: Settings, usable: list[int],
                         tag: str) -> list[Result]:
    rng = random.Random(f"routing:{st.seed}:multi_turn:{tag}")
    system = rng.choices(usable, k=st.system_tokens)
    starts = poisson_arrivals(st.sessions, st.session_rate, st.seed, f"multi_turn:{tag}")
    plans = [[(rng.choices(usable, k=rng.randint(*st.user_tokens)), rng.expovariate(
        1.0 / st.think_s)) for _ in range(st.turns)] for _ in range(st.sessions)]
    results: list[Result] = []
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        t0 = time.perf_counter()

        async def session(k: int) -> None:
            await asyncio.sleep(max(0.0, starts[k] - (time.perf_counter() - t0)))
            history = list(system)
            for turn, (user, think) in enumerate(plans[k]):
                history += user
                r = await generate(stub, history, st.reply_tokens, f"turn{min(turn, 1)}", t0,
                                   st.request_timeout_s)
                results.append(r)
                if r.error:
                    return
                history += r.token_ids
                await asyncio.sleep(think)

        await asyncio.gather(*(session(k) for k in range(st.sessions)))
    return results


async def run_mixed(address: str, st: Settings, model_dir: str, tag: str) -> list[Result]:
    specs = make_requests("mixed", st.mixed_requests, read_vocab(model_dir), st.seed,
                          f"routing:{tag}")
    arrivals = poisson_arrivals(len(specs), st.mixed_rate, st.seed, f"routing-mixed:{tag}")
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        t0 = time.perf_counter()

        async def one(i: int) -> Result:
            await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t0)))
            s = specs[i]
            return await generate(stub, s.prompt_token_ids, s.max_tokens, s.kind, t0,
                                  st.request_timeout_s)

        return list(await asyncio.gather(*(one(i) for i in range(len(specs)))))


async def warm_up(address: str, usable: list[int]) -> None:
    """A few fresh requests, sequential: every process past its first-call costs."""
    rng = random.Random("routing-warmup")
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        for n in (16, 300, 40, 1200, 100):
            await generate(stub, rng.choices(usable, k=n), 4, "warmup", time.perf_counter(),
                           120.0)


# -- one policy ----------------------------------------------------------------------------------
def bench_policy(st: Settings, policy: str) -> dict[str, Any]:
    usable = read_vocab(st.model_dir).usable()
    t_start = time.monotonic()
    dep, addr = start_cluster(st, policy)
    out: dict[str, Any] = {"startup_s": time.monotonic() - t_start}
    try:
        asyncio.run(warm_up(addr["grpc"], usable))
        for wl in st.workloads:
            before = scrape(addr["http"])
            t0 = time.monotonic()
            if wl == "multi_turn":
                results = asyncio.run(run_multi_turn(addr["grpc"], st, usable, "run"))
            else:
                results = asyncio.run(run_mixed(addr["grpc"], st, st.model_dir, "run"))
            out[wl] = summarize(results, before, scrape(addr["http"]))
            out[wl]["duration_s"] = time.monotonic() - t0
            logger.info("%s %s: %s", policy, wl, brief(out[wl]))
    finally:
        dep.stop()
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None,
                    help="checkpoint (default: the demo model, made when missing)")
    ap.add_argument("--base", action="store_true", help="the ~150M demo model")
    ap.add_argument("--workdir", default=str(ROOT / ".bench-out" / "routing"))
    ap.add_argument("--out", default=None, help="JSON results (default WORKDIR/results.json)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--sessions", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--session-rate", type=float, default=None)
    ap.add_argument("--mixed-requests", type=int, default=None)
    ap.add_argument("--mixed-rate", type=float, default=None)
    ap.add_argument("--kv-cache-mib", type=int, default=None)
    ap.add_argument("--worker-args", default="",
                    help="more flags for every worker, one string (e.g. \"--kv-offload-memory "
                         "1GiB\": routing by KV tier)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every policy this many times, alternating the order (forward, "
                         "reverse, ...) so drift in the machine's load hits them alike; the "
                         "table shows the mean over repeats")
    ap.add_argument("--quick", action="store_true", help="a few requests: plumbing only")
    ap.add_argument("--router-log-level", default="INFO")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    a = build_parser().parse_args(argv)
    size = "base" if a.base else "tiny"
    model_dir = a.model_dir or str(ROOT / ".bench-out" / "models" / size)
    if not Path(model_dir, "config.json").exists():
        from kvrelay.engine.demo_model import write_demo_model

        write_demo_model(model_dir, size=size, seed=0)
    st = Settings(model_dir=model_dir, workdir=a.workdir,
                  policies=tuple(p for p in a.policies.split(",") if p),
                  workloads=tuple(w for w in a.workloads.split(",") if w),
                  worker_args=tuple(shlex.split(a.worker_args)))
    if a.quick:
        st.sessions, st.turns, st.mixed_requests = 4, 2, 8
    for k in ("sessions", "turns", "session_rate", "mixed_requests", "mixed_rate",
              "kv_cache_mib", "router_log_level"):
        if getattr(a, k) is not None:
            setattr(st, k, getattr(a, k))
    bad = [p for p in st.policies if p not in POLICIES] + \
        [w for w in st.workloads if w not in WORKLOADS]
    if bad:
        raise SystemExit(f"unknown policy or workload: {bad}")
    doc: dict[str, Any] = {"settings": asdict(st), "policies": {}}
    out = Path(a.out or Path(st.workdir) / "results.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in st.policies}
    for rep in range(max(1, a.repeat)):
        order = st.policies if rep % 2 == 0 else tuple(reversed(st.policies))
        for policy in order:
            runs[policy].append(bench_policy(st, policy))
            doc["runs"] = runs
            out.write_text(json.dumps(doc, indent=1))
    doc["policies"] = {p: mean_runs(rs) for p, rs in runs.items()}
    out.write_text(json.dumps(doc, indent=1))
    print(table(doc))
    if a.repeat > 1:
        for wl in st.workloads:
            print(f"\n{wl}, each run (TTFT p50 / p99 ms):")
            for p, rs in runs.items():
                print(f"  {p}: " + ", ".join(f"{r[wl]['ttft_ms']['p50']:.0f} / "
                                             f"{r[wl]['ttft_ms']['p99']:.0f}" for r in rs))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
