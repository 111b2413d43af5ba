"""What a request is while the router works on it: validated spec, streamed chunks, routing
context of one pass, and the router's knobs. No I/O here."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from kvrelay.common.rpc import LEASE_TTL_S
from kvrelay.engine.outputs import FinishReason, TokenLogprob
from kvrelay.engine.prefix_hash import salt_root
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.router.policy import DEFAULT_POLICY, RouteRequest
from kvrelay.router.worker_state import Charge, WorkerState


@dataclass(frozen=True)
class RouterConfig:
    policy: str = DEFAULT_POLICY
    lease_ttl_s: float = LEASE_TTL_S
    kv_timeout_s: float = 30.0
    reserve_timeout_s: float = 5.0
    prefill_timeout_s: float = 600.0
    max_prefill_attempts: int = 3
    max_migrations: int = 2
    max_inflight: int = 512
    # Requests that may wait for an in-flight slot (None: max_inflight), each tenant its share,
    # and how long one waits before a 429 (router.fairness).
    max_queued: int | None = None
    queue_wait_s: float = 5.0
    worker_wait_s: float = 5.0  # how long a request waits for a worker to appear
    # How long a request waits for KV room on the decode pool before RESOURCE_EXHAUSTED: blocks
    # come back as requests finish, so a burst queues briefly instead of failing at once.
    kv_wait_s: float = 5.0
    # Policies that measure workers (`auto`) probe each joining worker before routing to it,
    # this long at most; a worker not measured by then serves on the cost model's priors.
    calibration_timeout_s: float = 30.0
    # Send the Prefill at once, beside the Reserve, and name its destination (SetDestination)
    # when the Reserve answers: the Reserve's round trip leaves the time to first token. Off by
    # default: on a host whose few cores the router and both pools share, the overlap slowed
    # the prefill itself by more than it saved (bench/results/pd_latency.txt); it pays where
    # the prefill worker has its own cores or GPU.
    prefill_ahead: bool = False
    # Read each decode worker's streams over one Session (one message per decode step for all
    # of its requests) instead of one RPC per request (one message per token per request).
    stream_sessions: bool = True
    # Prefix pull (router/prefix_pull.py): a prefill worker reads the prompt's prefix from
    # another worker that holds more of it instead of recomputing it. "auto": when the cost
    # model predicts the pull faster; "always": whenever one holds more; "off".
    prefix_pull: str = "off"

    def __post_init__(self) -> None:
        if self.max_prefill_attempts < 1 or self.max_migrations < 0 or self.max_inflight < 1:
            raise ValueError("max_prefill_attempts >= 1, max_migrations >= 0, max_inflight >= 1")
        if (self.max_queued is not None and self.max_queued < 0) or self.queue_wait_s < 0:
            raise ValueError("max_queued >= 0 and queue_wait_s >= 0")
        if self.prefix_pull not in ("off", "auto", "always"):
            raise ValueError(f"prefix_pull must be off, auto or always, not {self.prefix_pull!r}")


@dataclass
class GenerateSpec:
    """A validated request (frontends build it; the lifecycle trusts it)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    deadline: float | None = None  # time.monotonic() by which the request must end
    arrival: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None  # prefix-cache namespace (engine.prefix_hash.salt_root)
    # The client's span (common.tracing.from_traceparent), parent of the router's; None: a
    # trace of its own (or tracing is off).
    trace_parent: Any = None
    # Who sent it: a digest of its API key when the router checks keys, "" otherwise. Request
    # ids are unique per tenant, not across tenants; the in-flight slots are shared by tenant.
    tenant: str = ""
    # Lower is more important (vLLM's sense; 0 the default): the first served from the fair
    # queue, the last shed from it (router.fairness).
    priority: int = 0


@dataclass
class TokenChunk:
    """Tokens as a worker produced them (before detokenization and stop strings)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    finish_reason: FinishReason | None = None
    cached_prompt_tokens: int = 0
    index: int = 0  # the choice of an n > 1 request
    # sampling.prompt_logprobs: with the first token, prompt tokens 1.. (the first has none).
    prompt_logprobs: list[TokenLogprob] | None = None


class WorkerLost(Exception):
    """The worker serving a stream failed; the stream may be resumed elsewhere."""


@dataclass
class Pass:
    """Routing context of one pass of a request: the prompt with its block hashes, why this
    path was taken, and what its measurements feed."""

    req: RouteRequest
    reason: str = ""  # detail of the trace's prefill_start / local_start (decision metrics)
    # The prefill worker the lease's KV is promised to (ranked before Reserve, or pinned by a
    # warm-up probe); a retry elsewhere rebinds the lease first.
    prefill: WorkerState | None = None
    record: bool = True  # feed the cost model's measurements
    # A Prefill call under the lease ended in a way that may leave its writes landing (or is
    # still running): the lease's blocks must wait for its sender, not be reused at Release.
    writes_unsettled: bool = False
    # The load ``prefill`` was charged with when it was chosen before the Reserve (so that
    # arrivals meanwhile spread over the pool); the dispatch takes the charge over.
    claim: Charge | None = None
    # The Prefill sent beside the Reserve (``RouterConfig.prefill_ahead``) and when it left.
    ahead: asyncio.Task[wpb.PrefillResponse] | None = None
    ahead_t0: float = 0.0
    count: bool = True  # count in the routing metrics

    def drop_claim(self) -> None:
        if self.claim is not None:
            self.claim.undo()
            self.claim = None


def new_pass(spec: GenerateSpec, prompt: list[int], max_tokens: int = 1) -> Pass:
    return Pass(RouteRequest(prompt, max_tokens, salt_root(spec.cache_salt)))
