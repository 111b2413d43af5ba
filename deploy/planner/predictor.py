"""Next-interval request rate from the rates seen so far: two simple, explained predictors.

* ``ewma``: the smoothed level, ``L <- L + alpha (x - L)``; predicts ``L`` for any horizon.
  Lags a ramp by about ``(1 - alpha) / alpha`` intervals.
* ``holt``: the level plus a smoothed trend (Holt's linear method),
  ``L <- alpha x + (1 - alpha)(L + T)``, ``T <- beta (L - L_prev) + (1 - beta) T``; predicts
  ``L + h T``. Follows a ramp without lag, overshoots a little where a ramp ends.

* ``seasonal``: where the rate repeats a pattern (``season``: a period found by
  autocorrelation), what the same phase of the last periods saw, shifted by the recent
  deviation from it and never below the current level: load that returns on a schedule is
  expected a start-up ahead instead of chased after it arrived. With no period found it is
  ``holt``.

All keep an EWMA of their own absolute one-step error, which the planner adds as headroom
(a Poisson count over a short interval is noisy: the error is mostly that noise).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.deploy.planner.season import Season


@dataclass
class Predictor:
    alpha: float = 0.4
    beta: float = 0.2
    trend: bool = True  # False: plain EWMA
    level: float | None = None
    slope: float = 0.0
    error: float = 0.0
    season: Season | None = None
    _last_forecast: float | None = None

    @property
    def name(self) -> str:
        return "seasonal" if self.season is not None else "holt" if self.trend else "ewma"

    @property
    def period(self) -> int | None:
        """The load's period in intervals, while one is trusted."""
        return self.season.period if self.season is not None else None

    def update(self, x: float) -> None:
        if self.season is not None:
            self.season.update(x)
        if self.level is None:
            self.level = x
            self._last_forecast = x
            return
        if self._last_forecast is not None:
            self.error += self.alpha * (abs(x - self._last_forecast) - self.error)
        prev = self.level
        if self.trend:
            self.level = self.alpha * x + (1 - self.alpha) * (self.level + self.slope)
            self.slope = self.beta * (self.level - prev) + (1 - self.beta) * self.slope
        else:
            self.level += self.alpha * (x - self.level)
        self._last_forecast = self.predict(1)

    def predict(self, horizon: float = 1.0) -> float:
        """Rate ``horizon`` intervals ahead (never negative)."""
        if self.level is None:
            return 0.0
        if self.season is not None:
            seen = self.season.forecast(max(1, round(horizon)))
            if seen is not None:  # the pattern carries the shape; never below today's level
                return max(seen, self.level)
        return max(0.0, self.level + (self.slope * horizon if self.trend else 0.0))


PREDICTORS = ("holt", "ewma", "seasonal")


def make_predictor(name: str) -> Predictor:
    if name == "holt":
        return Predictor(alpha=0.4, beta=0.2, trend=True)
    if name == "ewma":
        return Predictor(alpha=0.4, trend=False)
    if name == "seasonal":
        return Predictor(alpha=0.4, beta=0.2, trend=True, season=Season())
    raise ValueError(f"unknown predictor {name!r} ({' | '.join(PREDICTORS)})")


def one_step_error(name: str, series: list[float], horizon: int = 1) -> float:
    """Mean absolute error of ``name`` predicting ``series[i + horizon]`` from ``series[:i+1]``,
    relative to the series' mean (the benchmark's predictor evaluation)."""
    p, errs = make_predictor(name), []
    for i, x in enumerate(series):
        p.update(x)
        if i + horizon < len(series):
            errs.append(abs(p.predict(horizon) - series[i + horizon]))
    mean = sum(series) / len(series) if series else 0.0
    return (sum(errs) / len(errs) / mean) if errs and mean > 0 else 0.0
