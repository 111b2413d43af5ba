"""The pool profile: what one prefill and one decode replica can do on this hardware.

A profile holds the measured points of two sweeps and the curves fitted to them:

* prefill: the time of one prefill step that computes ``T`` prompt tokens of prompts of lengths
  ``L_i``: ``a + b*T + c*sum(L_i^2)`` (fixed cost, per-token cost, attention's quadratic term);
  a prompt longer than the step budget is chunked over several steps;
* decode: the time of one decode step of ``B`` sequences of mean context ``C``:
  ``a + b*B + c*B*C`` (this is the inter-token latency every sequence of the batch sees).

It also records each replica's KV capacity (tokens) and step budget, which the simulator and
the sizing use, and two corrections a live cluster adds (``calibrate.py``): a hand-off on every
first token and, where the pools share a host's cores, how much each slows the other.
``kvrelay profile`` measures it (``measure.py``); this module only holds, fits, saves and
evaluates it, so the planner and the router-free tools import no torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

VERSION = 1


@dataclass(frozen=True)
class PrefillPoint:
    prompt_len: int
    concurrency: int
    ttft_ms: float  # mean time to first token of the batch's requests, all sent at once
    tokens_per_s: float  # prompt tokens of the batch / time until the last first token


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    context: int
    itl_ms: float  # mean decode step time with this batch and context
    tokens_per_s: float


def _lstsq(rows: list[list[float]], ys: list[float]) -> tuple[float, ...]:
    """Non-negative-ish least squares: negative coefficients (noise on a tiny term) are dropped
    and the rest refitted, so a fitted curve never decreases with load."""
    x, y = np.asarray(rows, dtype=float), np.asarray(ys, dtype=float)
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        neg = [k for k, c in zip(keep, coef, strict=True) if c < 0]
        if not neg or len(keep) == 1:
            out = [0.0] * x.shape[1]
            for k, c in zip(keep, coef, strict=True):
                out[k] = max(0.0, float(c))
            return tuple(out)
        keep.remove(neg[0])


@dataclass(frozen=True)
class Profile:
    model: str
    hardware: str
    max_num_batched_tokens: int
    kv_capacity_tokens: int  # of one decode replica
    prefill_coef: tuple[float, float, float]  # seconds: fixed, per token, per token^2
    decode_coef: tuple[float, float, float]  # seconds: fixed, per sequence, per seq x context
    startup_s: float = 10.0  # a new replica's time until it serves (measured live or assumed)
    transfer_s: float = 0.0  # KV handoff added to every TTFT
    # Co-located pools (simulator only, ``contention.py``): a prefill step runs 1 + [0] x (the
    # sequences being decoded beside it) times slower, a decode step 1 + [1] x (the prefill
    # steps beside it). (0, 0): each replica has hardware of its own.
    contention: tuple[float, float] = (0.0, 0.0)
    prefill_points: list[PrefillPoint] = field(default_factory=list)
    decode_points: list[DecodePoint] = field(default_factory=list)
    version: int = VERSION

    # -- the curves ----------------------------------------------------------------------------
    def prefill_step_s(self, tokens: int, sq_tokens: float) -> float:
        a, b, c = self.prefill_coef
        return a + b * tokens + c * sq_tokens

    def prefill_s(self, prompt_len: int) -> float:
        """One prompt alone: its chunks one after another."""
        budget, t, done = self.max_num_batched_tokens, 0.0, 0
        while done < prompt_len:
            n = min(budget, prompt_len - done)
            # a chunk attends to everything before it: (done+n)^2 - done^2 pairs
            t += self.prefill_step_s(n, (done + n) ** 2 - done**2)
            done += n
        return t

    def prefill_tokens_per_s(self, prompt_len: int) -> float:
        """Throughput of a busy replica on prompts of this length (full steps)."""
        per_step = max(1, self.max_num_batched_tokens // max(1, prompt_len))
        if per_step == 1:
            return prompt_len / self.prefill_s(prompt_len)
        t = self.prefill_step_s(per_step * prompt_len, per_step * prompt_len**2)
        return per_step * prompt_len / t

    def itl_s(self, batch: float, context: float) -> float:
        a, b, c = self.decode_coef
        return a + b * batch + c * batch * context

    def decode_line(self, batch: int, context_sum: int) -> tuple[float, float]:
        """A batch's decode steps as a line: the first step's time, at ``context_sum`` tokens
        of context over the batch, and what each later step adds (the context grows by
        ``batch`` a step): ``itl_s(batch, (context_sum + batch * m) / batch)`` for step m."""
        a, b, c = self.decode_coef
        return a + b * batch + c * context_sum, c * batch

    # -- fitting -------------------------------------------------------------------------------
    @staticmethod
    def fit_prefill(points: list[PrefillPoint], budget: int) -> tuple[float, float, float]:
        """Fit the step model to the concurrency-1 points' TTFT (each is a chain of chunks)."""
        rows, ys = [], []
        for p in points:
            steps, tokens, sq, done = 0, 0, 0.0, 0
            for _ in range(p.concurrency):
                done = 0
                while done < p.prompt_len:
                    n = min(budget, p.prompt_len - done)
                    steps, tokens, sq = steps + 1, tokens + n, sq + (done + n) ** 2 - done**2
                    done += n
            if p.concurrency == 1:
                rows.append([steps, tokens, sq])
                ys.append(p.ttft_ms / 1000.0)
        if not rows:
            raise ValueError("the prefill sweep needs concurrency-1 points")
        return _lstsq(rows, ys)  # type: ignore[return-value]

    @staticmethod
    def fit_decode(points: list[DecodePoint]) -> tuple[float, float, float]:
        if not points:
            raise ValueError("the decode sweep has no points")
        return _lstsq([[1.0, p.batch, p.batch * p.context] for p in points],
                      [p.itl_ms / 1000.0 for p in points])  # type: ignore[return-value]

    def fit_error(self) -> dict[str, float]:
        """Mean absolute relative error of the curves on the measured points."""
        pe = [abs(self.prefill_s(p.prompt_len) * 1000 - p.ttft_ms) / p.ttft_ms
              for p in self.prefill_points if p.concurrency == 1]
        de = [abs(self.itl_s(p.batch, p.context) * 1000 - p.itl_ms) / p.itl_ms
              for p in self.decode_points]
        return {"prefill": float(np.mean(pe)) if pe else math.nan,
                "decode": float(np.mean(de)) if de else math.nan}

    def scaled(self, prefill: float = 1.0, decode: float = 1.0) -> Profile:
        """The same profile with every prefill/decode time multiplied (a wrong profile in tests,
        a slower machine in the simulator)."""
        from dataclasses import replace

        return replace(self, prefill_coef=tuple(x * prefill for x in self.prefill_coef),
                       decode_coef=tuple(x * decode for x in self.decode_coef))

    # -- files ---------------------------------------------------------------------------------
    def to_json(self) -> str:
        doc = asdict(self)
        doc["fit_error"] = self.fit_error()
        return json.dumps(doc, indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        doc = json.loads(Path(path).read_text())
        if doc.get("version") != VERSION:
            raise ValueError(f"{path}: profile version {doc.get('version')}, expected {VERSION}"
                             " (re-run `kvrelay profile`)")
        doc.pop("fit_error", None)
        doc["prefill_points"] = [PrefillPoint(**p) for p in doc.get("prefill_points", [])]
        doc["decode_points"] = [DecodePoint(**p) for p in doc.get("decode_points", [])]
        doc["prefill_coef"] = tuple(doc["prefill_coef"])
        doc["decode_coef"] = tuple(doc["decode_coef"])
        doc["contention"] = tuple(doc.get("contention", (0.0, 0.0)))
        return cls(**doc)
