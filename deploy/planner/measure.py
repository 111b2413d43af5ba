"""``kvrelay profile``: sweep one engine as a prefill replica and as a decode replica.

The engine runs in this process (``EngineCore``, no servers, no cluster), so the sweep is fast
and bounded: prefill (prompt length x concurrency -> TTFT, prompt tokens/s) and decode (batch x
context -> ITL, tokens/s). Each point's requests are sent at once; prompts are random token ids
and the prefix cache is off, so nothing is served from cache. Points past ``time_budget_s`` are
skipped (the ones measured are fitted).
"""

from __future__ import annotations

import logging
import platform
import random
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvrelay.deploy.planner.profile import DecodePoint, PrefillPoint, Profile

logger = logging.getLogger(__name__)

PREFILL_LENGTHS = (32, 128, 512, 1024, 2048)
PREFILL_CONCURRENCY = (1, 4)
DECODE_BATCHES = (1, 4, 16, 32)
DECODE_CONTEXTS = (64, 512, 1024)
DECODE_STEPS = 12


def _hardware() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
        threads = torch.get_num_threads()
    except ImportError:
        threads = 0
    return f"{platform.processor() or platform.machine()} cpu, {threads} torch threads"


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(4, vocab) for _ in range(n)]


def _prefill_point(engine: Any, rng: random.Random, length: int, conc: int) -> PrefillPoint:
    from kvrelay.engine.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ids = [f"p{rng.random()}" for _ in range(conc)]
    t0 = time.perf_counter()
    for rid in ids:
        engine.add_request(rid, _prompt(rng, length, engine.vocab_size), sp)
    first: dict[str, float] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
    span = max(first.values())
    return PrefillPoint(length, conc, 1000 * sum(first.values()) / len(first),
                        length * conc / span)


def _decode_tokens(batch: int, ctx: int, budget: int) -> int:
    """Tokens each request generates: enough that the first-prefilled ones still run once the
    last prompt is in (prefill steps carry the early ones' decodes), then DECODE_STEPS more."""
    return DECODE_STEPS + 4 + 2 * (batch * ctx // budget + 1)


def _decode_point(engine: Any, rng: random.Random, batch: int, ctx: int,
                  budget: int) -> DecodePoint:
    from kvrelay.engine.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=_decode_tokens(batch, ctx, budget), temperature=0.0,
                        ignore_eos=True)
    for _ in range(batch):
        engine.add_request(f"d{rng.random()}", _prompt(rng, ctx, engine.vocab_size), sp)
    steps: list[float] = []
    while engine.has_unfinished():
        st = engine.stats()
        pure = st.num_waiting == 0 and st.waiting_prompt_tokens == 0
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        # time only steps where the whole batch decodes (all prefills done, nobody finished)
        if pure and len(outs) == batch and not any(o.finished for o in outs):
            steps.append(dt)
    if not steps:
        raise RuntimeError(f"decode point batch={batch} ctx={ctx}: no step ran the whole batch")
    steps = steps[1:] or steps  # the first pure step may still warm a new shape
    itl = sum(steps) / len(steps)
    return DecodePoint(batch, ctx, 1000 * itl, batch / itl)


def run_profile(engine_config: Any, *, time_budget_s: float = 170.0,
                prefill_lengths: tuple[int, ...] = PREFILL_LENGTHS,
                prefill_concurrency: tuple[int, ...] = PREFILL_CONCURRENCY,
                decode_batches: tuple[int, ...] = DECODE_BATCHES,
                decode_contexts: tuple[int, ...] = DECODE_CONTEXTS,
                progress: Callable[[int, int, str], None] | None = None) -> Profile:
    """Measure and fit a profile. ``engine_config`` is an ``EngineConfig`` (any role: the sweep
    runs it aggregated with the prefix cache off)."""
    from kvrelay.engine.engine_core import EngineCore

    cfg = replace(engine_config, role="both",
                  cache=replace(engine_config.cache, enable_prefix_caching=False))
    engine = EngineCore(cfg, eos_token_ids=())
    max_len = engine.max_model_len
    budget = cfg.scheduler.max_num_batched_tokens
    kv_tokens = engine.stats().num_blocks * cfg.cache.block_size
    rng = random.Random(0)
    plan: list[tuple[str, int, int]] = (
        [("prefill", n, c) for c in prefill_concurrency for n in prefill_lengths
         if n < max_len and n * c < kv_tokens]
        + [("decode", b, ctx) for ctx in decode_contexts for b in decode_batches
           if ctx + _decode_tokens(b, ctx, budget) <= max_len
           and b * (ctx + _decode_tokens(b, ctx, budget)) < kv_tokens
           and b <= cfg.scheduler.max_num_seqs])
    # warm-up: the first steps of a new process compile kernels
    _prefill_point(engine, rng, min(64, max_len - 2), 1)
    _decode_point(engine, rng, 2, 32, budget)
    started = time.monotonic()
    pre: list[PrefillPoint] = []
    dec: list[DecodePoint] = []
    for i, (kind, x, y) in enumerate(plan):
        if time.monotonic() - started > time_budget_s:
            logger.warning("profile: time budget spent; %d of %d points skipped",
                           len(plan) - i, len(plan))
            break
        if kind == "prefill":
            pre.append(_prefill_point(engine, rng, x, y))
            label = f"prefill len={x} conc={y}: TTFT {pre[-1].ttft_ms:.1f} ms"
        else:
            dec.append(_decode_point(engine, rng, x, y, budget))
            label = f"decode batch={x} ctx={y}: ITL {dec[-1].itl_ms:.2f} ms"
        logger.debug("profile %s", label)
        if progress is not None:
            progress(i + 1, len(plan), label)
    if not any(p.concurrency == 1 for p in pre) or not dec:
        raise RuntimeError("the time budget ran out before both sweeps had points")
    return Profile(
        model=cfg.model.model, hardware=_hardware(), max_num_batched_tokens=budget,
        kv_capacity_tokens=kv_tokens,
        prefill_coef=Profile.fit_prefill(pre, budget), decode_coef=Profile.fit_decode(dec),
        prefill_points=pre, decode_points=dec)


def progress_bar(done: int, total: int, label: str, width: int = 30) -> str:
    n = round(width * done / total) if total else width
    return f"[{'#' * n}{'.' * (width - n)}] {done}/{total} {label}"
