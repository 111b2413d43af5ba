"""What a scaling policy sees each interval, and what it answers: shared by the simulator, the
Ray launcher and the Kubernetes planner process, so one policy runs unchanged on all three."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class Observation:
    t: float  # seconds (monotonic or virtual)
    interval_s: float  # since the previous observation
    prefill_replicas: int  # live, not draining (starting ones included)
    decode_replicas: int
    arrivals: int  # requests received during the interval
    finished: int  # requests finished during the interval
    prompt_tokens: int  # of the finished requests
    cached_tokens: int  # of those prompt tokens, found in a prefix cache
    output_tokens: int  # of the finished requests
    queued_prompt_tokens: int = 0  # prefill pool, now
    decode_running: int = 0  # decode pool, now (incl. waiting for KV)
    kv_usage: float = 0.0  # decode pool mean, now
    ttft_p90_ms: float | None = None  # recent finished requests
    itl_p90_ms: float | None = None  # p90 of the requests' mean inter-token latency
    changing: tuple[str, ...] = ()  # pools with a change still in flight

    @property
    def rate(self) -> float:
        return self.arrivals / self.interval_s if self.interval_s > 0 else 0.0

    @property
    def mean_prompt(self) -> float | None:
        return self.prompt_tokens / self.finished if self.finished else None

    @property
    def mean_output(self) -> float | None:
        return self.output_tokens / self.finished if self.finished else None

    @property
    def cache_hit(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def replicas(self, pool: str) -> int:
        return self.prefill_replicas if pool == "prefill" else self.decode_replicas


@dataclass(frozen=True)
class PlanDecision:
    """Desired replicas per pool with the reason; ``details`` is exported as metrics."""

    prefill: int
    decode: int
    reason: str
    details: dict[str, float]

    def target(self, pool: str) -> int:
        return self.prefill if pool == "prefill" else self.decode


class ScalingPolicy(Protocol):
    def decide(self, obs: Observation) -> PlanDecision: ...

    def change_done(self, pool: str, t: float) -> None:
        """A change of ``pool`` finished (replica ready or removed)."""
