"""A recurring pattern in the request rate: its period, found by autocorrelation, and what the
rate was at the same phase of the last periods.

Load that comes back on a schedule (a batch job every few minutes, a client that polls in
waves) cannot be followed by a trend predictor: the rise is over before a replica started for
it is up. Its shape repeats, though, so the rate one start-up ahead is the
rate seen one period before that moment. This is the seasonal part of Holt-Winters, with the
period found rather than configured:

* the series is smoothed over ``SMOOTH`` intervals and differenced, so a level or a trend (a
  ramp, whose values correlate at every lag) leaves only noise and a repeating shape leaves
  its edges;
* a lag needs ``MIN_PAIRS`` pairs of changes, and a correlation of ``Z_NOISE / sqrt(pairs)``
  or more: on a short history chance correlations are high;
* the period is the shortest lag whose correlation of those changes is at least 0.9 of the
  best one (a multiple of the period correlates as well), if that best is ``min_corr`` or
  more, and the window holds ``min_periods`` of it;
* the pattern at a phase is the mean, over the last ``periods`` periods, of the largest rate
  within one interval of that phase (a pattern a little off its beat still counts); the
  forecast is the pattern plus the smoothed deviation of the recent rates from it, so a load
  that keeps its shape but shifts its level is followed.

Periods from ``min_period`` intervals to half the ``window`` are found (16 s to 400 s at the
planner's 2 s interval); a daily cycle is the trend predictor's to follow. Pure: the caller
feeds one rate per interval.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

SMOOTH = 3  # intervals averaged before differencing (a Poisson count per interval is noisy)
MIN_PAIRS = 40  # pairs of changes a lag's correlation needs (fewer: chance correlations)
Z_NOISE = 5.0  # a lag's correlation must also reach Z_NOISE / sqrt(its pairs)


@dataclass
class Season:
    min_period: int = 8  # intervals
    window: int = 400  # intervals of history kept
    min_corr: float = 0.5
    min_periods: float = 2.0  # periods the window must hold before one is trusted
    periods: int = 3  # periods averaged in a forecast
    refit_every: int = 5  # intervals between period searches
    alpha: float = 0.4  # smoothing of the deviation from the pattern
    period: int | None = None
    corr: float = 0.0
    deviation: float = 0.0  # smoothed (rate - the pattern at its phase): a level shift
    _xs: deque[float] = field(default_factory=deque)
    _since_fit: int = 0

    def update(self, x: float) -> None:
        self._xs.append(x)
        while len(self._xs) > self.window:
            self._xs.popleft()
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self._since_fit = 0
            was = self.period
            self.period, self.corr = find_period(list(self._xs), self.min_period,
                                                 self.min_corr, self.min_periods)
            if self.period != was:
                self.deviation = 0.0
        seen = self.pattern(0)
        if seen is not None:
            self.deviation += self.alpha * (x - seen - self.deviation)

    def forecast(self, horizon: int) -> float | None:
        """The rate ``horizon`` intervals after the last one: the pattern at that phase plus
        the current deviation from it; ``None`` while no period is trusted."""
        seen = self.pattern(horizon)
        return None if seen is None else max(0.0, seen + self.deviation)

    def pattern(self, horizon: int) -> float | None:
        """What the same phase as ``horizon`` intervals after the last one saw in the last
        periods (``None`` while no period is trusted)."""
        p, xs = self.period, self._xs
        if p is None:
            return None
        n, vals = len(xs), []
        i = n - 1 + horizon - p  # the same phase one period back ...
        while i > n - 1:  # ... or more, where the horizon reaches past a period
            i -= p
        while i >= 1 and len(vals) < self.periods:
            vals.append(max(xs[j] for j in range(i - 1, min(i + 2, n))))
            i -= p
        return sum(vals) / len(vals) if vals else None


def find_period(xs: list[float], min_period: int = 8, min_corr: float = 0.5,
                min_periods: float = 2.0) -> tuple[int | None, float]:
    """(period in intervals, its correlation) of ``xs``' smoothed changes, or (None, best)."""
    x = np.asarray(xs, dtype=np.float64)
    if len(x) < SMOOTH + 2 * min_period:
        return None, 0.0
    s = np.convolve(x, np.ones(SMOOTH) / SMOOTH, mode="valid")
    d = np.diff(s)
    d -= d.mean()
    max_lag = min(int(len(d) / min_periods), len(d) - MIN_PAIRS)
    if max_lag < min_period:
        return None, 0.0
    corr = np.zeros(max_lag + 1)
    for lag in range(min_period, max_lag + 1):
        a, b = d[lag:], d[:-lag]
        den = float(np.sqrt(np.dot(a, a) * np.dot(b, b)))
        corr[lag] = float(np.dot(a, b)) / den if den > 0 else 0.0
    # A lag with fewer pairs needs a stronger correlation: noise alone reaches ~Z/sqrt(pairs)
    # at one lag in many (each lag tried is another chance).
    pairs = len(d) - np.arange(max_lag + 1)
    need = np.maximum(min_corr, Z_NOISE / np.sqrt(np.maximum(pairs, 1)))
    best = float(corr.max())
    ok = corr >= need
    if not ok.any():
        return None, best
    best = float(corr[ok].max())
    lag = int(np.argmax(ok & (corr >= 0.9 * best)))
    return lag, float(corr[lag])
