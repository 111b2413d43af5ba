"""What a load-generator run measured: per-request records and the statistics over them.

``RequestResult`` is one request (send time, time-stamped token chunks, TTFT, TPOT, e2e,
error); ``RunResult`` one run of them. ``summarize`` turns a run into p50/p90/p99 of each
latency, request and output-token throughput and SLO attainment, overall and by request kind;
``itl_timeline`` lists every inter-token gap by its end time (decode stalls around long
prompts' arrivals).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_SLO_TTFT_MS = 500.0
DEFAULT_SLO_TPOT_MS = 50.0


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


# -- one run -----------------------------------------------------------------------------------
@dataclass
class RunResult:
    results: list[RequestResult]
    duration_s: float
    started_at: float  # wall clock (epoch s) of the run start

    def summary(self, slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS,
                slo_tpot_ms: float = DEFAULT_SLO_TPOT_MS) -> dict[str, Any]:
        return summarize(self.results, self.duration_s, slo_ttft_ms, slo_tpot_ms)


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
