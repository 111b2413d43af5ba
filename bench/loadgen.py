"""Load generator for OpenAI-compatible ``/v1/completions`` servers (kvrelay, vLLM).

asyncio + httpx streaming. Every request sends token-id prompts with ``stream: true``,
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

CLI (one run, or a goodput search)::

    python -m bench.loadgen --base-url http://127.0.0.1:8000 --model-dir .bench-out/models/tiny \\
        --workload uniform --num-requests 200 --rate inf --out sat.json
    python -m bench.loadgen --base-url ... --model-dir ... --goodput --rate-range 0.5:32 \\
        --goodput-iters 5 --num-requests 100 --out goodput.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):  # run as a script: make `bench.` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import (
    WORKLOADS,
    RequestSpec,
    Vocab,
    make_requests,
    poisson_arrivals,
    read_vocab,
)

logger = logging.getLogger("bench.loadgen")

DEFAULT_SLO_TTFT_MS = 500.0
DEFAULT_SLO_TPOT_MS = 50.0
GOODPUT_THRESHOLD = 0.9
SCHEMA = "kvrelay-bench/run/v1"


# -- statistics -------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default method)."""
    if not 0 <= q <= 100:
        raise ValueError("q must be within [0, 100]")
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """n, mean, min, p50, p90, p99, max of the non-missing values."""
    xs = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return {"n": 0, "mean": None, "min": None, "p50": None, "p90": None, "p99": None,
                "max": None}
    return {"n": len(xs), "mean": sum(xs) / len(xs), "min": min(xs),
            "p50": percentile(xs, 50), "p90": percentile(xs, 90), "p99": percentile(xs, 99),
            "max": max(xs)}


# -- SSE --------------------------------------------------------------------------------------
class SSEParser:
    """Incremental Server-Sent-Events parser: bytes in, the ``data`` payload of each event out.

    Handles ``\\n``, ``\\r\\n`` and ``\\r`` line ends, events split across network chunks,
    multi-line data (joined with ``\\n``), comments and other fields (ignored).
    """

    def __init__(self) -> None:
        self._buf = ""
        self._data: list[str] = []
        self._pending_cr = False

    def feed(self, chunk: bytes | str) -> list[str]:
        text = chunk.decode("utf-8", errors="replace") if isinstance(chunk, bytes) else chunk
        if self._pending_cr and text.startswith("\n"):
            text = text[1:]
        self._pending_cr = text.endswith("\r")
        self._buf += text.replace("\r\n", "\n").replace("\r", "\n")
        out: list[str] = []
        while True:
            nl = self._buf.find("\n")
            if nl < 0:
                break
            line, self._buf = self._buf[:nl], self._buf[nl + 1:]
            if line == "":
                if self._data:
                    out.append("\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            if value.startswith(" "):
                value = value[1:]
            if name == "data":
                self._data.append(value)
        return out

    def close(self) -> list[str]:
        """Events still open at the end of the stream (a server that omits the last blank line)."""
        out = self.feed("\n\n") if self._buf else []
        if self._data:
            out.append("\n".join(self._data))
            self._data = []
        return out


def chunk_tokens(doc: dict[str, Any]) -> int:
    """Tokens an OpenAI completion chunk carries: ``token_ids`` when sent, else 1 per choice.

    A chunk with no choices (the usage chunk) carries none; every chunk with a choice counts as
    one token event (servers may send an empty ``text`` for a token whose bytes are incomplete).
    """
    n = 0
    for ch in doc.get("choices") or []:
        ids = ch.get("token_ids")
        if isinstance(ids, list):
            n += len(ids)
        elif ch.get("text") or ch.get("delta") or ch.get("finish_reason") is None:
            n += 1
    return n


# -- one request -------------------------------------------------------------------------------
@dataclass
class RequestResult:
    index: int
    kind: str
    prompt_tokens: int
    max_tokens: int
    scheduled_s: float
    sent_s: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    output_tokens: int = 0
    usage_tokens: int | None = None
    success: bool = False
    error: str | None = None
    status: int | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)

    @property
    def itl_ms(self) -> list[float]:
        t = self.chunk_times_s
        return [(b - a) * 1e3 for a, b in itertools.pairwise(t)]

    def meets(self, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
        if not self.success or self.ttft_ms is None or self.ttft_ms > slo_ttft_ms:
            return False
        return self.tpot_ms is None or self.tpot_ms <= slo_tpot_ms

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["chunk_times_s"] = [round(t, 6) for t in self.chunk_times_s]
        if all(n == 1 for n in self.chunk_tokens):
            d["chunk_tokens"] = None  # the usual case: one token per chunk
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestResult:
        d = dict(d)
        if d.get("chunk_tokens") is None:
            d["chunk_tokens"] = [1] * len(d.get("chunk_times_s") or [])
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def completion_body(model: str, spec: RequestSpec,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "prompt": spec.prompt_token_ids, "max_tokens": spec.max_tokens,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if extra:
        body.update(extra)
    return body


async def _stream_one(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                      res: RequestResult, t0: float) -> None:
    """Send one streaming request and fill ``res`` (raises on transport errors)."""
    parser = SSEParser()
    sent = time.perf_counter()
    res.sent_s = sent - t0
    first: float | None = None
    last = sent
    async with client.stream("POST", url, json=body) as resp:
        res.status = resp.status_code
        if resp.status_code != 200:
            text = (await resp.aread()).decode("utf-8", errors="replace")
            res.error = f"HTTP {resp.status_code}: {text[:300]}"
            return
        done = False

        def handle(payloads: list[str], now: float) -> None:
            nonlocal done, first
            for payload in payloads:
                if payload.strip() == "[DONE]":
                    done = True
                    continue
                try:
                    doc = json.loads(payload)
                except json.JSONDecodeError:
                    res.error = f"bad SSE payload: {payload[:200]}"
                    continue
                if "error" in doc:
                    err = doc["error"]
                    res.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    continue
                n = chunk_tokens(doc)
                if n:
                    if first is None:
                        first = now
                    res.chunk_times_s.append(now - t0)
                    res.chunk_tokens.append(n)
                usage = doc.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    res.usage_tokens = int(usage["completion_tokens"])

        async for raw in resp.aiter_bytes():
            last = time.perf_counter()
            handle(parser.feed(raw), last)
        handle(parser.close(), last)
        if not done and res.error is None:
            res.error = "stream ended without [DONE]"
    end = last
    res.output_tokens = (res.usage_tokens if res.usage_tokens is not None
                         else sum(res.chunk_tokens))
    if first is not None:
        res.ttft_ms = (first - sent) * 1e3
        res.e2e_ms = (end - sent) * 1e3
        if res.output_tokens > 1:
            res.tpot_ms = (res.e2e_ms - res.ttft_ms) / (res.output_tokens - 1)
    if res.error is None and first is None:
        res.error = "no tokens"
    res.success = res.error is None


# -- one run -----------------------------------------------------------------------------------
@dataclass
class RunResult:
    results: list[RequestResult]
    duration_s: float
    started_at: float  # wall clock (epoch s) of the run start

    def summary(self, slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS,
                slo_tpot_ms: float = DEFAULT_SLO_TPOT_MS) -> dict[str, Any]:
        return summarize(self.results, self.duration_s, slo_ttft_ms, slo_tpot_ms)


async def run_requests(base_url: str, model: str, specs: Sequence[RequestSpec],
                       arrivals: Sequence[float], *, timeout_s: float = 120.0,
                       run_timeout_s: float | None = None, api_key: str | None = None,
                       extra_body: dict[str, Any] | None = None) -> RunResult:
    """Send ``specs[i]`` at ``arrivals[i]`` seconds after the start; wait for all (bounded)."""
    if len(specs) != len(arrivals):
        raise ValueError("one arrival time per request")
    url = base_url.rstrip("/") + "/v1/completions"
    n = max(1, len(specs))
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    timeout = httpx.Timeout(timeout_s, connect=min(10.0, timeout_s))
    results = [RequestResult(s.index, s.kind, s.prompt_tokens, s.max_tokens, a)
               for s, a in zip(specs, arrivals, strict=True)]
    if run_timeout_s is None:
        run_timeout_s = (max(arrivals) if arrivals else 0.0) + timeout_s + 30.0
    started_at = time.time()
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        t0 = time.perf_counter()

        async def one(spec: RequestSpec, res: RequestResult) -> None:
            delay = res.scheduled_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                await asyncio.wait_for(
                    _stream_one(client, url, completion_body(model, spec, extra_body), res, t0),
                    timeout=timeout_s)
            except asyncio.TimeoutError:
                res.error = f"timeout after {timeout_s:g}s"
            except asyncio.CancelledError:
                res.error = res.error or "cancelled at the run deadline"
                raise
            except httpx.HTTPError as e:
                res.error = f"{type(e).__name__}: {e}"
            except Exception as e:  # a bench run records failures, it does not stop on them
                logger.exception("request %d failed", spec.index)
                res.error = f"{type(e).__name__}: {e}"
            if res.error is not None:
                res.success = False

        tasks = [asyncio.create_task(one(s, r)) for s, r in zip(specs, results, strict=True)]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=run_timeout_s)
            for t in pending:
                t.cancel()
            if pending:
                logger.warning("run deadline (%.0fs): cancelled %d open requests",
                               run_timeout_s, len(pending))
                await asyncio.gather(*pending, return_exceptions=True)
                for r in results:
                    if r.error is None and not r.success:
                        r.error = "cancelled at the run deadline"
        ends = [r.sent_s + r.e2e_ms / 1e3 for r in results
                if r.sent_s is not None and r.e2e_ms is not None]
        duration = max(ends) if ends else time.perf_counter() - t0
    return RunResult(results, max(duration, 1e-9), started_at)


def summarize(results: Sequence[RequestResult], duration_s: float,
              slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS,
              slo_tpot_ms: float = DEFAULT_SLO_TPOT_MS) -> dict[str, Any]:
    """Every metric of a run: latency distributions (ms), throughput, SLO attainment, by kind."""
    ok = [r for r in results if r.success]
    errors = Counter((r.error or "?")[:120] for r in results if not r.success)
    good = sum(1 for r in results if r.meets(slo_ttft_ms, slo_tpot_ms))
    out_tokens = sum(r.output_tokens for r in ok)

    def block(rs: Sequence[RequestResult]) -> dict[str, Any]:
        done = [r for r in rs if r.success]
        return {"count": len(rs), "completed": len(done),
                "ttft_ms": distribution(r.ttft_ms for r in done),
                "tpot_ms": distribution(r.tpot_ms for r in done),
                "itl_ms": distribution(g for r in done for g in r.itl_ms),
                "e2e_ms": distribution(r.e2e_ms for r in done)}

    kinds = sorted({r.kind for r in results})
    return {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": dict(errors.most_common(5)),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_output_tokens": out_tokens,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        **{k: v for k, v in block(results).items() if k not in ("count", "completed")},
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms,
                "attainment": good / len(results) if results else 0.0,
                "goodput_rps": good / duration_s},
        "by_kind": {k: block([r for r in results if r.kind == k]) for k in kinds},
    }


def itl_timeline(results: Sequence[RequestResult]) -> list[list[Any]]:
    """Every inter-token gap as ``[end time s (from run start), gap ms, request index, kind]``."""
    rows: list[list[Any]] = []
    for r in results:
        t = r.chunk_times_s
        rows += [[round(b, 6), round((b - a) * 1e3, 3), r.index, r.kind]
                 for a, b in itertools.pairwise(t)]
    rows.sort(key=lambda row: row[0])
    return rows


# -- goodput -------------------------------------------------------------------------------------
async def goodput_search(evaluate: Callable[[float], Awaitable[float]], *, lo: float = 0.5,
                         hi: float = 32.0, iters: int = 5, rates: Sequence[float] | None = None,
                         threshold: float = GOODPUT_THRESHOLD,
                         stop_after_failures: int = 2) -> dict[str, Any]:
    """Highest rate whose SLO attainment (``await evaluate(rate)``, 0..1) is >= ``threshold``.

    With ``rates``: evaluate them in ascending order (stopping after ``stop_after_failures``
    consecutive misses) and return the highest that passed. Otherwise bisect geometrically in
    ``[lo, hi]`` for ``iters`` steps, assuming attainment falls as the rate rises: ``hi``
    passing returns ``hi`` (``capped``); ``lo`` is probed only when no step passed, and its
    failing returns 0 (``below_range``).
    """
    points: dict[float, float] = {}

    async def at(rate: float) -> bool:
        if rate not in points:
            points[rate] = float(await evaluate(rate))
            logger.info("goodput: rate %.3g req/s -> attainment %.1f%%", rate,
                        100 * points[rate])
        return points[rate] >= threshold

    capped = below = False
    if rates:
        best = 0.0
        misses = 0
        for r in sorted(set(rates)):
            if await at(r):
                best, misses = r, 0
            else:
                misses += 1
                if stop_after_failures and misses >= stop_after_failures:
                    break
        method = "sweep"
        capped = best == max(rates)
    else:
        if not 0 < lo < hi:
            raise ValueError("need 0 < lo < hi")
        method = "bisect"
        if await at(hi):
            best, capped = hi, True
        else:
            a, b = lo, hi  # lo is checked only if no probe passes (low rates take long)
            for _ in range(iters):
                mid = math.sqrt(a * b)
                if await at(mid):
                    a = mid
                else:
                    b = mid
            best = a
            if a == lo and not await at(lo):
                best, below = 0.0, True
    return {"goodput_rps": best, "threshold": threshold, "method": method, "capped": capped,
            "below_range": below,
            "points": [{"rate": r, "attainment": points[r]} for r in sorted(points)]}


# -- high-level entry points (also used by bench/run_serving.py) --------------------------------
async def fetch_model_name(base_url: str, api_key: str | None = None,
                           timeout_s: float = 10.0) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as client:
        r = await client.get(base_url.rstrip("/") + "/v1/models")
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])


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
