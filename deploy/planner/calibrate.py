"""A profile corrected by a short live run of the whole cluster at low load.

``kvrelay profile`` times the engine alone in one process. A live cluster runs the same engine
beside the router, the clients and the other pool on shared cores, and adds a hand-off (RPCs,
the KV write, the router's relay) to every first token. At low load queueing is negligible, so
the gap between the live run's latencies and the simulator's on the same trace is the cost of
that: the ITL ratio gives the engine's slowdown (applied to prefill and decode alike: both are
the same forward on the same cores; found by search, as a slower engine also batches more), and
the TTFT left over once prefill is slowed by it is a
fixed per-request overhead (``Profile.transfer_s``). The corrected profile is then what the
simulator, and the planner, size with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvrelay.deploy.planner.profile import Profile
from kvrelay.deploy.planner.simulator import SimConfig, simulate
from kvrelay.deploy.planner.trace import TraceRequest


@dataclass(frozen=True)
class Calibration:
    engine_scale: float  # every engine time (prefill and decode steps) multiplied by this
    extra_ttft_s: float  # added to every request's first token
    live_ttft_p90_ms: float
    live_itl_p90_ms: float
    sim_ttft_p90_ms: float  # the uncorrected profile on the same trace
    sim_itl_p90_ms: float

    def apply(self, profile: Profile) -> Profile:
        scaled = profile.scaled(self.engine_scale, self.engine_scale)
        return replace(scaled, transfer_s=profile.transfer_s + self.extra_ttft_s)


def calibrate(profile: Profile, trace: list[TraceRequest], config: SimConfig, *,
              live_ttft_p90_ms: float, live_itl_p90_ms: float) -> Calibration:
    """The correction that makes the simulator's TTFT and ITL p90 on ``trace`` (a low-load run,
    fixed replicas) equal the live run's. Neither factor goes below the profile's own: a live
    cluster is not faster than the engine alone."""
    if live_ttft_p90_ms <= 0 or live_itl_p90_ms <= 0:
        raise ValueError("the calibration run needs positive TTFT and ITL p90s")
    base = simulate(profile, trace, config)
    scale = _engine_scale(profile, trace, config, live_itl_p90_ms, base.itl_p90_ms)
    scaled = simulate(profile.scaled(scale, scale), trace, config)
    extra = max(0.0, (live_ttft_p90_ms - scaled.ttft_p90_ms) / 1000.0)
    return Calibration(scale, extra, live_ttft_p90_ms, live_itl_p90_ms, base.ttft_p90_ms,
                       base.itl_p90_ms)


def _engine_scale(profile: Profile, trace: list[TraceRequest], config: SimConfig,
                  live_itl_p90_ms: float, itl_at_one_ms: float, *, high: float = 100.0,
                  steps: int = 14) -> float:
    """The engine slowdown at which the simulated ITL p90 equals the live one, by bisection in
    log space over [1, ``high``]: not the plain ratio, since a slower engine also holds more
    requests in its batch, and the batch lengthens every step. ``itl_at_one_ms``: the
    profile's own simulated ITL p90 (already run by the caller)."""
    def itl(s: float) -> float:
        return simulate(profile.scaled(s, s), trace, config).itl_p90_ms

    lo, hi = 1.0, high
    if itl_at_one_ms >= live_itl_p90_ms:
        return lo
    if itl(hi) <= live_itl_p90_ms:
        return hi
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if itl(mid) < live_itl_p90_ms else (lo, mid)
    return (lo * hi) ** 0.5
