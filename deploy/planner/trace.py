"""Load traces in the Mooncake format, and the synthetic ones the benchmarks replay.

One JSON object per line: ``timestamp`` (ms from the start), ``input_length``,
``output_length`` and ``hash_ids`` (one id per ``HASH_BLOCK`` prompt tokens; requests sharing
leading ids share that prefix). The generators are deterministic (seeded): arrivals are a
Poisson process whose rate follows the trace's shape.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

HASH_BLOCK = 512  # Mooncake's hash block: tokens per hash id


@dataclass(frozen=True)
class TraceRequest:
    t: float  # seconds from the start
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()

    def to_json(self) -> str:
        return json.dumps({"timestamp": round(self.t * 1000, 3), "input_length": self.prompt_len,
                           "output_length": self.output_len, "hash_ids": list(self.hash_ids)})


def load(path: str | Path) -> list[TraceRequest]:
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                out.append(TraceRequest(round(d["timestamp"] / 1000.0, 6), int(d["input_length"]),
                                        int(d["output_length"]), tuple(d.get("hash_ids", ()))))
    return sorted(out, key=lambda r: r.t)


def save(path: str | Path, trace: Iterable[TraceRequest]) -> None:
    Path(path).write_text("".join(r.to_json() + "\n" for r in trace))


@dataclass(frozen=True)
class Shape:
    """A trace's recipe: request rate and prompt length over time."""

    duration_s: float
    rate: Callable[[float], float]  # requests/s at time t
    prompt_mean: Callable[[float], float]
    output_mean: float = 64
    shared_prefixes: int = 8  # distinct system prompts
    shared_fraction: float = 0.5  # of the prompt, at most, taken by the shared prefix


def generate(shape: Shape, seed: int = 0, max_len: int = 4000) -> list[TraceRequest]:
    """Poisson arrivals by thinning at the shape's peak rate; prompt and output lengths
    log-normal around the means (sigma 0.4); a request's leading hash ids are one of
    ``shared_prefixes`` system prompts'."""
    rng = random.Random(seed)
    peak = max(shape.rate(shape.duration_s * i / 1000) for i in range(1001)) or 1.0
    t, out, next_id = 0.0, [], 10_000
    while True:
        t += rng.expovariate(peak)
        if t >= shape.duration_s:
            return out
        if rng.random() > shape.rate(t) / peak:
            continue
        plen = _lognormal(rng, shape.prompt_mean(t), 8, max_len)
        olen = _lognormal(rng, shape.output_mean, 2, max_len // 4)
        blocks = math.ceil(plen / HASH_BLOCK)
        shared = min(blocks - 1, int(blocks * shape.shared_fraction)) if blocks > 1 else 0
        sys_id = rng.randrange(shape.shared_prefixes) * 1000
        ids = [sys_id + i for i in range(shared)]
        ids += range(next_id, next_id + blocks - shared)
        next_id += blocks - shared
        out.append(TraceRequest(round(t, 4), plen, olen, tuple(ids)))


def _lognormal(rng: random.Random, mean: float, lo: int, hi: int) -> int:
    sigma = 0.4
    x = rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)
    return int(min(hi, max(lo, round(x))))


def shapes(peak_rate: float, duration_s: float = 600.0, prompt: float = 512,
           output: float = 64) -> dict[str, Shape]:
    """The benchmark traces, scaled to a cluster whose saturation is near ``peak_rate``."""
    d, lo = duration_s, 0.15 * peak_rate

    def ramp(t: float) -> float:  # low -> peak -> low, plateaus a sixth each
        x = t / d
        if x < 1 / 6 or x > 5 / 6:
            return lo
        if x < 2 / 6:
            return lo + (peak_rate - lo) * (x - 1 / 6) * 6
        if x < 4 / 6:
            return peak_rate
        return peak_rate - (peak_rate - lo) * (x - 4 / 6) * 6

    def diurnal(t: float) -> float:  # two "days"
        return lo + (peak_rate - lo) * 0.5 * (1 - math.cos(2 * math.pi * 2 * t / d))

    def bursty(t: float) -> float:  # a base load with 20 s bursts of 2.5x every 100 s
        return 0.75 * peak_rate if 60 <= t % 100 < 80 else 0.3 * peak_rate

    def long_shift(t: float) -> float:
        return 0.2 * peak_rate

    def const_prompt(t: float) -> float:
        return prompt

    def shift_prompt(t: float) -> float:  # prompts 3x longer from the middle on
        return prompt if t < d / 2 else 3 * prompt

    return {
        "steady": Shape(d, lambda t: 0.6 * peak_rate, const_prompt, output),
        "ramp": Shape(d, ramp, const_prompt, output),
        "diurnal": Shape(d, diurnal, const_prompt, output),
        "bursty": Shape(d, bursty, const_prompt, output),
        "long_prompt_shift": Shape(d, long_shift, shift_prompt, output),
    }
