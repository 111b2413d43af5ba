"""What ``EngineCore`` hands its callers: the outputs of a step, the reservation a decode
engine makes for KV another engine writes, the engine's counters, and the errors a request can be
refused with.

Plain values, kept apart from the engine so that the layers above it (``AsyncEngine``, the
workers, their metrics) can be read without how the engine makes them. They stay importable
from :mod:`kvrelay.engine.engine_core`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvrelay.engine.cpu.prefetch_tuner import PrefetchChoices
from kvrelay.engine.outputs import ErrorKind
from kvrelay.engine.sampler import TokenLogprob
from kvrelay.engine.sequence import FinishReason
from kvrelay.engine.step_cost import StepCostFit
from kvrelay.engine.tiers.media import TierStats


class EngineOverloaded(RuntimeError):
    """The engine cannot take this request now (queue full or no KV blocks); retry later."""


class RequestIdInUse(ValueError):
    """An earlier request still holds this id here (it may be letting go of it: transient)."""


@dataclass
class RequestOutput:
    """New tokens of one request since its last output."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    error: str | None = None
    error_kind: ErrorKind | None = None  # set with FinishReason.ERROR
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_arrived: bool = False  # a reserved request's KV is complete (no tokens in this output)
    scheduled_at: float | None = None  # time.monotonic() of the request's first step
    computed_at: float | None = None  # time.monotonic() when these tokens were sampled
    # n > 1 on a prefill: the first tokens (and logprobs) of choices 1..n-1.
    fork_firsts: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)
    # sampling.prompt_logprobs, on the output with the first token: prompt tokens 1.. (the
    # first prompt token has none).
    prompt_logprobs: list[TokenLogprob] | None = None


class Reservation(NamedTuple):
    """The blocks a decode engine holds for a prompt whose KV another engine writes."""

    block_ids: list[int]
    num_cached_tokens: int  # leading prompt tokens whose KV this engine already holds
    # Under the hybrid KV layout (``engine/hybrid_kv.py``): each block's page per layer group,
    # block after block, -1 where no layer of the group reads the block from the handoff on
    # (those pages were never taken, or went back at once). What the sender writes.
    page_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load and counters (the worker's metrics and load reports)."""

    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    num_sending: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    waiting_prompt_tokens: int
    # The online step-time fit (None until it has seen enough steps), the prefill budget of the
    # latest step that carried decodes, and how many steps the TPOT target has capped.
    step_cost: StepCostFit | None = None
    prefill_budget: int = 0
    max_step_tokens: int = 0  # the configured prefill token budget of one step
    num_capped_steps: int = 0
    num_cap_yields: int = 0  # steps in which the ITL cap yielded to a backed-up queue
    kv_transfer: dict[str, int] = field(default_factory=dict)  # the connector's counters
    gemm_prefetch: PrefetchChoices | None = None  # the online next-panel prefetch choices
    # The tiers below the KV pool (host, disk), by medium; empty without --kv-offload-*.
    kv_tiers: dict[str, TierStats] = field(default_factory=dict)
    # Prefix pull (engine/prefix_shares.py): blocks lent to peers, read from peers, and imports
    # that ended incomplete (their blocks dropped, the prefix recomputed).
    prefix_shares: dict[str, int] = field(default_factory=dict)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks
