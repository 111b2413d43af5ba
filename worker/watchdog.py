"""The engine watchdog: a step that does not end turns the worker's readiness off.

The engine thread can wedge (a hung collective, a driver stall, a kernel that never returns)
while the worker's event loop keeps answering heartbeats and health checks, so nothing would
notice: requests keep coming and hang. The watchdog runs on the event loop and looks at when the
engine's current step began (``AsyncEngine.busy_since``): once a step has run for longer than
``limit_s`` it logs an error, counts a stall, and calls ``on_change(True)`` (the worker sets its
gRPC health to NOT_SERVING, and the ``kvrelay:engine_stuck`` gauge reads 1); when that step
finally ends it logs it and calls ``on_change(False)``: readiness comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ENGINE_WATCHDOG_S = 120.0  # the default limit: far beyond any healthy step (a long CPU prefill)


@dataclass(frozen=True)
class WatchdogConfig:
    limit_s: float = ENGINE_WATCHDOG_S  # a step running longer is stuck
    interval_s: float | None = None  # how often to look (None: a quarter of the limit, <= 1 s)

    def __post_init__(self) -> None:
        if not self.limit_s > 0:
            raise ValueError(f"the engine watchdog limit must be positive, got {self.limit_s}")
        if self.interval_s is not None and not self.interval_s > 0:
            raise ValueError(f"the watchdog interval must be positive, got {self.interval_s}")

    @property
    def period_s(self) -> float:
        return self.interval_s if self.interval_s is not None else min(1.0, self.limit_s / 4)


class EngineWatchdog:
    def __init__(self, busy_since: Callable[[], float | None], config: WatchdogConfig,
                 on_change: Callable[[bool], None], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._busy_since = busy_since  # monotonic start of the step running now (None: idle)
        self.config = config
        self._on_change = on_change
        self._clock = clock
        self.stuck = False
        self.num_stalls = 0
        self._task: asyncio.Task[None] | None = None

    def check(self) -> bool:
        """Look once; whether the engine is stuck now (calls ``on_change`` on a change)."""
        since = self._busy_since()
        running = 0.0 if since is None else self._clock() - since
        stuck = running > self.config.limit_s
        if stuck and not self.stuck:
            self.num_stalls += 1
            logger.error("engine step running for %.1f s (limit %.1f s): the engine looks "
                         "stuck; readiness off until it ends", running, self.config.limit_s)
        elif self.stuck and not stuck:
            logger.warning("the stuck engine step ended: readiness back on")
        if stuck != self.stuck:
            self.stuck = stuck
            self._on_change(stuck)
        return stuck

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-watchdog")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.period_s)
            try:
                self.check()
            except Exception:  # never let the watchdog die
                logger.exception("engine watchdog check failed")
