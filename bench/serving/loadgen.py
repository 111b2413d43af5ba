"""Load generator for OpenAI-compatible ``/v1/completions`` servers (kvrelay, vLLM).

asyncio + aiohttp streaming. Every request sends token-id prompts with ``stream: true``,
``stream_options.include_usage``, ``ignore_eos: true``, a fixed ``max_tokens`` and temperature
0, at Poisson arrival times (or all at once for saturation). Per request it records the send
time, every SSE chunk that carries tokens (time-stamped), TTFT, inter-token gaps, TPOT =
(e2e - TTFT) / (n - 1), e2e, output tokens and any error; per run p50/p90/p99 of each,
request and output-token throughput, SLO attainment and the ITL timeline (gap end times) used to
look at decode stalls around long prompts' arrivals.

``goodput_search`` finds the highest Poisson rate at which at least 90 % of requests meet both
TTFT <= X ms and TPOT <= Y ms (bisection over a range, or a sweep of given rates).

Everything is bounded: each request has a timeout, and a run has a deadline after which the
requests still open are cancelled and counted as failed.

The parts: ``bench.serving.sse_client`` sends the requests and reads their SSE streams,
``bench.serving.metrics`` holds the records and their statistics, ``bench.serving.goodput`` the
search; this module plans and documents runs, and is the CLI.

CLI (one run, or a goodput search)::

    python -m bench.serving.loadgen --base-url http://127.0.0.1:8000 --model-dir \\
        .bench-out/models/tiny \\
        --workload uniform --num-requests 200 --rate inf --out sat.json
    python -m bench.serving.loadgen --base-url ... --model-dir ... --goodput --rate-range 0.5:32 \\
        --goodput-iters 5 --num-requests 100 --out goodput.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The parts, re-exported here where the harness and its tests have always found them.
from bench.serving.goodput import GOODPUT_THRESHOLD as GOODPUT_THRESHOLD
from bench.serving.goodput import goodput_search
from bench.serving.metrics import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS, itl_timeline
from bench.serving.metrics import RequestResult as RequestResult
from bench.serving.metrics import RunResult as RunResult
from bench.serving.metrics import distribution as distribution
from bench.serving.metrics import percentile as percentile
from bench.serving.metrics import summarize as summarize
from bench.serving.sse_client import SSEParser as SSEParser
from bench.serving.sse_client import chunk_tokens as chunk_tokens
from bench.serving.sse_client import completion_body as completion_body
from bench.serving.sse_client import fetch_model_name, run_requests
from bench.serving.workloads import WORKLOADS, Vocab, make_requests, poisson_arrivals, read_vocab

SCHEMA = "kvrelay-bench/run/v1"


# -- high-level entry points (also used by bench/serving/run_serving.py) ---------------------------
@dataclass
class RunPlan:
    """What one measured run sends."""

    workload: str
    num_requests: int
    rate: float  # req/s; inf = all at once
    seed: int = 0
    tag: str = ""
    timeout_s: float = 120.0
    run_timeout_s: float | None = None
    slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS
    slo_tpot_ms: float = DEFAULT_SLO_TPOT_MS

    def label(self) -> str:
        rate = "sat" if math.isinf(self.rate) or self.rate <= 0 else f"{self.rate:g}rps"
        return f"{self.workload}@{rate}"


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) or rate <= 0 else rate


async def benchmark_run(base_url: str, model: str, vocab: Vocab, plan: RunPlan, *,
                        api_key: str | None = None, extra_body: dict[str, Any] | None = None,
                        keep_requests: bool = True) -> dict[str, Any]:
    """One run as a JSON-able document: meta, summary, per-request records, ITL timeline."""
    tag = plan.tag or plan.label()
    specs = make_requests(plan.workload, plan.num_requests, vocab, plan.seed, tag=tag)
    arrivals = poisson_arrivals(plan.num_requests, plan.rate, plan.seed, tag=tag)
    run = await run_requests(base_url, model, specs, arrivals, timeout_s=plan.timeout_s,
                             run_timeout_s=plan.run_timeout_s, api_key=api_key,
                             extra_body=extra_body)
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "meta": {"base_url": base_url, "model": model, "workload": plan.workload,
                 "workload_desc": WORKLOADS[plan.workload].describe(),
                 "num_requests": plan.num_requests, "rate": _rate_json(plan.rate),
                 "seed": plan.seed, "tag": tag, "timeout_s": plan.timeout_s,
                 "started_at": run.started_at},
        "summary": run.summary(plan.slo_ttft_ms, plan.slo_tpot_ms),
    }
    if keep_requests:
        doc["requests"] = [r.to_json() for r in run.results]
        doc["itl_timeline"] = itl_timeline(run.results)
        doc["long_arrivals_s"] = sorted(r.sent_s for r in run.results
                                        if r.kind == "long" and r.sent_s is not None)
    return doc


async def benchmark_goodput(base_url: str, model: str, vocab: Vocab, plan: RunPlan, *,
                            lo: float = 0.5, hi: float = 32.0, iters: int = 5,
                            rates: Sequence[float] | None = None,
                            duration_s: float | None = None,
                            api_key: str | None = None,
                            extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """A goodput search; each probed rate is a fresh run of ``plan`` at that rate (own prompts).

    With ``duration_s`` a probe sends ``max(plan.num_requests, rate * duration_s)`` requests,
    so fast rates are measured over as long a window as slow ones.
    """
    summaries: dict[float, dict[str, Any]] = {}

    async def evaluate(rate: float) -> float:
        n = plan.num_requests
        if duration_s:
            n = max(n, math.ceil(rate * duration_s))
        p = RunPlan(**{**asdict(plan), "rate": rate, "num_requests": n,
                       "tag": f"goodput:{plan.workload}:{rate:.6g}"})
        doc = await benchmark_run(base_url, model, vocab, p, api_key=api_key,
                                  extra_body=extra_body, keep_requests=False)
        summaries[rate] = doc["summary"]
        return float(doc["summary"]["slo"]["attainment"])

    found = await goodput_search(evaluate, lo=lo, hi=hi, iters=iters, rates=rates)
    for p in found["points"]:
        p["summary"] = summaries[p["rate"]]
    return {"schema": SCHEMA,
            "meta": {"base_url": base_url, "model": model, "workload": plan.workload,
                     "workload_desc": WORKLOADS[plan.workload].describe(),
                     "num_requests": plan.num_requests, "seed": plan.seed,
                     "slo_ttft_ms": plan.slo_ttft_ms, "slo_tpot_ms": plan.slo_tpot_ms,
                     "range": [lo, hi], "iters": iters, "rates": list(rates or []),
                     "duration_s": duration_s,
                     "started_at": time.time()},
            "goodput": found}


async def warmup(base_url: str, model: str, vocab: Vocab, *, seed: int = 0,
                 timeout_s: float = 300.0, api_key: str | None = None) -> None:
    """A few requests of each shape (sequential, then concurrent) so one-time costs are paid."""
    for wl, n in (("uniform", 2), ("long", 1), ("mixed", 8)):
        specs = make_requests(wl, n, vocab, seed, tag="warmup")
        run = await run_requests(base_url, model, specs, [0.0] * n, timeout_s=timeout_s,
                                 api_key=api_key)
        bad = [r.error for r in run.results if not r.success]
        if bad:
            raise RuntimeError(f"warmup failed against {base_url}: {bad[0]}")


# -- CLI -----------------------------------------------------------------------------------------
def _parse_rate(v: str) -> float:
    return math.inf if v.strip().lower() in ("inf", "sat", "saturation", "0") else float(v)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    ap.add_argument("--model-dir", required=True, help="checkpoint dir (for its vocabulary)")
    ap.add_argument("--workload", default="uniform", choices=sorted(WORKLOADS))
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--rate", type=_parse_rate, default=math.inf,
                    help="Poisson rate in req/s; inf = all at once (saturation)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="prompt-set tag (distinct tags, distinct prompts)")
    ap.add_argument("--timeout", type=float, default=120.0, help="per-request timeout (s)")
    ap.add_argument("--run-timeout", type=float, default=None, help="whole-run deadline (s)")
    ap.add_argument("--slo-ttft-ms", type=float, default=DEFAULT_SLO_TTFT_MS)
    ap.add_argument("--slo-tpot-ms", type=float, default=DEFAULT_SLO_TPOT_MS)
    ap.add_argument("--goodput", action="store_true", help="search the goodput rate instead")
    ap.add_argument("--rate-range", default="0.5:32", help="goodput bisection range LO:HI")
    ap.add_argument("--goodput-iters", type=int, default=5)
    ap.add_argument("--rates", default=None, help="goodput sweep rates, comma-separated")
    ap.add_argument("--warmup", action="store_true", help="send warmup requests first")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--out", default=None, help="JSON output file (default: stdout summary)")
    return ap


async def _amain(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or await fetch_model_name(args.base_url, args.api_key)
    vocab = read_vocab(args.model_dir)
    if args.warmup:
        await warmup(args.base_url, model, vocab, seed=args.seed, api_key=args.api_key)
    plan = RunPlan(args.workload, args.num_requests, args.rate, args.seed, args.tag,
                   args.timeout, args.run_timeout, args.slo_ttft_ms, args.slo_tpot_ms)
    if args.goodput:
        lo, hi = (float(x) for x in args.rate_range.split(":"))
        rates = [float(x) for x in args.rates.split(",")] if args.rates else None
        return await benchmark_goodput(args.base_url, model, vocab, plan, lo=lo, hi=hi,
                                       iters=args.goodput_iters, rates=rates,
                                       api_key=args.api_key)
    return await benchmark_run(args.base_url, model, vocab, plan, api_key=args.api_key)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = build_parser().parse_args(argv)
    doc = asyncio.run(_amain(args))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1))
    brief = doc.get("goodput") or {k: v for k, v in doc["summary"].items() if k != "by_kind"}
    print(json.dumps(brief, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
