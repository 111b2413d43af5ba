"""Per-pool autoscaling policy: pure decisions from load samples (no Ray, no I/O).

Prefill scales on queued prompt tokens per replica (and recent TTFT against an optional SLO);
decode scales on KV usage and running sequences per replica (and recent inter-token latency).
Hysteresis: scale up when a signal stays above its target for ``sustain`` ticks, down when
every signal stays below ``down_fraction`` of its target for ``idle_ticks`` ticks; after any
change a ``cooldown_s`` passes before the next (the controller restarts it with ``changed``
when a change has finished: starting a replica takes a while). Every decision, a hold too,
carries its reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class PoolBounds:
    min_replicas: int = 1
    max_replicas: int = 4

    def __post_init__(self) -> None:
        if not (0 <= self.min_replicas <= self.max_replicas) or self.max_replicas < 1:
            raise ValueError("need 0 <= min_replicas <= max_replicas and max_replicas >= 1")


@dataclass(frozen=True)
class AutoscaleConfig:
    prefill: PoolBounds = PoolBounds()
    decode: PoolBounds = PoolBounds()
    prefill_queued_tokens_per_replica: int = 4096
    decode_kv_usage: float = 0.75
    decode_running_per_replica: int = 48
    ttft_slo_ms: float | None = None
    itl_slo_ms: float | None = None
    down_fraction: float = 0.3
    sustain: int = 2
    idle_ticks: int = 5
    cooldown_s: float = 10.0
    interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not (0 < self.down_fraction < 1):
            raise ValueError("down_fraction must be in (0, 1)")
        if self.sustain < 1 or self.idle_ticks < 1 or self.interval_s <= 0:
            raise ValueError("sustain, idle_ticks >= 1 and interval_s > 0")
        if self.cooldown_s < 0:
            raise ValueError("cooldown_s must be non-negative")
        if (self.prefill_queued_tokens_per_replica <= 0 or self.decode_kv_usage <= 0
                or self.decode_running_per_replica <= 0):
            raise ValueError("scaling targets must be positive")


class PoolSample(NamedTuple):
    replicas: int
    queued_prompt_tokens: int = 0  # summed over the pool
    kv_usage: float = 0.0  # mean over the pool
    running: int = 0  # summed over the pool (incl. waiting for KV)
    ttft_ms: float | None = None  # recent p90 at the router
    itl_ms: float | None = None


class Decision(NamedTuple):
    delta: int  # +1, -1 or 0
    reason: str


class PoolAutoscaler:
    def __init__(self, pool: str, config: AutoscaleConfig):
        assert pool in ("prefill", "decode")
        self.pool = pool
        self.config = config
        self.bounds = config.prefill if pool == "prefill" else config.decode
        self._over = 0
        self._under = 0
        self._last_change = float("-inf")

    def _pressure(self, s: PoolSample) -> list[tuple[str, float]]:
        """(signal description, value / target) for every signal of this pool."""
        c, n = self.config, max(1, s.replicas)
        if self.pool == "prefill":
            out = [(f"queued prompt tokens {s.queued_prompt_tokens} over {n} replicas "
                    f"(target {c.prefill_queued_tokens_per_replica}/replica)",
                    s.queued_prompt_tokens / n / c.prefill_queued_tokens_per_replica)]
            if c.ttft_slo_ms and s.ttft_ms is not None:
                out.append((f"TTFT p90 {s.ttft_ms:.0f} ms (SLO {c.ttft_slo_ms:.0f} ms)",
                            s.ttft_ms / c.ttft_slo_ms))
            return out
        out = [(f"KV usage {s.kv_usage:.0%} (target {c.decode_kv_usage:.0%})",
                s.kv_usage / c.decode_kv_usage),
               (f"running {s.running} over {n} replicas (target "
                f"{c.decode_running_per_replica}/replica)",
                s.running / n / c.decode_running_per_replica)]
        if c.itl_slo_ms and s.itl_ms is not None:
            out.append((f"ITL p90 {s.itl_ms:.0f} ms (SLO {c.itl_slo_ms:.0f} ms)",
                        s.itl_ms / c.itl_slo_ms))
        return out

    def decide(self, s: PoolSample, now: float) -> Decision:
        b, c = self.bounds, self.config
        if s.replicas < b.min_replicas:
            return self._change(+1, f"below the minimum of {b.min_replicas} replicas", now)
        if s.replicas > b.max_replicas:
            return self._change(-1, f"above the maximum of {b.max_replicas} replicas", now)
        pressure = self._pressure(s)
        worst = max(pressure, key=lambda p: p[1])
        self._over = self._over + 1 if worst[1] > 1.0 else 0
        self._under = self._under + 1 if worst[1] < c.down_fraction else 0
        if now - self._last_change < c.cooldown_s:
            return Decision(0, f"cooldown: {c.cooldown_s - (now - self._last_change):.1f}s "
                               f"left; {worst[0]}")
        if self._over >= c.sustain:
            if s.replicas < b.max_replicas:
                return self._change(+1, f"{worst[0]} for {self._over} ticks", now)
            return Decision(0, f"at the maximum of {b.max_replicas} replicas: {worst[0]}")
        if self._under >= c.idle_ticks and s.replicas > b.min_replicas:
            return self._change(-1, f"idle: {worst[0]} for {self._under} ticks", now)
        return Decision(0, f"steady: {worst[0]}")

    def changed(self, now: float) -> None:
        """A change was made (or has just finished): restart the cooldown and the counts."""
        self._last_change = now
        self._over = self._under = 0

    def _change(self, delta: int, reason: str, now: float) -> Decision:
        self.changed(now)
        return Decision(delta, reason)
