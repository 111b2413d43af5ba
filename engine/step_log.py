"""Per-step records of an engine, for finding where a step's time goes: the same engine served
(beside a router, a client, its RPC threads) against offline, step kind by step kind.

With ``KVRELAY_STEP_LOG=PATH`` set, every engine of a process appends one line per step to
``PATH.<pid>``: the step's start (``time.monotonic()``), its seconds, and its shape (prefill
tokens, attended pairs, decodes, decode context tokens, prefill chunks; :class:`StepShape`). Off
by default: no cost beyond one attribute test per step. :func:`read` parses a file;
``bench/serving/step_log.py`` summarizes them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple, TextIO

from kvrelay.engine.step_cost import StepShape

ENV = "KVRELAY_STEP_LOG"


class StepRecord(NamedTuple):
    """One line of a step log."""

    start: float
    seconds: float
    prefill_tokens: int
    attended_pairs: int
    decodes: int
    decode_ctx_tokens: int
    prefill_chunks: int = 0  # (not in logs written before it was recorded)


def read(path: str | os.PathLike[str]) -> list[StepRecord]:
    """The steps a log file holds, in order."""
    out = []
    for line in Path(path).read_text().splitlines():
        start, seconds, *counts = line.split()
        out.append(StepRecord(float(start), float(seconds), *map(int, counts)))
    return out


class StepLog:
    def __init__(self, path: str) -> None:
        self.path = path
        # Line-buffered: each step's line is whole on any exit; open for the engine's life.
        self._f: TextIO = open(path, "a", buffering=1)  # noqa: SIM115

    @classmethod
    def from_env(cls) -> StepLog | None:
        base = os.environ.get(ENV)
        return cls(f"{base}.{os.getpid()}") if base else None

    def record(self, start: float, seconds: float, shape: StepShape) -> None:
        self._f.write(f"{start:.6f} {seconds:.6f} {shape.prefill_tokens} "
                      f"{shape.attended_pairs} {shape.decodes} {shape.decode_ctx_tokens} "
                      f"{shape.prefill_chunks}\n")

    def close(self) -> None:
        self._f.close()
