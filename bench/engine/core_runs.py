"""The engine as the engine benchmarks drive it: a core sized for one-shot rows, seeded token
prompts, and a timed prefill. Used by ``throughput`` and ``engine_tp``."""

from __future__ import annotations

import time

import torch

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.sampling_params import SamplingParams


def make_core(model: str, threads: int, num_blocks: int, linear_kernel: str = "auto",
              prefix_caching: bool = False, **kw: object) -> EngineCore:
    cfg = EngineConfig.from_kwargs(model, num_threads=threads, num_blocks=num_blocks,
                                   max_num_batched_tokens=2048, max_num_seqs=128,
                                   long_prefill_threshold=2048,
                                   enable_prefix_caching=prefix_caching,
                                   linear_kernel=linear_kernel, **kw)
    return EngineCore(cfg, eos_token_ids=frozenset())


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 1, (n,), generator=g).tolist()


_seeds = iter(range(10**9))


def next_seed() -> int:
    """A fresh seed (and request-id suffix) for each prompt of a run."""
    return next(_seeds)


def run_prefill(core: EngineCore, prompts: list[list[int]]) -> float:
    """Seconds from adding ``prompts`` to their first tokens (max_tokens=1)."""
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for p in prompts:
        core.add_request(f"p{next_seed()}", p, sp)
    t = time.perf_counter()
    while core.has_unfinished():
        core.step()
    return time.perf_counter() - t
