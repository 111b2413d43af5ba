"""What leaves the engine for each request: why it finished and the logprobs of its tokens.

Pure Python (no torch): the router, the servicers and the converters carry these between
processes without loading the engine.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller (or its lease ended)
    ERROR = "error"  # the engine or its KV transport failed this request


class ErrorKind(str, enum.Enum):
    """Whose failure a ``FinishReason.ERROR`` was: the caller decides on this, never on the
    message text."""

    ENGINE = "engine"  # this engine failed the request (a step raised, a resource ran out)
    KV_TRANSFER = "kv_transfer"  # the KV transport: sending to, or waiting on, a peer failed


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the n most likely tokens and their logprobs
