"""The threshold autoscaler on Ray: a task of the launcher's controller (``kvrelay serve
--autoscale``), as :mod:`kvrelay.deploy.planner.ray_loop` is for the SLO planner.

Each ``interval_s`` it reads the router actor's per-worker load and recent TTFT/ITL, builds a
``PoolSample`` per pool, asks that pool's ``PoolAutoscaler`` (pure policy) and applies a change
through the controller's one scaling path (``start_change``: one change per pool in flight,
recorded in ``kvrelay status``'s decisions; the cooldown counts from when it finished).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from kvrelay.deploy.autoscaler import AutoscaleConfig, PoolAutoscaler, PoolSample

logger = logging.getLogger(__name__)

AUTOSCALED_POOLS = ("prefill", "decode")


def pool_sample(pool: str, replicas: int, workers: list[dict[str, Any]],
                lat: dict[str, float | None]) -> PoolSample:
    """One pool's load from the router's worker list (draining workers excluded)."""
    ws = [w for w in workers if w["role"] == pool and not w["draining"]]
    return PoolSample(
        replicas=replicas,
        queued_prompt_tokens=sum(w["queued_prompt_tokens"] for w in ws),
        kv_usage=sum(w["kv_usage"] for w in ws) / len(ws) if ws else 0.0,
        running=sum(w["running"] for w in ws),
        ttft_ms=lat["ttft_ms"], itl_ms=lat["itl_ms"])


def fmt_sample(s: PoolSample) -> str:
    lat = "".join(f" {k}={v:.0f}ms" for k, v in (("ttft", s.ttft_ms), ("itl", s.itl_ms))
                  if v is not None)
    return (f"replicas={s.replicas} queued_prompt_tokens={s.queued_prompt_tokens} "
            f"kv_usage={s.kv_usage:.0%} running={s.running}{lat}")


async def run_autoscaler(controller: Any, cfg: AutoscaleConfig) -> None:
    scalers = {p: PoolAutoscaler(p, cfg) for p in AUTOSCALED_POOLS}
    last_hold: dict[str, str] = {}
    try:
        while True:
            await asyncio.sleep(cfg.interval_s)
            try:
                workers = await controller.router.workers.remote()
                lat = await controller.router.recent_latency.remote(max(5.0, 5 * cfg.interval_s))
            except Exception:
                logger.exception("autoscaler: could not read the router's load")
                continue
            counts = controller.counts()
            for pool, scaler in scalers.items():
                if controller.change_in_flight(pool):
                    continue  # one change per pool at a time; its cooldown starts after
                sample = pool_sample(pool, counts[pool], workers, lat)
                d = scaler.decide(sample, time.monotonic())
                if d.delta:
                    last_hold.pop(pool, None)
                    controller.start_change("autoscale", pool, sample.replicas,
                                            sample.replicas + d.delta,
                                            f"{d.reason} | {fmt_sample(sample)}", scaler.changed)
                    continue
                # Holds: each tick at DEBUG, and at INFO whenever the reason changes.
                kind = d.reason.split(":")[0]
                log = logger.info if last_hold.get(pool) != kind else logger.debug
                last_hold[pool] = kind
                log("autoscale %s: hold at %d: %s | %s", pool, sample.replicas, d.reason,
                    fmt_sample(sample))
    finally:
        controller.cancel_changes()
