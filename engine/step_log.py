"""Per-step records of an engine, for finding where a step's time goes: the same engine served
(beside a router, a client, its RPC threads) against offline, step kind by step kind.

With ``KVRELAY_STEP_LOG=PATH`` set, every engine of a process appends one line per step to
``PATH.<pid>``: the step's start (``time.monotonic()``), its seconds, and its shape (prefill
tokens, attended pairs, decodes, decode context tokens; :class:`StepShape`). Off by default: no
cost beyond one attribute test per step. ``bench/step_log.py`` summarizes such files.
"""

from __future__ import annotations

import os
from typing import TextIO

from kvrelay.engine.step_cost import StepShape

ENV = "KVRELAY_STEP_LOG"


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
                      f"{shape.attended_pairs} {shape.decodes} {shape.decode_ctx_tokens}\n")

    def close(self) -> None:
        self._f.close()
