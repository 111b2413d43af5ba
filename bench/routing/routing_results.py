"""What the routing benchmark measured: one request's ``Result``, a policy's summary over a
workload (latencies, prompt tokens computed against routed from the router's counters, the fast
lane's share), the mean over repeated runs, and the table of policies against ``round_robin``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.serving.metrics import percentile


# -- one request -----------------------------------------------------------------------------------
@dataclass
class Result:
    kind: str
    prompt_tokens: int
    sent_s: float
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    cached_tokens: int = 0
    local: bool = False
    prefill_worker: str = ""
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None


# -- one policy ------------------------------------------------------------------------------------
def summarize(results: Sequence[Result], before: dict[str, float],
              after: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]

    def dist(xs: list[float]) -> dict[str, float | None]:
        return {"p50": percentile(xs, 50), "p90": percentile(xs, 90), "p99": percentile(xs, 99),
                "mean": sum(xs) / len(xs) if xs else None}

    def delta(name: str) -> float:
        return sum(after.get(k, 0.0) - before.get(k, 0.0) for k in after if k.startswith(name))

    return {
        "requests": len(results), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "ttft_ms": dist([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "tpot_ms": dist([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "e2e_ms": dist([r.e2e_ms for r in ok if r.e2e_ms is not None]),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "prompt_tokens_routed": delta("kvrelay:router_prompt_tokens_routed_total"),
        "prompt_tokens_computed": delta("kvrelay:router_prompt_tokens_computed_total"),
        "kv_blocks_sent": delta("kvrelay:router_kv_blocks_sent_total"),
        "kv_blocks_skipped": delta("kvrelay:router_kv_blocks_skipped_total"),
        "fast_lane_share": sum(r.local for r in ok) / len(ok) if ok else 0.0,
        "by_kind": {k: {"count": len(rs), "ttft_ms": dist([r.ttft_ms for r in rs
                                                           if r.ttft_ms is not None])}
                    for k in sorted({r.kind for r in ok})
                    for rs in [[r for r in ok if r.kind == k]]},
    }


def brief(s: dict[str, Any]) -> str:
    return (f"ttft p50 {s['ttft_ms']['p50']:.0f}ms p99 {s['ttft_ms']['p99']:.0f}ms, "
            f"computed {s['prompt_tokens_computed']:.0f}/{s['prompt_tokens_routed']:.0f}, "
            f"fast lane {100 * s['fast_lane_share']:.0f}%, failed {s['failed']}")


# -- report --------------------------------------------------------------------------------------
def mean_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean of every number over repeated runs of one policy (structure of one run)."""
    def avg(xs: list[Any]) -> Any:
        if isinstance(xs[0], dict):
            return {k: avg([x[k] for x in xs]) for k in xs[0] if all(k in x for x in xs)}
        nums = [x for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool)]
        if len(nums) == len(xs):
            return sum(nums) / len(nums)
        return xs[0]
    return avg(runs)


def table(doc: dict[str, Any]) -> str:
    lines = []
    for wl in doc["settings"]["workloads"]:
        rows = {p: doc["policies"][p][wl] for p in doc["policies"] if wl in doc["policies"][p]}
        base = rows.get("round_robin")
        lines += [f"\n{wl}", "| policy | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms "
                  "| e2e p50 ms | prompt tokens computed / routed | fast lane | failed "
                  "| TTFT p99 / RR | computed / RR |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for p, s in rows.items():
            def r(x: float | None, b: float | None) -> str:
                return f"{x / b:.2f}" if x is not None and b else "-"
            lines.append(
                f"| {p} | {s['ttft_ms']['p50']:.0f} | {s['ttft_ms']['p99']:.0f} "
                f"| {s['tpot_ms']['p50']:.1f} | {s['tpot_ms']['p99']:.1f} "
                f"| {s['e2e_ms']['p50']:.0f} "
                f"| {s['prompt_tokens_computed']:.0f} / {s['prompt_tokens_routed']:.0f} "
                f"| {100 * s['fast_lane_share']:.0f}% | {s['failed']:.0f} "
                f"| {r(s['ttft_ms']['p99'], base and base['ttft_ms']['p99'])} "
                f"| {r(s['prompt_tokens_computed'], base and base['prompt_tokens_computed'])} |")
    return "\n".join(lines)
