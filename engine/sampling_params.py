"""Per-request sampling parameters, validated where they enter."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvrelay.engine.structured import StructuredOutput

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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    allowed_token_ids: frozenset[int] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    resumed_output_tokens: int = 0
    structured: StructuredOutput | None = None
    n: int = 1
    prompt_logprobs: int | None = None
    extra: dict[str, str] = field(default_factory=dict, compare=False)

    # ``structured``: a grammar the output must match (JSON schema, regex, choice); the engine
    # masks every token it forbids, allows EOS only where the grammar may end, and finishes the
    # request once the grammar admits nothing more.
    # ``bad_words_token_ids``: token sequences the output must not contain (vLLM's bad_words,
    # tokenized by the router): a sequence's last token is masked whenever the output so far
    # ends with the rest of it (a one-token word: always).
    # ``resumed_output_tokens``: a request resumed on another worker (a migration) arrives with
    # its output so far appended to the prompt; those last tokens still count as output for the
    # presence and frequency penalties, so the resumed stream equals an uninterrupted one.

    # ``n``: choices of one prompt. The prompt is prefilled once; the decode engine forks the
    # sequence (sharing its KV blocks). Choice ``i`` samples as a request of seed ``seed + i``
    # would (vLLM's convention), so each choice equals that single request.

    # ``prompt_logprobs``: return the logprob of every prompt token after the first (and this
    # many alternatives each), as the prefill computes them; such a prompt skips the prefix
    # cache (a cached position has no logits).

    MAX_LOGPROBS = 20
    MAX_N = 16
    MAX_LOGIT_BIAS = 1024
    MAX_ALLOWED_TOKEN_IDS = 1 << 17
    MAX_BAD_WORDS = 256  # sequences (the router makes up to two of each word)
    MAX_BAD_WORD_TOKENS = 64
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
        if not isinstance(self.n, int) or isinstance(self.n, bool) \
                or not (1 <= self.n <= self.MAX_N):
            raise ValueError(f"n must be an integer in [1, {self.MAX_N}], got {self.n!r}")
        if self.prompt_logprobs is not None and not (
                isinstance(self.prompt_logprobs, int)
                and 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be in [0, {self.MAX_LOGPROBS}], got "
                             f"{self.prompt_logprobs!r}")
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

        self._validate_processors()
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError("structured must be a StructuredOutput")

    def _validate_processors(self) -> None:
        # Ranges as vLLM's: presence/frequency in [-2, 2], repetition > 0; OpenAI's logit_bias.
        for name in ("presence_penalty", "frequency_penalty"):
            v = float(getattr(self, name))
            if not (-2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
            object.__setattr__(self, name, v)
        rp = float(self.repetition_penalty)
        if not (0.0 < rp <= 100.0):
            raise ValueError(f"repetition_penalty must be in (0, 100], "
                             f"got {self.repetition_penalty}")
        object.__setattr__(self, "repetition_penalty", rp)
        bias = self.logit_bias
        items = bias.items() if isinstance(bias, dict) else bias
        pairs: dict[int, float] = {}
        for item in items:
            try:
                k, v = item
                tok = int(k)
                val = float(v)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias must map token ids to numbers, "
                                 f"got {item!r}") from None
            if isinstance(k, float) or not (0 <= tok <= _UINT32_MAX):
                raise ValueError(f"logit_bias keys must be token ids in [0, 2**32), got {k!r}")
            if not (-100.0 <= val <= 100.0):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {v!r} for "
                                 f"token {tok}")
            pairs[tok] = val
        if len(pairs) > self.MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {self.MAX_LOGIT_BIAS} tokens")
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs.items())))
        if (not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool)
                or not (0 <= self.min_tokens <= self.max_tokens)):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}],"
                             f" got {self.min_tokens!r}")
        if self.allowed_token_ids is not None:
            ids = frozenset(self.allowed_token_ids)
            if not ids:
                raise ValueError("allowed_token_ids must not be empty")
            if len(ids) > self.MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"at most {self.MAX_ALLOWED_TOKEN_IDS} allowed_token_ids")
            for t in ids:
                if not isinstance(t, int) or not (0 <= t <= _UINT32_MAX):
                    raise ValueError(f"allowed_token_ids must be integers in [0, 2**32), "
                                     f"got {t!r}")
            object.__setattr__(self, "allowed_token_ids", ids)
        self._check_bad_words()
        if (not isinstance(self.resumed_output_tokens, int)
                or not (0 <= self.resumed_output_tokens <= _UINT32_MAX)):
            raise ValueError(f"resumed_output_tokens must be a non-negative integer, got "
                             f"{self.resumed_output_tokens!r}")

    def _check_bad_words(self) -> None:
        words = tuple(tuple(w) for w in self.bad_words_token_ids)
        if len(words) > self.MAX_BAD_WORDS:
            raise ValueError(f"at most {self.MAX_BAD_WORDS} bad words (token sequences)")
        for w in words:
            if not (1 <= len(w) <= self.MAX_BAD_WORD_TOKENS):
                raise ValueError(f"a bad word is 1 to {self.MAX_BAD_WORD_TOKENS} tokens, got "
                                 f"{len(w)}")
            for t in w:
                if not isinstance(t, int) or isinstance(t, bool) or not (0 <= t <= _UINT32_MAX):
                    raise ValueError(f"bad word token ids must be integers in [0, 2**32), "
                                     f"got {t!r}")
        object.__setattr__(self, "bad_words_token_ids", words)

    def choice(self, index: int) -> SamplingParams:
        """The single-choice parameters of choice ``index`` of an ``n > 1`` request: ``n=1``
        and seed ``seed + index`` (unseeded stays unseeded)."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        return replace(self, n=1, seed=seed)

    def max_token_id(self) -> int:
        """The largest token id these parameters name (-1 if none): the engine checks it
        against the vocabulary."""
        ids = [t for t, _ in self.logit_bias]
        if self.allowed_token_ids:
            ids.append(max(self.allowed_token_ids))
        ids.extend(max(w) for w in self.bad_words_token_ids)
        return max(ids, default=-1)

    @property
    def processes_logits(self) -> bool:
        """True when anything beyond temperature/top-k/top-p touches this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias or self.min_tokens
                    or self.allowed_token_ids is not None or bool(self.bad_words_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_filtering(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


def check_fork_count(num_forks: int, n: int) -> None:
    """A decode's forks (choices after the first) number at most ``n - 1``, and ``n`` at most
    ``SamplingParams.MAX_N``: ValueError otherwise (each fork is a sequence of its own)."""
    if not 0 <= num_forks <= min(n, SamplingParams.MAX_N) - 1:
        raise ValueError(f"{num_forks} fork first tokens for n={n}: a request has at most n - 1 "
                         f"forks (n <= {SamplingParams.MAX_N})")
