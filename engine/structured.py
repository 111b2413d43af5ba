"""Structured output: grammar specs, their compilation (cached) and per-request matchers.

The grammar engine is llguidance: it has no dependencies (xgrammar pulls triton and a TVM FFI
runtime, and imports torch, which the router process must not load), builds a matcher for a
small JSON schema in ~1 ms and a token mask in ~0.1 ms on the demo tokenizer, and drops the GIL
while it computes masks, so they can be filled on a thread while the forward runs.

A request carries its grammar *spec* (:class:`StructuredOutput`, in ``SamplingParams``), never
matcher state: whichever engine samples for it builds a matcher and replays the output tokens it
already has (the first token on a decode worker, everything produced so far after a migration).

Torch-free: the router imports this module to refuse a grammar the engine could not compile.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

KINDS = ("json_object", "json_schema", "regex", "choice")
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024
# Nesting of a JSON schema: real ones nest a few levels (a deep one, tens); parsing deeper text
# recursed until Python's limit and answered HTTP 500 (a schema of "[" * 5000).
MAX_SCHEMA_DEPTH = 64
# JSON is emitted compactly (no free whitespace between tokens): a weak model left free
# whitespace can pad forever and never close the object.
_JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class StructuredOutput:
    """One grammar constraint: ``kind`` is json_object (any JSON object), json_schema (``spec``
    is the schema as JSON text), regex (``spec`` is the pattern, matched in full) or choice
    (the output is exactly one of ``choices``)."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, "
                             f"got {self.kind!r}")
        object.__setattr__(self, "choices", tuple(self.choices))
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"the {self.kind} spec has {len(self.spec)} characters; at most "
                             f"{MAX_SPEC_CHARS}")
        if self.kind == "choice":
            if not self.choices:
                raise ValueError("guided_choice needs at least one choice")
            if len(self.choices) > MAX_CHOICES:
                raise ValueError(f"guided_choice takes at most {MAX_CHOICES} choices")
            if not all(isinstance(c, str) and c for c in self.choices):
                raise ValueError("guided_choice choices must be non-empty strings")
        elif self.choices:
            raise ValueError("choices are only for kind 'choice'")
        if self.kind in ("json_schema", "regex") and not self.spec:
            raise ValueError(f"a {self.kind} constraint needs a non-empty spec")
        if self.kind == "json_schema":
            check_json_depth(self.spec)

    @classmethod
    def json_schema(cls, schema: Any) -> StructuredOutput:
        """From a schema given as a dict or as JSON text."""
        try:
            if isinstance(schema, str):
                check_json_depth(schema)  # before the (recursive) parser sees it
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be a JSON object")
            return cls("json_schema", json.dumps(schema, separators=(",", ":")))
        except RecursionError:  # a nested dict deeper than the interpreter recurses
            raise ValueError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} "
                             f"levels") from None


def check_json_depth(text: str) -> None:
    """ValueError when JSON ``text`` nests arrays and objects deeper than
    ``MAX_SCHEMA_DEPTH`` (a scan, no recursion; brackets inside strings do not count)."""
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_SCHEMA_DEPTH:
                raise ValueError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        elif ch in "]}":
            depth -= 1


def grammar_text(so: StructuredOutput) -> str:
    """The llguidance grammar of ``so`` (not yet checked)."""
    import llguidance as llg

    if so.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if so.kind == "json_schema":
        try:
            return llg.LLMatcher.grammar_from_json_schema(so.spec, defaults=_JSON_OPTIONS)
        except ValueError as e:
            raise ValueError(f"invalid JSON schema: {e}") from None
    if so.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(so.spec)
    # Lark string literals take JSON's escapes: every choice is matched byte for byte.
    alts = " | ".join(json.dumps(c) for c in so.choices)
    return llg.LLMatcher.grammar_from_lark(f"start: {alts}\n")


def ll_tokenizer(hf_tokenizer: Any, vocab_size: int | None,
                 eos_token_ids: Iterable[int]) -> Any:
    """An llguidance tokenizer over a fast transformers tokenizer's vocabulary (its Rust
    tokenizer serialized, as llguidance.hf does without importing torch). ``vocab_size``: the
    model's logit width when it differs from the tokenizer's."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", hf_tokenizer)
    eos = sorted(eos_token_ids) or None
    if eos is None and getattr(hf_tokenizer, "eos_token_id", None) is not None:
        eos = [int(hf_tokenizer.eos_token_id)]
    return ll_tokenizer_from_json(backend.to_str(), vocab_size, eos or ())


def ll_tokenizer_from_json(tokenizer_json: str, vocab_size: int | None,
                           eos_token_ids: Iterable[int]) -> Any:
    """An llguidance tokenizer over a serialized fast tokenizer (``tokenizer.json``)."""
    import llguidance as llg

    return llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                           eos_token=sorted(eos_token_ids) or None)


class GrammarMatcher:
    """One request's grammar state: which tokens may come next, whether it may end."""

    __slots__ = ("_m",)

    def __init__(self, matcher: Any):
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (and the matcher is then in error) if it breaks the
        grammar."""
        return bool(self._m.consume_token(token_id))

    @property
    def is_stopped(self) -> bool:
        """The grammar admits nothing more (it may still take an EOS token)."""
        return bool(self._m.is_stopped())

    @property
    def is_error(self) -> bool:
        return bool(self._m.is_error())

    def error(self) -> str:
        return str(self._m.get_error())

    @property
    def handle(self) -> Any:
        """The llguidance matcher (for batched mask computation)."""
        return self._m


class GrammarCompiler:
    """Compiles structured-output specs against one tokenizer and keeps the results.

    A compiled grammar is a fresh llguidance matcher kept as a template; each request gets a
    ``deep_copy`` of it (cheap: the grammar, lexer and token tables are shared). The cache is an
    LRU of ``capacity`` specs; compilation errors are cached too, so a bad schema sent in a loop
    costs one compile. Thread-safe (the router checks specs on its tokenizer threads)."""

    def __init__(self, tokenizer: Any, capacity: int = 256):
        self.tokenizer = tokenizer  # an llguidance LLTokenizer
        self.capacity = capacity
        self._cache: OrderedDict[StructuredOutput, Any | str] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @classmethod
    def from_hf(cls, hf_tokenizer: Any, vocab_size: int | None = None,
                eos_token_ids: Iterable[int] = (), capacity: int = 256) -> GrammarCompiler:
        return cls(ll_tokenizer(hf_tokenizer, vocab_size, eos_token_ids), capacity)

    @classmethod
    def from_checkpoint(cls, model_dir: str, vocab_size: int | None = None,
                        eos_token_ids: Iterable[int] = (), capacity: int = 256
                        ) -> GrammarCompiler:
        """Over the checkpoint's tokenizer without loading transformers where it has a
        ``tokenizer.json`` (``tokenizer.tokenizer_json``): what a worker compiles with."""
        from kvrelay.engine.tokenizer import tokenizer_json

        return cls(ll_tokenizer_from_json(tokenizer_json(model_dir), vocab_size, eos_token_ids),
                   capacity)

    def is_cached(self, so: StructuredOutput) -> bool:
        with self._lock:
            return so in self._cache

    def _template(self, so: StructuredOutput) -> Any:
        with self._lock:
            got = self._cache.get(so)
            if got is not None:
                self._cache.move_to_end(so)
                self.hits += 1
        if got is None:
            got = self._compile(so)
            with self._lock:
                self.misses += 1
                self._cache[so] = got
                while len(self._cache) > self.capacity:
                    self._cache.popitem(last=False)
        if isinstance(got, str):
            raise ValueError(got)
        return got

    def _compile(self, so: StructuredOutput) -> Any | str:
        import llguidance as llg

        what = {"json_object": "JSON object grammar", "json_schema": "JSON schema",
                "regex": "regex", "choice": "guided_choice"}[so.kind]
        try:
            grammar = grammar_text(so)
        except ValueError as e:
            return f"cannot compile the {what}: {e}"
        # log_level 0: a bad grammar is the client's error, reported to it, not logged here.
        m = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            return f"cannot compile the {what}: {m.get_error()}"
        return m

    def check(self, so: StructuredOutput) -> None:
        """Raise ValueError with the reason when ``so`` does not compile."""
        self._template(so)

    def matcher(self, so: StructuredOutput, replay: Iterable[int] = ()) -> GrammarMatcher:
        """A new matcher for ``so`` that has consumed ``replay`` (tokens generated under it
        before, elsewhere). ValueError if ``so`` does not compile or ``replay`` breaks it."""
        m = GrammarMatcher(self._template(so).deep_copy())
        for i, tok in enumerate(replay):
            if not m.accept(tok):
                raise ValueError(f"output token {i} (id {tok}) does not match the request's "
                                 f"grammar: {m.error()}")
        return m
