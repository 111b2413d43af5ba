"""The planner on Ray: a task of the launcher's controller (``kvrelay serve --planner``).

Each interval it reads the router actor's metrics (the same text its /metrics serves) and exact
recent TTFT/ITL p90s, builds an ``Observation``, asks the ``Planner``, exports the decision on
the router's /metrics, and applies a changed count through the controller's own scaling path
(``Controller.start_change``: the one the threshold autoscaler uses, recorded in ``kvrelay
status``'s decisions). A pool changes once at a time, except that it may grow again while
replicas it asked for are still starting.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from kvrelay.deploy.planner.observer import Snapshot, observe, parse, with_latency
from kvrelay.deploy.planner.planner import Planner, PlannerConfig
from kvrelay.deploy.planner.profile import Profile
from kvrelay.deploy.planner.signals import POOLS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannerSpec:
    profile: Profile
    config: PlannerConfig


async def _snapshot(controller: Any, window_s: float) -> Snapshot:
    text = await controller.router.metrics_text.remote()
    lat = await controller.router.recent_latency.remote(window_s)
    return with_latency(parse(text, time.monotonic()), lat["ttft_ms"], lat["itl_ms"])


async def run_planner(controller: Any, spec: PlannerSpec) -> None:
    cfg = spec.config
    planner = Planner(spec.profile, cfg)
    window = max(5.0, 3 * cfg.interval_s)
    prev: Snapshot | None = None
    last_reason = ""
    pending: dict[str, int] = {}
    while True:
        await asyncio.sleep(cfg.interval_s)
        try:
            cur = await _snapshot(controller, window)
        except Exception:
            logger.exception("planner: could not read the router's load")
            continue
        if prev is None:
            prev = cur
            continue
        changing = tuple(p for p in POOLS if controller.change_in_flight(p))
        # A pool mid-change counts at its target: a starting replica is not in counts() yet,
        # and the budget must see it.
        counts = {p: pending[p] if p in changing else n for p, n in controller.counts().items()}
        obs = observe(prev, cur, {p: counts[p] for p in POOLS}, changing)
        prev = cur
        d = planner.decide(obs)
        try:
            await controller.router.planner_report.remote(d, counts)
        except Exception:
            logger.exception("planner: could not export the decision")
        moved = False
        for pool in POOLS:
            to = d.target(pool)
            # A pool mid-change can still grow (the planner asks for more while replicas
            # start, as a backlog grows); any other change waits for the one in flight.
            if to > counts[pool] or (to != counts[pool]
                                     and not controller.change_in_flight(pool)):
                moved = True
                pending[pool] = to
                controller.start_change(
                    "planner", pool, counts[pool], to, d.reason,
                    lambda t, pool=pool: planner.change_done(pool, t),
                    {k: round(v, 4) for k, v in d.details.items()})
        if not moved:  # holds: at INFO when the gist changes, else DEBUG
            gist = d.reason.split(": need")[-1]
            (logger.info if gist != last_reason else logger.debug)("planner hold: %s", d.reason)
            last_reason = gist
