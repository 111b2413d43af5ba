"""What the simulator (``simulator.py``) tracks of each request and replica in virtual time."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvrelay.deploy.planner.trace import TraceRequest


@dataclass
class SimRequest:
    tr: TraceRequest
    left: int = 0  # prompt tokens still to compute
    done: int = 0  # prompt tokens with KV (cached + computed)
    cached: int = 0
    dec: DecodeReplica | None = None
    ttft: float | None = None
    # tokens after the first and their summed ITL; while it decodes, minus its replica's
    # ``steps``/``step_s`` when it joined (``Simulator._decode_step``): the difference is its own
    itl_sum: float = 0.0
    gen: int = 0
    failed: bool = False
    end: float | None = None


@dataclass
class Replica:
    created: float
    ready_at: float
    draining: bool = False
    removed: float | None = None
    busy: bool = False

    def ready(self, now: float) -> bool:
        return self.ready_at <= now and not self.draining


@dataclass
class PrefillReplica(Replica):
    queue: deque = field(default_factory=deque)
    queued_tokens: int = 0
    cache: OrderedDict = field(default_factory=OrderedDict)


class StepPlan:
    """``count`` decode steps of one batch from time ``t0``: step ``m`` takes ``first + m *
    growth`` seconds (``Profile.decode_line``: a step's time is linear in the batch's context,
    which grows by the batch size each step), so when each ends is a closed form, not a list of
    ~a million floats a replay (the planner's oracle simulates 110 of them)."""

    __slots__ = ("count", "first", "growth", "s0", "t0")

    def __init__(self, t0: float, s0: float, first: float, growth: float, count: int):
        self.t0, self.s0, self.first, self.growth, self.count = t0, s0, first, growth, count

    def _elapsed(self, m: int) -> float:
        """Seconds from ``t0`` to the end of step ``m`` (0-based)."""
        return (m + 1) * self.first + self.growth * (m * (m + 1) // 2)

    def end(self, m: int) -> tuple[float, float]:
        """When step ``m`` ends, and the batch's summed step time (``step_s``) then."""
        e = self._elapsed(m)
        return self.t0 + e, self.s0 + e

    def ended_by(self, now: float) -> int:
        """How many steps have ended by ``now`` (the first step still running then)."""
        lo, hi = 0, self.count
        while lo < hi:
            mid = (lo + hi) // 2
            if self.t0 + self._elapsed(mid) <= now:
                lo = mid + 1
            else:
                hi = mid
        return lo


@dataclass
class DecodeReplica(Replica):
    # the batch, a heap of (the step each request finishes at, join order, request)
    running: list = field(default_factory=list)
    pending: list = field(default_factory=list)
    kv_used: int = 0
    steps: int = 0  # decode steps so far, and their summed time
    step_s: float = 0.0
    ctx: int = 0  # sum over running requests of prompt_len + gen (as offset)
    # The steps to the batch's next finish, known ahead (no shared cores); the event of
    # ``plan.end(cut)`` ends them (``epoch`` tells a superseded one: a request joining moves the
    # cut to the first step ending after it). None: no steps planned.
    plan: StepPlan | None = None
    cut: int = 0
    epoch: int = 0
