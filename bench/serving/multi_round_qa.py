"""Multi-round QA with a working set several times one worker's KV pool: what the KV tiers
(issue 52) buy, aggregated and disaggregated, on the ~150M demo model in bf16.

The shape is LMCache's multi-round QA benchmark: every user shares one system prompt (~1000
tokens), has a history of their own (~2000 tokens), and asks ``--rounds`` questions (~50 tokens
each) whose answers (~100 tokens, greedy) join the history the next question is appended to.
Users start ``--stagger`` seconds apart and think ``--think`` seconds between rounds, so their
contexts interleave in the pool. The pool (``--pool-tokens``) is sized so that the users' KV
(system prompt + every history, growing) is at least ``--working-set-ratio`` times it: without
tiers a user's next round finds its history evicted and recomputes it; with them it comes back
from the host tier.

Configurations, each a fresh cluster (caches cold alike), run in the order given and then again
reversed (``--repeat 2``: drift in the shared machine's speed hits them alike):

* ``agg``: one worker of role both (2 threads); ``agg+tiers``: the same with
  ``--kv-offload-memory``;
* ``1p1d``: a prefill and a decode worker (1 thread each); ``1p1d+tiers``: both with tiers (the
  decode worker's reservations then reuse its own tier: "decode-side reuse");
  ``1p1d+tiers+pull``: and the router's ``--prefix-pull auto``: the prefill worker reads the
  history the decode worker generated (P←D) instead of recomputing it; ``1p1d+ptiers``: tiers
  on the prefill worker only, so that against ``1p1d+tiers`` the one difference is the decode
  worker's reuse of its own tier (what that costs its ITL, under the same prefill-side load).

A second workload, ``long_doc_qa`` (LMCache's long-document QA shape), asks ``--doc-rounds``
rounds of questions about ``--docs`` documents of ``--doc-tokens`` tokens each, ``doc_concurrency``
at a time, every round going through the documents in the same order: the documents together are
at least ``--working-set-ratio`` times the pool, so without tiers each round finds the documents
of the last one evicted (LRU, cyclic access: a pool-sized cache hits nothing) and recomputes
them; with tiers they load. A third, ``no_reuse`` (fresh prompts only, the sizes of the first),
measures what the tiers cost where they cannot help (every block stored, none loaded).

Per configuration and workload: TTFT p50/p99, ITL p50/p99 (client side, gaps between streamed
messages), output tokens/s over the run, prompt tokens computed against sent (from each
reply's cached-token count). Prints a table with the ratios of each ``+tiers`` configuration to
its base and writes ``--out`` (JSON).

    .venv/bin/python -m bench.serving.multi_round_qa            # ~25 min on a quiet 2-core box
    .venv/bin/python -m bench.serving.multi_round_qa --quick    # plumbing only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench.serving.metrics import percentile
from bench.serving.serving_configs import kvrelay_cmd
from bench.serving.serving_procs import Deployment, Proc, wait_file, wait_registered
from bench.serving.workloads import read_vocab
from kvrelay.common.rpc import CHANNEL_OPTIONS
from kvrelay.proto import generate_pb2 as pb
from kvrelay.proto import generate_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
logger = logging.getLogger("bench.serving.multi_round_qa")

CONFIGS = ("agg", "agg+tiers", "1p1d", "1p1d+ptiers", "1p1d+tiers", "1p1d+tiers+pull")
BLOCK = 16


@dataclass
class Settings:
    model_dir: str
    workdir: str
    configs: tuple[str, ...] = CONFIGS
    users: int = 8
    rounds: int = 3
    system_tokens: int = 1000
    history_tokens: int = 2000
    question_tokens: int = 50
    answer_tokens: int = 100
    stagger_s: float = 6.0
    think_s: float = 1.0
    working_set_ratio: float = 4.0
    pool_tokens: int = 0  # 0: the working set / working_set_ratio
    offload_memory: str = "1GiB"
    no_reuse_requests: int = 12
    no_reuse_stagger_s: float = 6.0  # below saturation, this measures overhead, not queueing
    docs: int = 6
    doc_tokens: int = 4000
    doc_rounds: int = 2
    doc_question_tokens: int = 30
    doc_answer_tokens: int = 32
    doc_concurrency: int = 2
    seed: int = 0
    request_timeout_s: float = 900.0
    startup_timeout_s: float = 300.0

    def working_set(self) -> int:
        per_user = self.history_tokens + self.rounds * (self.question_tokens + self.answer_tokens)
        return self.system_tokens + self.users * per_user

    def decode_pool(self) -> int:
        """Blocks for every user's longest context at once, plus a quarter."""
        longest = self.working_set() - self.system_tokens  # all users' own tokens
        return (self.users * self.system_tokens + longest) * 5 // 4 // BLOCK + 1

    def pool(self) -> int:
        tokens = self.pool_tokens or int(self.working_set() / self.working_set_ratio)
        return max(tokens // BLOCK, (self.working_set() // self.users + 256) // BLOCK + 1)


@dataclass
class Reply:
    kind: str
    prompt_tokens: int
    ttft_ms: float | None = None
    gaps_ms: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None


# -- the cluster ---------------------------------------------------------------------------------
def start_cluster(st: Settings, config: str, tag: str) -> tuple[Deployment, str]:
    work = Path(st.workdir) / tag
    work.mkdir(parents=True, exist_ok=True)
    for f in work.glob("*.ready"):
        f.unlink()
    dep = Deployment(f"mrqa-{tag}")
    env = {"NIXL_LOG_LEVEL": "WARN", "PYTHONUNBUFFERED": "1"}
    pull = ["--prefix-pull", "auto"] if config.endswith("+pull") else []
    dep.spawn(Proc("router", kvrelay_cmd(
        "router", "--model", st.model_dir, "--port", "0", "--control-port", "0",
        "--ready-file", str(work / "router.ready"), *pull), env, work / "router.log"))
    ready = wait_file(work / "router.ready", dep, st.startup_timeout_s)
    control = f"127.0.0.1:{ready['control_port']}"
    disagg = config.startswith("1p1d")
    engine = ["--model", st.model_dir, "--device", "cpu",
              "--block-size", str(BLOCK), "--max-model-len", "8192", "--seed", str(st.seed),
              "--num-threads", "1" if disagg else "2"]
    roles = ["prefill", "decode"] if disagg else ["both"]
    for role in roles:
        tiers = "+tiers" in config or ("+ptiers" in config and role == "prefill")
        offload = ["--kv-offload-memory", st.offload_memory] if tiers else []
        # The pool under test is the one that computes (agg: the worker; 1P1D: the prefill
        # worker). A decode worker must hold every running request's whole context (it cannot
        # preempt and recompute), so it is sized for all users at once, as a deployment sizes
        # its decode pool for its concurrency.
        blocks = st.decode_pool() if role == "decode" else st.pool()
        dep.spawn(Proc(role, kvrelay_cmd(
            "worker", "--role", role, "--router", control, "--worker-id", role,
            "--ready-file", str(work / f"{role}.ready"), *engine, *offload,
            "--num-kv-blocks", str(blocks)),
            {**env, "OMP_NUM_THREADS": "1" if disagg else "2"}, work / f"{role}.log"))
    for role in roles:
        wait_file(work / f"{role}.ready", dep, st.startup_timeout_s)
    wait_registered(control, len(roles), dep, st.startup_timeout_s)
    return dep, f"127.0.0.1:{ready['port']}"


# -- requests ------------------------------------------------------------------------------------
async def ask(stub: generate_pb2_grpc.GenerationStub, prompt: list[int], max_tokens: int,
              kind: str, timeout_s: float) -> Reply:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    r = Reply(kind, len(prompt))
    sent = last = time.perf_counter()
    try:
        async for msg in stub.Generate(req, timeout=timeout_s):
            now = time.perf_counter()
            if msg.token_ids:
                if r.ttft_ms is None:
                    r.ttft_ms = (now - sent) * 1e3
                else:
                    r.gaps_ms.append((now - last) * 1e3)
                last = now
                r.token_ids.extend(msg.token_ids)
            if msg.finish_reason:
                r.cached_tokens = msg.usage.cached_prompt_tokens
    except grpc.aio.AioRpcError as e:
        r.error = f"{e.code().name}: {e.details()}"
    return r


async def multi_round_qa(address: str, st: Settings, usable: list[int]) -> list[Reply]:
    rng = random.Random(f"mrqa:{st.seed}")
    system = rng.choices(usable, k=st.system_tokens)
    histories = [rng.choices(usable, k=st.history_tokens) for _ in range(st.users)]
    questions = [[rng.choices(usable, k=st.question_tokens) for _ in range(st.rounds)]
                 for _ in range(st.users)]
    replies: list[Reply] = []
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)

        async def user(u: int) -> None:
            await asyncio.sleep(u * st.stagger_s)
            context = system + histories[u]
            for k in range(st.rounds):
                context = context + questions[u][k]
                r = await ask(stub, context, st.answer_tokens, f"round{min(k, 1)}",
                              st.request_timeout_s)
                replies.append(r)
                if r.error:
                    return
                context = context + r.token_ids
                await asyncio.sleep(st.think_s)

        await asyncio.gather(*(user(u) for u in range(st.users)))
    return replies


async def long_doc_qa(address: str, st: Settings, usable: list[int]) -> list[Reply]:
    rng = random.Random(f"ldqa:{st.seed}")
    docs = [rng.choices(usable, k=st.doc_tokens) for _ in range(st.docs)]
    asks = [(d, rng.choices(usable, k=st.doc_question_tokens), k)
            for k in range(st.doc_rounds) for d in range(st.docs)]
    replies: list[Reply] = []
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        queue = iter(asks)

        async def reader() -> None:
            for d, question, k in queue:  # the readers share one iterator: in order, N at once
                r = await ask(stub, docs[d] + question, st.doc_answer_tokens,
                              f"round{min(k, 1)}", st.request_timeout_s)
                replies.append(r)

        await asyncio.gather(*(reader() for _ in range(st.doc_concurrency)))
    return replies


async def no_reuse(address: str, st: Settings, usable: list[int]) -> list[Reply]:
    rng = random.Random(f"mrqa-fresh:{st.seed}")
    n = st.system_tokens + st.history_tokens
    prompts = [rng.choices(usable, k=n) for _ in range(st.no_reuse_requests)]
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)

        async def one(i: int) -> Reply:
            await asyncio.sleep(i * st.no_reuse_stagger_s)
            return await ask(stub, prompts[i], st.answer_tokens, "fresh", st.request_timeout_s)

        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


async def warm_up(address: str, usable: list[int]) -> None:
    rng = random.Random("mrqa-warmup")
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        for n in (16, 600, 40):
            await ask(stub, rng.choices(usable, k=n), 4, "warmup", 300.0)


def summarize(replies: Sequence[Reply], duration_s: float) -> dict[str, Any]:
    ok = [r for r in replies if r.error is None and r.ttft_ms is not None]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    gaps = [g for r in ok for g in r.gaps_ms]
    later = [r.ttft_ms for r in ok if r.kind == "round1" and r.ttft_ms is not None]
    return {
        "requests": len(replies), "failed": len(replies) - len(ok),
        "errors": sorted({r.error for r in replies if r.error})[:3],
        "duration_s": duration_s,
        "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "ttft_later_rounds_ms": {"p50": percentile(later, 50), "p99": percentile(later, 99)},
        "itl_ms": {"p50": percentile(gaps, 50), "p99": percentile(gaps, 99)},
        "output_tok_s": sum(len(r.token_ids) for r in ok) / duration_s,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "prompt_tokens_computed": sum(r.prompt_tokens - r.cached_tokens for r in ok),
    }


WORKLOADS = ("multi_round_qa", "long_doc_qa", "no_reuse")


def bench_config(st: Settings, config: str, tag: str,
                 workloads: Sequence[str] = WORKLOADS) -> dict[str, Any]:
    usable = read_vocab(st.model_dir).usable()
    dep, address = start_cluster(st, config, tag)
    out: dict[str, Any] = {}
    try:
        asyncio.run(warm_up(address, usable))
        runs = {"multi_round_qa": multi_round_qa, "long_doc_qa": long_doc_qa,
                "no_reuse": no_reuse}
        for name in workloads:
            run = runs[name]
            t0 = time.perf_counter()
            replies = asyncio.run(run(address, st, usable))
            out[name] = summarize(replies, time.perf_counter() - t0)
            s = out[name]
            logger.info("%s %s: TTFT p50 %.0f ms p99 %.0f ms, ITL p99 %.1f ms, %.1f tok/s, "
                        "computed %d/%d, failed %d", config, name, s["ttft_ms"]["p50"] or -1,
                        s["ttft_ms"]["p99"] or -1, s["itl_ms"]["p99"] or -1, s["output_tok_s"],
                        s["prompt_tokens_computed"], s["prompt_tokens"], s["failed"])
    finally:
        dep.stop()
    return out


def mean(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def avg(xs: list[Any]) -> Any:
        if isinstance(xs[0], dict):
            return {k: avg([x[k] for x in xs]) for k in xs[0]}
        nums = [x for x in xs if isinstance(x, (int, float)) and x is not None]
        return sum(nums) / len(nums) if len(nums) == len(xs) else xs[0]
    return avg(runs)


def table(doc: dict[str, Any]) -> str:
    rows = [("TTFT p50 (ms)", ("ttft_ms", "p50")), ("TTFT p99 (ms)", ("ttft_ms", "p99")),
            ("TTFT p50, rounds 2+ (ms)", ("ttft_later_rounds_ms", "p50")),
            ("ITL p50 (ms)", ("itl_ms", "p50")), ("ITL p99 (ms)", ("itl_ms", "p99")),
            ("output tok/s", ("output_tok_s",)), ("duration (s)", ("duration_s",)),
            ("prompt tokens computed", ("prompt_tokens_computed",)),
            ("prompt tokens sent", ("prompt_tokens",)), ("failed", ("failed",))]
    res = doc["configs"]
    lines = []
    for wl in WORKLOADS:
        names = [c for c in res if wl in res[c]]
        if not names:
            continue
        pairs = [(c, c.split("+")[0]) for c in names if "+" in c and c.split("+")[0] in res]
        if "1p1d+tiers" in names and "1p1d+ptiers" in names:  # decode-side reuse alone
            pairs.append(("1p1d+tiers", "1p1d+ptiers"))
        head = names + [f"{a} ÷ {b}" for a, b in pairs]
        lines += [f"\n### {wl}\n", "| metric | " + " | ".join(head) + " |",
                  "|---" * (len(head) + 1) + "|"]
        for label, path in rows:
            def get(c: str, path: tuple[str, ...] = path, wl: str = wl) -> float | None:
                v: Any = res[c][wl]
                for k in path:
                    v = v.get(k) if isinstance(v, dict) else None
                return v
            cells = [f"{get(c):.4g}" if get(c) is not None else "-" for c in names]
            for a, b in pairs:
                va, vb = get(a), get(b)
                cells.append(f"{va / vb:.3g}" if va is not None and vb else "-")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="checkpoint (default: the ~150M demo)")
    ap.add_argument("--workdir", default=str(ROOT / ".bench-out" / "multi_round_qa"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--users", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--no-reuse-stagger", type=float, default=None,
                    help="seconds between the no_reuse workload's requests")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: plumbing only")
    a = ap.parse_args(argv)
    model_dir = a.model_dir or str(ROOT / ".bench-out" / "models" / "base-bf16")
    if not Path(model_dir, "config.json").exists():
        from kvrelay.engine.demo_model import write_demo_model

        write_demo_model(model_dir, size="base", seed=0)
    st = Settings(model_dir=model_dir, workdir=a.workdir,
                  configs=tuple(c for c in a.configs.split(",") if c))
    if a.quick:
        st.users, st.rounds, st.system_tokens, st.history_tokens = 2, 2, 64, 128
        st.answer_tokens, st.stagger_s, st.think_s, st.no_reuse_requests = 8, 0.2, 0.1, 2
        st.no_reuse_stagger_s = 0.2
        st.docs, st.doc_tokens, st.doc_answer_tokens = 3, 200, 4
    for k in ("users", "rounds"):
        if getattr(a, k) is not None:
            setattr(st, k, getattr(a, k))
    if a.no_reuse_stagger is not None:
        st.no_reuse_stagger_s = a.no_reuse_stagger
    workloads = tuple(w for w in a.workloads.split(",") if w)
    bad = [c for c in st.configs if c not in CONFIGS] + [w for w in workloads
                                                          if w not in WORKLOADS]
    if bad:
        raise SystemExit(f"unknown configuration or workload: {bad}")
    logger.info("working set %d tokens, pool %d blocks (%d tokens): %.1fx; documents %d tokens: "
                "%.1fx", st.working_set(), st.pool(), st.pool() * BLOCK,
                st.working_set() / (st.pool() * BLOCK), st.docs * st.doc_tokens,
                st.docs * st.doc_tokens / (st.pool() * BLOCK))
    out = Path(a.out or Path(st.workdir) / "results.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in st.configs}
    doc: dict[str, Any] = {"settings": asdict(st), "pool_blocks": st.pool()}
    for rep in range(max(1, a.repeat)):
        order = st.configs if rep % 2 == 0 else tuple(reversed(st.configs))
        for config in order:
            runs[config].append(bench_config(st, config, f"{config}-{rep}",
                                             workloads))
            doc["runs"] = runs
            out.write_text(json.dumps(doc, indent=1))
    doc["configs"] = {c: mean(rs) for c, rs in runs.items()}
    out.write_text(json.dumps(doc, indent=1))
    print(table(doc))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
