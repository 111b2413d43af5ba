"""Incremental detokenization and stop strings: a growing id sequence as streamed text.

* ``IncrementalDetokenizer`` emits only newly decodable text per step (prefix/read offsets: each
  step decodes a short window of recent tokens, never the whole output), holding back an
  incomplete UTF-8 character until the token that completes it arrives.
* ``StopChecker`` finds stop strings in that stream, holding back a tail that could still become
  one, and truncates at the first match.
* ``OutputProcessor`` is the two together, driven by a request's ``SamplingParams``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from kvrelay.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Prompt tokens decoded in front of the first output token, so a tokenizer that strips the
# leading space of a decoded text (SentencePiece's "▁") still yields the right first delta.
PREFIX_WINDOW = 5
_REPLACEMENT = "\ufffd"


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
