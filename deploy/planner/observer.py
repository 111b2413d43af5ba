"""From the router's /metrics text to the planner's ``Observation``: the same code on Ray (the
controller reads the router actor's registry) and on Kubernetes (the planner process scrapes the
router's HTTP /metrics).

A ``Snapshot`` holds the cumulative counters and histograms at one time plus the pool gauges;
two snapshots make one interval's observation (arrivals = finished + failed + change of the
requests in flight). Latency p90s come from the interval's histogram buckets (interpolated
within a bucket) unless the caller has exact ones (the Ray router's recent window).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace

from prometheus_client.parser import text_string_to_metric_families

from kvrelay.deploy.planner.signals import Observation

TTFT = "kvrelay:time_to_first_token_seconds"
TPOT = "kvrelay:time_per_output_token_seconds"  # per request: its mean inter-token latency


@dataclass(frozen=True)
class Snapshot:
    t: float
    finished: float = 0.0
    failed: float = 0.0
    in_flight: float = 0.0
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    output_tokens: float = 0.0
    workers: dict[str, int] = field(default_factory=dict)
    queued_prompt_tokens: float = 0.0  # prefill pool
    decode_running: float = 0.0  # decode pool, running + waiting
    kv_usage: float = 0.0  # decode pool mean
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # cumulative
    ttft_p90_ms: float | None = None  # exact, when the caller has them
    itl_p90_ms: float | None = None


def parse(text: str, t: float) -> Snapshot:
    sums: dict[str, float] = defaultdict(float)
    workers: dict[str, int] = {}
    usage: list[float] = []
    buckets: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            pool = s.labels.get("pool")
            if s.name in (TTFT + "_bucket", TPOT + "_bucket"):
                buckets[s.name[:-7]].append((float(s.labels["le"]), s.value))
            elif s.name == "kvrelay:workers":
                workers[pool] = int(s.value)
            elif s.name == "kvrelay:num_queued_prompt_tokens" and pool == "prefill":
                sums["queued"] += s.value
            elif s.name in ("kvrelay:num_requests_running", "kvrelay:num_requests_waiting") \
                    and pool == "decode":
                sums["running"] += s.value
            elif s.name == "kvrelay:kv_cache_usage_perc" and pool == "decode":
                usage.append(s.value)
            else:
                sums[s.name] += s.value
    return Snapshot(
        t=t, finished=sums["kvrelay:request_success_total"],
        failed=sums["kvrelay:request_failures_total"],
        in_flight=sums["kvrelay:router_requests_in_flight"],
        prompt_tokens=sums["kvrelay:prompt_tokens_total"],
        cached_tokens=sums["kvrelay:cached_prompt_tokens_total"],
        output_tokens=sums["kvrelay:generation_tokens_total"], workers=workers,
        queued_prompt_tokens=sums["queued"], decode_running=sums["running"],
        kv_usage=sum(usage) / len(usage) if usage else 0.0,
        buckets={k: sorted(v) for k, v in buckets.items()})


def bucket_p90(prev: list[tuple[float, float]], cur: list[tuple[float, float]]) -> float | None:
    """p90 (seconds) of the observations between two cumulative histograms."""
    before = dict(prev)
    diff = [(le, c - before.get(le, 0.0)) for le, c in cur]
    total = diff[-1][1] if diff else 0.0
    if total <= 0:
        return None
    goal, lo_le, lo_c = 0.9 * total, 0.0, 0.0
    for le, c in diff:
        if c >= goal:
            if math.isinf(le):
                return lo_le
            return lo_le + (le - lo_le) * (goal - lo_c) / max(c - lo_c, 1e-12)
        lo_le, lo_c = le, c
    return lo_le


def observe(prev: Snapshot, cur: Snapshot, replicas: dict[str, int] | None = None,
            changing: tuple[str, ...] = ()) -> Observation:
    """One interval's observation. ``replicas``: the pools' live counts when the caller knows
    them better than the registry (starting replicas included)."""
    reps = replicas or cur.workers
    done = cur.finished - prev.finished

    def p90(name: str, exact: float | None) -> float | None:
        if exact is not None:
            return exact
        v = bucket_p90(prev.buckets.get(name, []), cur.buckets.get(name, []))
        return None if v is None else 1000 * v
    return Observation(
        t=cur.t, interval_s=cur.t - prev.t,
        prefill_replicas=int(reps.get("prefill", 0)), decode_replicas=int(reps.get("decode", 0)),
        arrivals=max(0, round(done + cur.failed - prev.failed + cur.in_flight - prev.in_flight)),
        finished=round(done), prompt_tokens=round(cur.prompt_tokens - prev.prompt_tokens),
        cached_tokens=round(cur.cached_tokens - prev.cached_tokens),
        output_tokens=round(cur.output_tokens - prev.output_tokens),
        queued_prompt_tokens=round(cur.queued_prompt_tokens),
        decode_running=round(cur.decode_running), kv_usage=cur.kv_usage,
        ttft_p90_ms=p90(TTFT, cur.ttft_p90_ms), itl_p90_ms=p90(TPOT, cur.itl_p90_ms),
        changing=changing)


def with_latency(s: Snapshot, ttft_ms: float | None, itl_ms: float | None) -> Snapshot:
    return replace(s, ttft_p90_ms=ttft_ms, itl_p90_ms=itl_ms)
