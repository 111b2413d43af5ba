"""Goodput search: the highest Poisson rate at which enough requests meet the SLO.

Bisection over a range of rates, or a sweep of given rates; what a rate's attainment is comes
from the caller (``bench.serving.loadgen.benchmark_goodput`` runs a fresh load at each probed rate).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

# the load generator's logger: its log lines read as before
logger = logging.getLogger("bench.serving.loadgen")

GOODPUT_THRESHOLD = 0.9


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
