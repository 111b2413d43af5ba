"""A request's state inside the engine: a plain object with counters and derived properties."""

from __future__ import annotations

import enum
import time
from typing import Any

from kvrelay.engine.outputs import FinishReason
from kvrelay.engine.prefix_hash import salt_root
from kvrelay.engine.sampling_params import SamplingParams

__all__ = ["FinishReason", "Sequence", "SequenceStatus"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)prefill
    RUNNING = "running"  # holds blocks, is scheduled every step
    WAITING_FOR_KV = "waiting_for_kv"  # holds blocks reserved for KV another engine writes
    FINISHED = "finished"


class Sequence:
    """Tokens so far plus the counters the scheduler and block manager need.

    ``num_computed_tokens`` tokens have their KV in the cache; the next step computes
    ``token_ids[num_computed_tokens:]`` (or a chunk of it). The last token never has KV yet once
    prefill is done, so a decode step always computes exactly one token.
    """

    __slots__ = (
        "arrival_time",
        "block_table",
        "finish_reason",
        "first_scheduled_time",
        "fork_firsts",
        "generator",
        "grammar",
        "hash_root",
        "kv_ready",
        "kv_transfer_params",
        "logprobs",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "page_tables",
        "prompt_logprobs",
        "request_id",
        "sampling",
        "status",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        kv_transfer_params: Any | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        assert prompt_token_ids, "a sequence needs at least one prompt token"
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.block_table: list[int] = []
        # Under the hybrid KV layout (``engine/hybrid_blocks.py``): per layer group, the page of
        # each of ``block_table``'s blocks (0 where a windowed group gave it back); else None.
        self.page_tables: list[list[int]] | None = None
        self.finish_reason: FinishReason | None = None
        self.kv_transfer_params = kv_transfer_params
        self.kv_ready = False
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.num_preemptions = 0
        self.generator: Any | None = None  # per-request torch.Generator when seeded
        self.logprobs: list[Any] = []
        # A GrammarMatcher under structured output (built by the engine that samples), fed
        # every token appended.
        self.grammar: Any | None = None
        # n > 1 on a prefill: the first tokens (with logprobs) of choices 1..n-1.
        self.fork_firsts: list[tuple[int, Any]] = []
        # sampling.prompt_logprobs: entry p is the logprob of prompt token p + 1.
        self.prompt_logprobs: list[Any] = []
        self.hash_root = salt_root(cache_salt)  # its prefix-cache namespace

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def penalized_output_token_ids(self) -> list[int]:
        """Output tokens for the presence/frequency penalties: this engine's output plus what
        the request produced before it was resumed here (the prompt's tail)."""
        resumed = min(self.sampling.resumed_output_tokens, self.num_prompt_tokens)
        return self.token_ids[self.num_prompt_tokens - resumed:]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """True once the sequence only needs one token computed per step."""
        return self.num_uncomputed_tokens == 1 and self.num_output_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)  # a refused token leaves it in error: check_stop
