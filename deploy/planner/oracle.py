"""A hindsight lower bound on the replica-seconds any scaling policy needs for a trace.

The trace is cut into windows; for each window every P:D split (within the pool bounds) is
simulated as a static cluster on that window's requests, after a warm-up on the requests just
before it (so the prefix cache and the queues are in that split's steady state). A policy that
knew the future and could change replicas instantly, with no start-up, would pick one split per
window; the cheapest such choice that meets an overall attainment is this bound.

Choosing the splits is a knapsack (each window: a cost in replica-seconds, a number of requests
served within the SLOs); ``cheapest`` solves its linear relaxation through the Lagrangian: for
a price ``lam`` per request met, each window takes the split that minimises
``cost - lam * met``; ``lam`` is bisected to where the choice starts to meet the attainment, and
the cost there is interpolated between the choices just short of it and just past it. That is
the lower convex hull of the exact answer's cost-attainment curve, so the bound stays a bound
(it errs low, never high); the cheapest whole choice found is reported beside it.

It is optimistic for the policy in two more ways (no start-up, no carry-over between windows
beyond the warm-up), so "below the oracle" means no policy can do it; being near the oracle is
not required of one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvrelay.deploy.planner.profile import Profile
from kvrelay.deploy.planner.simulator import SimConfig, simulate
from kvrelay.deploy.planner.trace import TraceRequest


@dataclass(frozen=True)
class Option:
    prefill: int
    decode: int
    cost: float  # replica-seconds over the window
    met: float  # requests of the window served within both SLOs


def window_options(profile: Profile, trace: list[TraceRequest], sim: SimConfig, *,
                   window_s: float = 20.0, warm_s: float = 10.0, max_pool: int = 4,
                   max_total: int = 8) -> list[tuple[int, list[Option]]]:
    """Per window: (its request count, one ``Option`` per split)."""
    if not trace:
        return []
    end = max(r.t for r in trace)
    out = []
    w0 = 0.0
    while w0 <= end:
        w1 = w0 + window_s
        start = max(0.0, w0 - warm_s)
        part = [replace(r, t=r.t - start) for r in trace if start <= r.t < w1]
        n = sum(1 for r in trace if w0 <= r.t < w1)
        opts = []
        for p in range(1, max_pool + 1):
            for d in range(1, max_pool + 1):
                if p + d > max_total:
                    continue
                if n == 0:
                    met = 0.0
                else:
                    res = simulate(profile, part, replace(sim, prefill=p, decode=d,
                                                          measure_from_s=w0 - start))
                    met = res.attainment * n
                opts.append(Option(p, d, (p + d) * window_s, met))
        out.append((n, opts))
        w0 = w1
    return out


def cheapest(windows: list[tuple[int, list[Option]]], attainment: float) -> dict:
    """At least ``attainment`` of all the windows' requests met: ``replica_seconds``, the
    relaxation's bound; ``whole``, the cheapest whole choice found (one split per window) and
    the share it meets. ``reached`` False: out of reach, the most any choice meets."""
    total = sum(n for n, _ in windows)
    need = attainment * total - 1e-9

    def pick(lam: float) -> tuple[float, float]:
        chosen = [min(opts, key=lambda o: (o.cost - lam * o.met, o.cost)) for _, opts in windows]
        return sum(o.cost for o in chosen), sum(o.met for o in chosen)

    def share(met: float) -> float:
        return met / total if total else 1.0

    lo_cost, lo_met = pick(0.0)  # every window at its cheapest
    if lo_met >= need:
        return {"replica_seconds": lo_cost, "whole": lo_cost, "attainment": share(lo_met),
                "reached": True}
    hi = 1.0
    while pick(hi)[1] < need and hi < 1e12:
        hi *= 4
    hi_cost, hi_met = pick(hi)
    if hi_met < need:
        return {"replica_seconds": hi_cost, "whole": hi_cost, "attainment": share(hi_met),
                "reached": False}
    lo = 0.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if pick(mid)[1] >= need:
            hi = mid
        else:
            lo = mid
    (lo_cost, lo_met), (hi_cost, hi_met) = pick(lo), pick(hi)
    bound = hi_cost if hi_met == lo_met else \
        lo_cost + (need - lo_met) / (hi_met - lo_met) * (hi_cost - lo_cost)
    return {"replica_seconds": bound, "whole": hi_cost, "attainment": share(hi_met),
            "reached": True}
