"""The SLO planner: each interval, observed load -> predicted load -> replicas per pool.

1. The observed rate feeds the predictor; the load mix (mean prompt and output length, prefix
   cache hit rate) is smoothed from the requests that finished.
2. Corrections: the profile's prefill times are scaled by the factor that makes the sizing's
   TTFT p90 at the observed rate and replicas equal to the observed TTFT p90 (likewise decode:
   the ITL at the observed batch against the observed ITL p90). They are smoothed and clamped,
   so queueing, cache hits and a replica slower or faster than profiled all show up there.
3. The highest predicted rate up to one horizon ahead (a replica's start-up plus an
   interval), plus the predictor's recent error as headroom, and the prefill backlog to
   drain, are sized into replicas per pool with ``margin`` of each SLO kept free. The backlog
   counted is the queue now plus its observed growth carried on for a start-up: what a
   replica started now finds.
4. The total is held within ``max_replicas`` (shortfall shared in proportion to need); a step
   moves a pool by at most ``up_step``/``down_step``; a pool with a change in flight holds
   unless it needs more still (a growing backlog does not wait out a start-up per replica);
   scale-down waits until the need has stayed lower for ``down_delay_s`` (with a known period
   of the load, ``periodic_down_delay_s``: the forecast already sees its return). After an
   abrupt drop, the rate it fell from is kept for ``burst_memory_s`` unless the load's
   period is known.

Every decision carries a reason and numbers (``PlanDecision.details``) that are logged and
exported as metrics. Pure: no I/O, time comes from the observation.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from kvrelay.deploy.planner.predictor import make_predictor
from kvrelay.deploy.planner.profile import Profile
from kvrelay.deploy.planner.signals import POOLS, Observation, PlanDecision
from kvrelay.deploy.planner.sizing import (
    Load,
    decode_itl_p90_s,
    fit_correction,
    prefill_ttft_p90_s,
    required,
)

MIX_ALPHA = 0.3  # smoothing of the load mix (prompt and output length, cache hit rate)
MIN_FIT_UTILIZATION = 0.4  # of the prefill pool, for its TTFT to correct the profile
# A burst: the (3-interval mean) rate falls by SPIKE_DROP within SPIKE_INTERVALS intervals.
SPIKE_DROP, SPIKE_INTERVALS = 0.4, 5


@dataclass(frozen=True)
class PlannerConfig:
    ttft_slo_ms: float
    itl_slo_ms: float
    max_replicas: int = 4  # prefill + decode
    min_prefill: int = 1
    min_decode: int = 1
    interval_s: float = 2.0
    predictor: str = "seasonal"
    margin: float = 0.15  # of each SLO kept free
    up_step: int = 2
    down_step: int = 1
    down_delay_s: float = 20.0
    # while the load follows a known period: the forecast covers the start-up horizon, so a
    # scale-down only waits out a reading or two
    periodic_down_delay_s: float = 4.0
    correction_alpha: float = 0.3
    min_samples: int = 8  # finished requests an interval needs to update the corrections
    startup_s: float | None = None  # default: the profile's
    settle_s: float = 12.0  # after a pool's change, before its latency corrects the profile
    burst_memory_s: float = 120.0  # size for at least the peak rate of this window (0: off)

    def __post_init__(self) -> None:
        if self.ttft_slo_ms <= 0 or self.itl_slo_ms <= 0:
            raise ValueError("SLOs must be positive")
        if self.min_prefill < 1 or self.min_decode < 1 or \
                self.max_replicas < self.min_prefill + self.min_decode:
            raise ValueError("need min_prefill, min_decode >= 1 and max_replicas >= their sum")
        if not 0 <= self.margin < 1 or self.up_step < 1 or self.down_step < 1:
            raise ValueError("margin in [0, 1), up_step and down_step >= 1")
        if self.down_delay_s < 0 or self.periodic_down_delay_s < 0:
            raise ValueError("down delays must not be negative")
        make_predictor(self.predictor)


class Planner:
    def __init__(self, profile: Profile, config: PlannerConfig):
        self.profile, self.cfg = profile, config
        self.predictor = make_predictor(config.predictor)
        self.corr = {"prefill": 1.0, "decode": 1.0}
        self.prompt_len: float | None = None
        self.output_len: float | None = None
        self.cache_hit = 0.0
        self._rate = 0.0  # smoothed current rate (for the corrections)
        self._last_change = {p: -math.inf for p in POOLS}
        self._peak = 0.0
        self._rates: deque[tuple[float, float]] = deque()
        self._lower_since: dict[str, float | None] = {p: None for p in POOLS}
        self._queued: float | None = None

    def change_done(self, pool: str, t: float) -> None:
        self._last_change[pool] = t

    def _learn(self, obs: Observation) -> None:
        a = MIX_ALPHA
        self.predictor.update(obs.rate)
        if self.cfg.burst_memory_s > 0:  # the highest 3-interval mean rate in the window
            self._rates.append((obs.t, obs.rate))
            while self._rates and self._rates[0][0] < obs.t - self.cfg.burst_memory_s:
                self._rates.popleft()
            xs = [r for _, r in self._rates]
            m3 = [sum(xs[i:i + 3]) / len(xs[i:i + 3]) for i in range(len(xs))]
            # Only load that vanished abruptly (a burst) is expected back, at the level it fell
            # from: a gradual decline (a ramp or a day ending) is followed, not held at its
            # peak, even when its last step is abrupt.
            k = SPIKE_INTERVALS
            self._peak = max((m3[i] for i in range(len(m3) - 1)
                              if min(m3[i + 1:i + 1 + k]) <= (1 - SPIKE_DROP) * m3[i]),
                             default=0.0)
        self._rate = obs.rate if self._rate == 0 else self._rate + 0.5 * (obs.rate - self._rate)
        if obs.finished:
            for name, x in (("prompt_len", obs.mean_prompt), ("output_len", obs.mean_output)):
                old = getattr(self, name)
                setattr(self, name, x if old is None else old + a * (x - old))
            self.cache_hit += a * (obs.cache_hit - self.cache_hit)
        if obs.finished < self.cfg.min_samples or self.prompt_len is None:
            return
        a = self.cfg.correction_alpha
        load = self._load(self._rate, 0.0)
        # Fit only near a steady state: a backlog, or a change whose effect the latency window
        # still mixes in, would read as slow replicas (and the sizing adds backlog on its own).
        backlog = obs.queued_prompt_tokens > 2 * self.profile.max_num_batched_tokens * max(
            1, obs.prefill_replicas)
        settled = {p: obs.t - self._last_change[p] > self.cfg.settle_s and p not in obs.changing
                   for p in POOLS}
        # A faster-than-profiled reading counts only under real load: at low utilization TTFT
        # is a lone prefill's latency and says little about throughput. A slower one always does.
        busy = self._utilization(load, obs.prefill_replicas) >= MIN_FIT_UTILIZATION
        if obs.ttft_p90_ms is not None and settled["prefill"] and not backlog:
            n = obs.prefill_replicas
            k = fit_correction(lambda c: prefill_ttft_p90_s(self.profile, load, n, c),
                               obs.ttft_p90_ms / 1000)
            # (a faster reading at low load still pulls a quarter as hard, so a correction
            # inflated by an overload does not stay up until the next one)
            w = a if busy or k > self.corr["prefill"] else a / 4
            self.corr["prefill"] += w * (k - self.corr["prefill"])
        b = obs.decode_running / max(1, obs.decode_replicas)
        if obs.itl_p90_ms is not None and settled["decode"] and not backlog and b >= 2:
            ctx = load.prompt_len + load.output_len / 2
            model = self.profile.itl_s(max(1.0, b + 1.28 * math.sqrt(b)), ctx)
            k = min(8.0, max(0.25, obs.itl_p90_ms / 1000 / model))
            self.corr["decode"] += a * (k - self.corr["decode"])

    def _projected_backlog(self, obs: Observation, startup: float) -> float:
        """Prompt tokens queued when a replica started now can serve: today's queue plus its
        growth over the last interval carried on for a start-up (sizing for today's queue alone
        chases a backlog that keeps growing while each new replica starts; the growth is
        observed, so a load mix the finished requests do not show yet counts too)."""
        q = float(obs.queued_prompt_tokens)
        prev, self._queued = self._queued, q
        if prev is None or obs.interval_s <= 0:
            return q
        return q + max(0.0, (q - prev) / obs.interval_s) * startup

    def _utilization(self, load: Load, n: int) -> float:
        eff = max(1.0, load.prompt_len * (1.0 - load.cache_hit))
        mu = self.profile.prefill_tokens_per_s(math.ceil(eff)) / eff / self.corr["prefill"]
        return load.rate / (max(1, n) * mu)

    def _load(self, rate: float, backlog: float) -> Load:
        startup = self.profile.startup_s if self.cfg.startup_s is None else self.cfg.startup_s
        return Load(rate=rate, prompt_len=self.prompt_len or 512.0,
                    output_len=self.output_len or 64.0, cache_hit=self.cache_hit,
                    backlog_tokens=backlog, drain_s=startup + self.cfg.interval_s)

    def decide(self, obs: Observation) -> PlanDecision:
        c = self.cfg
        self._learn(obs)
        startup = self.profile.startup_s if c.startup_s is None else c.startup_s
        horizon = (startup + c.interval_s) / c.interval_s
        # the most the load will ask of a replica started now, or of one kept until it is up
        rate = max(self.predictor.predict(k) for k in range(1, math.ceil(horizon) + 1)) \
            + self.predictor.error
        if self.predictor.period is None and self._peak > 0:  # (a period forecasts the bursts)
            # A burst coming back to the level it was remembered at is not a ramp: the trend of
            # its rising edge would carry the forecast past that level.
            if obs.rate <= self._peak + self.predictor.error:
                rate = min(rate, self._peak + self.predictor.error)
            rate = max(rate, self._peak)
        load = self._load(rate, self._projected_backlog(obs, startup))
        ttft_t = c.ttft_slo_ms / 1000 * (1 - c.margin)
        itl_t = c.itl_slo_ms / 1000 * (1 - c.margin)
        cap = c.max_replicas - min(c.min_prefill, c.min_decode)
        need_p, need_d = required(self.profile, load, ttft_t, itl_t, cap,
                                  self.corr["prefill"], self.corr["decode"])
        need_p, need_d = max(need_p, c.min_prefill), max(need_d, c.min_decode)
        # Feedback beside the model: an SLO missed now while the model sees no need means the
        # model is behind (a load-mix shift not yet in the finished requests' means).
        guard = []
        if obs.ttft_p90_ms is not None and obs.ttft_p90_ms > c.ttft_slo_ms \
                and need_p <= obs.prefill_replicas and obs.queued_prompt_tokens > 0:
            need_p = obs.prefill_replicas + 1
            guard.append("TTFT p90 over the SLO with a backlog")
        if obs.itl_p90_ms is not None and obs.itl_p90_ms > c.itl_slo_ms \
                and need_d <= obs.decode_replicas:
            need_d = obs.decode_replicas + 1
            guard.append("ITL p90 over the SLO")
        need_p, need_d = min(need_p, cap), min(need_d, cap)
        need_p, need_d = self._fit_budget(need_p, need_d)
        steps = {pool: self._step(pool, obs.replicas(pool), need, obs)
                 for pool, need in (("prefill", need_p), ("decode", need_d))}
        targets = {pool: t for pool, (t, _) in steps.items()}
        # The other pool may still sit above its need (its scale-down waits): a scale-up never
        # takes the total past the budget meanwhile.
        for pool, other in (("prefill", "decode"), ("decode", "prefill")):
            cur = obs.replicas(pool)
            if targets[pool] > cur and targets[pool] + targets[other] > c.max_replicas:
                targets[pool] = max(cur, c.max_replicas - targets[other])
                steps[pool] = (targets[pool], "scale up held by the replica budget")
        why = [f"{pool} {obs.replicas(pool)}->{t} ({r})" for pool, (t, r) in steps.items()]
        ttft_pred = prefill_ttft_p90_s(self.profile, load, targets["prefill"],
                                       self.corr["prefill"])
        itl_pred = decode_itl_p90_s(self.profile, load, targets["decode"], self.corr["decode"])
        details = {
            "observed_rate": obs.rate, "predicted_rate": rate,
            "required_prefill": float(need_p), "required_decode": float(need_d),
            "ttft_margin": 1 - ttft_pred * 1000 / c.ttft_slo_ms,
            "itl_margin": 1 - itl_pred * 1000 / c.itl_slo_ms,
            "correction_prefill": self.corr["prefill"], "correction_decode": self.corr["decode"],
            "cache_hit": self.cache_hit,
            "load_period_s": (self.predictor.period or 0) * c.interval_s,
        }
        period = self.predictor.period
        reason = (f"predicted {rate:.1f} req/s (seen {obs.rate:.1f}"
                  + (f", load repeats every {period * c.interval_s:.0f}s" if period else "")
                  + f"), prompt "
                  f"{load.prompt_len:.0f} (hit {self.cache_hit:.0%}) output "
                  f"{load.output_len:.0f}: need {need_p}P {need_d}D"
                  + "".join(f" ({g})" for g in guard) + "; " + "; ".join(why))
        return PlanDecision(targets["prefill"], targets["decode"], reason, details)

    def _fit_budget(self, p: int, d: int) -> tuple[int, int]:
        c = self.cfg
        over = p + d - c.max_replicas
        if over <= 0:
            return p, d
        # share the shortfall in proportion to need, never below a pool's minimum
        cut_p = min(p - c.min_prefill, round(over * p / (p + d)))
        cut_d = min(d - c.min_decode, over - cut_p)
        cut_p = over - cut_d
        return p - cut_p, d - cut_d

    def _step(self, pool: str, cur: int, need: int, obs: Observation) -> tuple[int, str]:
        c = self.cfg
        if pool in obs.changing and need <= cur:
            self._lower_since[pool] = None
            return cur, "a change is in flight"
        if need > cur:
            self._lower_since[pool] = None
            return min(need, cur + c.up_step), "scale up"
        if need == cur:
            self._lower_since[pool] = None
            return cur, "hold"
        since = self._lower_since[pool]
        if since is None:
            self._lower_since[pool] = since = obs.t
        delay = c.down_delay_s if self.predictor.period is None else \
            min(c.down_delay_s, c.periodic_down_delay_s)
        wait = max(since, self._last_change[pool]) + delay - obs.t
        if wait > 0:
            return cur, f"lower need, scale-down in {wait:.0f}s"
        self._lower_since[pool] = None
        return max(need, cur - c.down_step), "scale down"
