"""The checks of one request that need no tokenizer and no cluster: its id, its deadline, its
stop strings and the token ids its sampling names, its prompt's size and text. Each refusal is
a RouterError(INVALID_ARGUMENT) whose message the client sees; sizes are checked before
anything is scanned. ``RouterService.build_spec`` runs them in order."""

from __future__ import annotations

import re
from collections.abc import Sequence

import grpc

from kvrelay.common.limits import (
    MAX_PROMPT_CHARS,
    MAX_REQUEST_ID,
    MAX_STOP_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TIMEOUT_MS,
)
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.router.errors import RouterError

REQUEST_ID_RE = re.compile(rf"^[A-Za-z0-9_.:\-]{{1,{MAX_REQUEST_ID}}}$")


def invalid(msg: str) -> RouterError:
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, msg)


def first_bad_id(token_ids: Sequence[object], vocab_size: int) -> object | None:
    return next((t for t in token_ids
                 if not isinstance(t, int) or not (0 <= t < vocab_size)), None)


def check_request_id(rid: object) -> None:
    if not isinstance(rid, str) or not REQUEST_ID_RE.fullmatch(rid):  # '$' allows '\n'
        raise invalid(f"request_id must be 1-{MAX_REQUEST_ID} characters of letters, digits, "
                      "'-', '_', '.', ':'")


def deadline_of(timeout_ms: int | None, arrival: float) -> float | None:
    """The request's deadline (``time.monotonic()``), None without a timeout."""
    if not timeout_ms:
        return None
    if not (0 < timeout_ms <= MAX_TIMEOUT_MS):
        raise invalid(f"timeout_ms must be in (0, {MAX_TIMEOUT_MS}]")
    return arrival + timeout_ms / 1000.0


def check_stop_strings(sampling: SamplingParams) -> None:
    if len(sampling.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LEN
                                                    for s in sampling.stop):
        raise invalid(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_LEN} "
                      f"characters")
    for s in sampling.stop:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise invalid(f"stop string {s!r} is not valid Unicode (lone surrogate)") from None


def check_sampling_ids(sampling: SamplingParams, vocab_size: int) -> None:
    """The token ids the sampling names (stop tokens, logit_bias, allowed_token_ids, bad words)
    are in the vocabulary; ``resumed_output_tokens`` is the router's own."""
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
    bad_stop = next((t for t in sampling.stop_token_ids if t >= vocab_size), None)
    if bad_stop is not None:
        raise invalid(f"stop token id {bad_stop} is outside the vocabulary")
    top = sampling.max_token_id()
    if top >= vocab_size:
        raise invalid(f"token id {top} in logit_bias/allowed_token_ids/bad_words is outside the "
                      f"vocabulary [0, {vocab_size})")
    if sampling.resumed_output_tokens:
        raise invalid("resumed_output_tokens is set by the router only")


def check_prompt_text(text: object) -> None:
    """A text prompt, before it is tokenized: a string, not too long, valid Unicode."""
    if not isinstance(text, str):
        raise invalid("the prompt must be a string")
    if len(text) > MAX_PROMPT_CHARS:
        raise invalid(f"the prompt has {len(text)} characters; at most {MAX_PROMPT_CHARS}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid("the prompt is not valid Unicode (lone surrogate)") from None


def check_prompt_length(token_ids: Sequence[int], max_len: int) -> None:
    """At least one token, and room in a context of ``max_len`` for one more."""
    if not token_ids:
        raise invalid("the prompt is empty: it needs at least one token")
    if len(token_ids) >= max_len:
        raise invalid(f"the prompt has {len(token_ids)} tokens; this model takes at most "
                      f"{max_len - 1} (context {max_len})")


# -- a JSON body's shape, before it is parsed ------------------------------------------------------
# One JSON string, its closing quote required (the caller guarantees a quote after every window).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
SCAN_WINDOW = 64 * 1024  # bytes scanned per step: the GIL is free between steps


def json_values(body: bytes, limit: int) -> int:
    """How many JSON values ``body`` holds outside strings (commas and containers: each value
    but the first of a container follows a comma), exact enough to bound what parsing it costs;
    returns early, with a count over ``limit``, once the count passes it.

    A parse builds a Python object per value: a 25 MiB body of numbers is 5 million objects
    (1.8 GB with the prompt's union of types). Commas and brackets are counted in C; when the
    whole body has more of them than ``limit`` (a long text full of commas, or many values),
    the strings are skipped window by window so a thread running this leaves the event loop
    the GIL between windows."""
    raw = body.count(b",") + body.count(b"[") + body.count(b"{")
    if raw <= limit:
        return raw
    n, pos, in_string = 0, 0, False
    while pos < len(body):
        end = min(len(body), pos + SCAN_WINDOW)
        while end < len(body) and body[end - 1] == 0x5C:  # never split an escape: the
            end += 1  # window ends on a byte that is no backslash, so the sentinel is a quote
        window = (b'"' if in_string else b"") + body[pos:end] + b'"'  # the sentinel quote
        rest = _JSON_STRING.sub(b"", window)
        # the sentinel closed a string open at the window's end: the next window starts in it
        in_string = not rest.endswith(b'"')
        n += rest.count(b",") + rest.count(b"[") + rest.count(b"{")
        if n > limit:
            return n
        pos = end
    return n
