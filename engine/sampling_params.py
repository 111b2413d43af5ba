"""Per-request sampling parameters, validated where they enter."""

from __future__ import annotations

from dataclasses import dataclass, field

_INT32_MAX = 2**31 - 1
_UINT32_MAX = 2**32 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``stop`` strings are matched on detokenized text (by the output processor, not the core);
    ``stop_token_ids`` and EOS end a request at the token level; they are held as a frozenset,
    checked once per decoded token.

    Values must fit the protobuf fields that carry them between processes (``top_k`` int32,
    token ids uint32, ``temperature`` and ``top_p`` float32). A ``temperature`` below
    ``MIN_TEMPERATURE`` (but not 0) is raised to it and a ``top_p`` below ``MIN_TOP_P`` to that:
    logits divided by a float32 denormal overflow to inf and sample NaN, and a ``top_p`` that
    rounds to 0 in float32 would be refused by the worker. Both keep only the likeliest token
    anyway.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    extra: dict[str, str] = field(default_factory=dict, compare=False)

    MAX_LOGPROBS = 20
    MIN_TEMPERATURE = 1e-2
    MIN_TOP_P = 1e-6

    def __post_init__(self) -> None:
        # Accept lists from callers (JSON, gRPC) while keeping the object hashable-ish and frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (0.0 <= float(self.temperature) <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if 0.0 < self.temperature < self.MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", self.MIN_TEMPERATURE)
        if self.top_p < self.MIN_TOP_P:
            object.__setattr__(self, "top_p", self.MIN_TOP_P)
        if not isinstance(self.top_k, int) or not (-1 <= self.top_k <= _INT32_MAX):
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer up to "
                             f"{_INT32_MAX}, got {self.top_k}")
        if self.seed is not None and not (0 <= int(self.seed) < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.logprobs is not None and not (0 <= self.logprobs <= self.MAX_LOGPROBS):
            raise ValueError(f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not (0 <= t <= _UINT32_MAX):
                raise ValueError(f"stop_token_ids must be integers in [0, 2**32), got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_filtering(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0
