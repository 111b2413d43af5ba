"""Tokenizer loading, incremental detokenization, stop strings and chat templates.

Text leaves the engine as token ids; this module turns a growing id sequence into streamed text:

* ``IncrementalDetokenizer`` emits only newly decodable text per step (prefix/read offsets: each
  step decodes a short window of recent tokens, never the whole output), holding back an
  incomplete UTF-8 character until the token that completes it arrives.
* ``StopChecker`` finds stop strings in that stream, holding back a tail that could still become
  one, and truncates at the first match.
* ``OutputProcessor`` is the two together, driven by a request's ``SamplingParams``.

Everything loads offline: a checkpoint directory holds its own tokenizer files.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from kvrelay.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Prompt tokens decoded in front of the first output token, so a tokenizer that strips the
# leading space of a decoded text (SentencePiece's "▁") still yields the right first delta.
PREFIX_WINDOW = 5
_REPLACEMENT = "\ufffd"


def load_tokenizer(model_dir: str) -> Any:
    """The checkpoint's fast (Rust-backed) transformers tokenizer, loaded without network."""
    from transformers import AutoTokenizer

    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"no checkpoint directory at {model_dir!r}")
    try:
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True,
                                            trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {model_dir!r}: {e}") from e
    if getattr(tok, "backend_tokenizer", None) is None:
        raise ValueError(f"the tokenizer in {model_dir!r} is not a fast tokenizer "
                         f"(kvrelay needs tokenizer.json)")
    return tok


def tokenizer_json(model_dir: str) -> str:
    """The checkpoint's fast tokenizer, serialized: ``tokenizer.json`` as the Rust `tokenizers`
    library reads and writes it (milliseconds), else converted by transformers (seconds: it
    imports transformers and may convert a slow tokenizer). What a worker needs of the
    tokenizer to compile structured-output grammars; the router holds the full one."""
    path = os.path.join(model_dir, "tokenizer.json")
    if os.path.isfile(path):
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_file(path).to_str()
        except Exception as e:  # the Rust library's own error type
            raise ValueError(f"cannot read {path}: {e}") from e
    return load_tokenizer(model_dir).backend_tokenizer.to_str()


def eos_token_ids(model_dir: str, tokenizer: Any | None = None) -> frozenset[int]:
    """Every id that ends generation: generation_config.json, config.json and the tokenizer's.

    Instruct checkpoints often list several (end of turn and end of text), sometimes only in
    ``generation_config.json``; all of them stop a request. Without ``tokenizer``, the
    tokenizer's EOS comes from its files (``tokenizer_eos_token_id``).
    """
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            value = json.load(f).get("eos_token_id")
        ids.update(_as_ids(value, path))
    if tokenizer is not None:
        tok_eos = getattr(tokenizer, "eos_token_id", None)
    else:
        tok_eos = tokenizer_eos_token_id(model_dir)
    if tok_eos is not None:
        ids.add(int(tok_eos))
    if not ids:
        logger.warning("no EOS token id found for %s: requests stop only at max_tokens, stop "
                       "strings or stop_token_ids", model_dir)
    return frozenset(ids)


# Tokenizer classes whose EOS comes only from the files (no class default stands in for it).
_GENERIC_TOKENIZER_CLASSES = {None, "PreTrainedTokenizerFast", "TokenizersBackend"}


def tokenizer_eos_token_id(model_dir: str) -> int | None:
    """``load_tokenizer(model_dir).eos_token_id``, read from the tokenizer's own files where they
    say it plainly: ``tokenizer_config.json`` names the token (``special_tokens_map.json``, if it
    names one, agrees: transformers versions differ on which wins and on whether it is read at
    all) and ``tokenizer.json`` holds its id. A worker needs only this id, and loading the
    transformers tokenizer in a process that has torch imports seconds of transformers' torch
    side. Anything less plain (a class that may default the token, the files disagreeing, a
    token not in the vocabulary) loads the tokenizer and asks it. None when the directory has
    no tokenizer at all."""
    config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    special_map = _read_json(os.path.join(model_dir, "special_tokens_map.json")) or {}
    tokenizer_json = os.path.join(model_dir, "tokenizer.json")
    has_json = os.path.isfile(tokenizer_json)
    if config is None and not has_json:
        return None
    token = _token_text(config.get("eos_token")) if config is not None else None
    if (token is not None and has_json
            and _token_text(special_map.get("eos_token")) in (None, token)
            and config.get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES):
        from tokenizers import Tokenizer

        token_id = Tokenizer.from_file(tokenizer_json).token_to_id(token)
        if token_id is not None:
            return int(token_id)
    return getattr(load_tokenizer(model_dir), "eos_token_id", None)


def _read_json(path: str) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        value = json.load(f)
    return value if isinstance(value, dict) else None


def _token_text(value: Any) -> str | None:
    """A special token as the files write it: a string, or an AddedToken's fields."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"eos_token_id in {where} must be an id or a list of ids, got {value!r}")
    return values


def read_chat_template(value: str) -> str:
    """``--chat-template``: a file holding a Jinja template, or the template itself."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            value = f.read()
    elif "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    if not value.strip():
        raise ValueError("--chat-template is empty")
    return value


def apply_chat_template(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                        add_generation_prompt: bool = True,
                        chat_template: str | None = None) -> str:
    """Render chat ``messages`` with ``chat_template`` (a Jinja template; default: the
    tokenizer's own) into a prompt string.

    The result already holds the template's special tokens (BOS included, if the template has
    it): encode it with ``add_special_tokens=False``.
    """
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template: send a plain prompt "
                         "(completions), or start the router with --chat-template FILE|STRING")
    if not messages:
        raise ValueError("messages must not be empty")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be a mapping with a string 'role'")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}]['content'] must be a string")
    try:
        text = tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template or None)
    except Exception as e:  # jinja's TemplateError, including the template's raise_exception
        raise ValueError(f"the chat template rejected the messages: {e}") from e
    assert isinstance(text, str)
    return text


def bad_words_token_ids(tokenizer: Any, words: Iterable[str]) -> tuple[tuple[int, ...], ...]:
    """Token sequences for vLLM's ``bad_words``: each word as the start of a text and after a
    space (BPE vocabularies spell the two differently), without special tokens, duplicates
    dropped. A word of nothing but spaces is refused (ValueError)."""
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        bare = word.lstrip()
        if not bare:
            raise ValueError("bad_words entries must not be empty")
        for text in (bare, " " + bare):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                out[ids] = None
    return tuple(out)


class IncrementalDetokenizer:
    """Turns output token ids into text deltas whose concatenation is the decoded output.

    Keeps ``ids[prefix:]`` only: ``ids[prefix:read]`` were already emitted (decoded again as the
    context that fixes spaces at the window's start), ``ids[read:]`` are pending. A step decodes
    the window twice, without and with the pending ids, and emits the difference unless the text
    ends in U+FFFD (an incomplete UTF-8 character: a later token completes it). ``flush`` emits
    whatever is left at the end, replacement characters included.

    The deltas join to ``tokenizer.decode(output_ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=False)``: that clean-up is not local to a window, and tokenizers
    used for generation keep it off.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self.skip_special_tokens = skip_special_tokens
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:  # the Rust decoder directly: no per-call Python overhead
            self._decode_fn = backend.decode
        else:
            self._decode_fn = lambda ids, skip_special_tokens: tokenizer.decode(
                ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
        self._ids: list[int] = [int(t) for t in prompt_token_ids[-PREFIX_WINDOW:]]
        self._read = len(self._ids)  # offset (into _ids) of the first id not yet emitted
        self._text_len = 0
        self.num_output_tokens = 0

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_token_ids: Iterable[int]) -> str:
        """Add output ids; return the text they complete ("" while a character is incomplete)."""
        new = [int(t) for t in new_token_ids]
        if not new:
            return ""
        self._ids.extend(new)
        self.num_output_tokens += len(new)
        return self._emit(final=False)

    def flush(self) -> str:
        """Emit the held-back text at the end of a request (an incomplete character as U+FFFD)."""
        return self._emit(final=True)

    @property
    def has_pending(self) -> bool:
        return self._read < len(self._ids)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        prefix = self._decode(self._ids[:self._read]) if self._read else ""
        full = self._decode(self._ids)
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        if not full.startswith(prefix):
            # Only invalid UTF-8 that decoders replace as a group (byte fallback) gets here;
            # the text past the prefix's length is still the best delta there is.
            logger.debug("detokenizer window changed its prefix: %r -> %r", prefix, full)
        delta = full[len(prefix):]
        # The pending ids become the next step's context; older ids are no longer needed.
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        return delta


class StopResult(NamedTuple):
    text: str  # safe to emit now
    stopped: bool  # a stop string matched: ``text`` is the last of the output
    stop_string: str | None  # the stop string that matched


class StopChecker:
    """Finds stop strings in a stream of text deltas.

    ``step(delta)`` returns the text that can be emitted: everything except a tail that is the
    start of some stop string (at most ``max(len(stop)) - 1`` characters), which is held until
    the next delta decides it. At the first stop string the output ends there, the stop string
    itself included only with ``include_stop_str_in_output``. Call ``flush()`` at the end of a
    request to emit the held tail.
    """

    def __init__(self, stop: Sequence[str] = (), include_stop_str_in_output: bool = False):
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1
        self._held = ""
        self.stopped = False
        self.stop_string: str | None = None

    def step(self, delta: str) -> StopResult:
        if self.stopped:
            return StopResult("", True, self.stop_string)
        if not self.stop:
            return StopResult(delta, False, None)
        buf = self._held + delta
        match = self._first_match(buf)
        if match is not None:
            start, s = match
            self.stopped, self.stop_string, self._held = True, s, ""
            end = start + len(s) if self.include_stop_str_in_output else start
            return StopResult(buf[:end], True, s)
        hold = self._partial_tail(buf)
        self._held = buf[len(buf) - hold:] if hold else ""
        return StopResult(buf[:len(buf) - hold], False, None)

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        # The stop string completed first in the stream ends first; ties go to the longer one.
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            i = buf.find(s)
            if i >= 0:
                key = (i + len(s), i, s)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that begins some stop string."""
        for n in range(min(self._max_hold, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0


class OutputStep(NamedTuple):
    text: str  # text to stream now
    stop_string: str | None  # set when a stop string ended the output (the caller aborts)


class OutputProcessor:
    """One request's output: token ids in, streamable text out, stop strings applied.

    ``add(token_ids, finished=...)`` takes each batch of new ids as it arrives. With
    ``finished`` the held-back text is flushed. ``stopped_on_token`` says the last id is the
    EOS or stop token that ended the request: its text is left out unless
    ``include_stop_str_in_output`` (as in vLLM). Once a stop string matched, later calls
    return no text.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 sampling: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                            skip_special_tokens=sampling.skip_special_tokens)
        self.stops = StopChecker(sampling.stop, sampling.include_stop_str_in_output)
        self.include_stop_token = sampling.include_stop_str_in_output
        self.text_parts: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self.text_parts)

    def add(self, token_ids: Sequence[int], *, finished: bool = False,
            stopped_on_token: bool = False) -> OutputStep:
        if self.stops.stopped:
            return OutputStep("", self.stops.stop_string)
        ids = list(token_ids)
        if stopped_on_token and ids and not self.include_stop_token:
            ids = ids[:-1]
        r = self.stops.step(self.detok.step(ids))
        out = r.text
        if finished and not r.stopped:
            r = self.stops.step(self.detok.flush())
            out += r.text
            if not r.stopped:
                out += self.stops.flush()
        if out:
            self.text_parts.append(out)
        return OutputStep(out, r.stop_string)
