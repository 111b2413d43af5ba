"""Driving one ``EngineCore`` by hand in the engine-level tests: seeded prompts and one request
run to its end (greedy by default), returning its tokens and how many prompt tokens it found
cached."""

from __future__ import annotations

import random

from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.sampling_params import SamplingParams

GREEDY8 = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def seeded_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 4000) for _ in range(n)]


def run_one(core: EngineCore, rid: str, tokens: list[int],
            sampling: SamplingParams = GREEDY8, max_steps: int = 500) -> tuple[list[int], int]:
    """Add one request and step until it finishes: its tokens, and its cached prompt tokens."""
    core.add_request(rid, tokens, sampling)
    out: list[int] = []
    cached = 0
    for _ in range(max_steps):
        for o in core.step():
            if o.request_id == rid:
                out += o.new_token_ids
                cached = max(cached, o.num_cached_tokens)
                if o.finished:
                    return out, cached
    raise AssertionError(f"request {rid} did not finish in {max_steps} steps")
