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


@dataclass
class DecodeReplica(Replica):
    # the batch, a heap of (the step each request finishes at, join order, request)
    running: list = field(default_factory=list)
    pending: list = field(default_factory=list)
    kv_used: int = 0
    steps: int = 0  # decode steps so far, and their summed time
    step_s: float = 0.0
    ctx: int = 0  # sum over running requests of prompt_len + gen (as offset)
    # The steps to the batch's next finish, computed ahead (no shared cores): each one's end
    # time and ``step_s`` after it; the event of ``plan[cut]`` ends them (``epoch`` tells a
    # superseded one: a request joining moves the cut to the first step ending after it).
    plan: list = field(default_factory=list)
    cut: int = 0
    epoch: int = 0
