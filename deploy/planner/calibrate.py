"""A profile corrected by a short live run of the whole cluster at low load.

``kvrelay profile`` times the engine alone in one process. A live cluster runs the same engine
beside the router, the clients and the other pool, and adds a hand-off (RPCs, the KV write, the
router's relay) to every first token. At low load queueing is negligible, so the gap between the
live run's latencies and the simulator's on the same trace is the cost of that. Two numbers of
the low-load run are matched, its ITL p90 and its TTFT p90, so two corrections are fitted, one
after the other:

1. **engine slowdown** ``s``, from the ITL p90: every engine time (prefill and decode: the same
   forward on the same cores) is multiplied by ``s``, found by search (a slower engine also
   batches more, and the batch lengthens every step), the pools simulated apart;
2. the TTFT p90 left over once prefill is slowed by ``s``, attributed by the deployment:

   * pools on hardware of their own (``colocated=False``, Ray or Kubernetes with a replica per
     node or GPU): a fixed hand-off added to every first token (``Profile.transfer_s``);
   * pools sharing one host's cores (``colocated=True``, the demo cluster on one machine): the
     contention ``k`` of ``contention.py``, by search: a prefill step runs ``1 + k x`` (the
     sequences being decoded beside it) slower. No hand-off is added (on the demo host the
     requests that prefilled alone put it at a few ms) unless ``k`` reaches its bound. At low
     load the decode pool is often busy with one sequence, so ``k`` shows there; as the load
     grows the decode batch grows, and so does the slowdown it causes, which a fixed hand-off
     cannot follow. The decode side's coefficient (a decode step slowed by the prefill beside
     it) is not fitted: the ITL p90 is already spent on ``s``; the profile's own is kept.

With two numbers, one of ``s`` and ``k`` has to carry what a third parameter would: prefill is
assumed slowed by the same ``s`` as decode, so a prefill that is slower than that even alone
raises ``k``. The corrected profile is then what the simulator, and the planner, size with
(the planner's sizing reads no contention: its observed correction sees what it costs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvrelay.deploy.planner.profile import Profile
from kvrelay.deploy.planner.simulator import SimConfig, SimResult, simulate
from kvrelay.deploy.planner.trace import TraceRequest

MAX_CONTENTION = 20.0  # a prefill step 21x slower beside one decoding sequence: past this, hand-off


@dataclass(frozen=True)
class Calibration:
    engine_scale: float  # every engine time (prefill and decode steps) multiplied by this
    extra_ttft_s: float  # added to every request's first token
    live_ttft_p90_ms: float
    live_itl_p90_ms: float
    sim_ttft_p90_ms: float  # the uncorrected profile on the same trace
    sim_itl_p90_ms: float
    contention: float = 0.0  # prefill slowdown per sequence decoded beside it (0: apart)

    def apply(self, profile: Profile) -> Profile:
        scaled = profile.scaled(self.engine_scale, self.engine_scale)
        return replace(scaled, transfer_s=profile.transfer_s + self.extra_ttft_s,
                       contention=(profile.contention[0] + self.contention,
                                   profile.contention[1]))


def calibrate(profile: Profile, trace: list[TraceRequest], config: SimConfig, *,
              live_ttft_p90_ms: float, live_itl_p90_ms: float,
              colocated: bool = False) -> Calibration:
    """The correction that makes the simulator's TTFT and ITL p90 on ``trace`` (a low-load run,
    fixed replicas) equal the live run's. Neither factor goes below the profile's own: a live
    cluster is not faster than the engine alone. ``colocated``: the pools share one host's
    cores (the TTFT gap is contention, not a hand-off; see the module docstring)."""
    if live_ttft_p90_ms <= 0 or live_itl_p90_ms <= 0:
        raise ValueError("the calibration run needs positive TTFT and ITL p90s")
    base = simulate(profile, trace, config)
    scale = _engine_scale(profile, trace, config, live_itl_p90_ms, base.itl_p90_ms)
    scaled = profile.scaled(scale, scale)
    at_scale = simulate(scaled, trace, config)
    k = 0.0
    if colocated and at_scale.ttft_p90_ms < live_ttft_p90_ms:
        k, at_scale = _contention(scaled, trace, config, live_ttft_p90_ms)
    extra = 0.0
    if not colocated or k >= MAX_CONTENTION:
        extra = max(0.0, (live_ttft_p90_ms - at_scale.ttft_p90_ms) / 1000.0)
    return Calibration(scale, extra, live_ttft_p90_ms, live_itl_p90_ms, base.ttft_p90_ms,
                       base.itl_p90_ms, k)


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


def _contention(profile: Profile, trace: list[TraceRequest], config: SimConfig,
                live_ttft_p90_ms: float, *, steps: int = 16) -> tuple[float, SimResult]:
    """The prefill contention at which the simulated TTFT p90 equals the live one, by bisection
    over [0, ``MAX_CONTENTION``] (the TTFT grows with it), with the result it simulates."""
    def run(k: float) -> SimResult:
        return simulate(replace(profile, contention=(profile.contention[0] + k,
                                                     profile.contention[1])), trace, config)

    top = run(MAX_CONTENTION)
    if top.ttft_p90_ms <= live_ttft_p90_ms:
        return MAX_CONTENTION, top
    lo, hi = 0.0, MAX_CONTENTION
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if run(mid).ttft_p90_ms < live_ttft_p90_ms else (lo, mid)
    k = (lo + hi) / 2
    return k, run(k)
