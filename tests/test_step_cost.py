"""The online step-time fit and the prefill budget a TPOT target derives from it."""

from __future__ import annotations

import random

import pytest
from test_scheduler import add, make, shares, step

from kvrelay.engine.config import EngineConfig, SchedulerConfig
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.step_cost import FEATURES, StepCostFit, StepCostModel, StepShape

TRUE = StepCostFit(base=2e-3, prefill_token=5e-5, attended_pair=2e-9, decode=3e-4,
                   decode_ctx_token=4e-7, samples=0, prefill_chunk=1.5e-3)


def synthetic(rng: random.Random, prefill: bool = True, decodes: bool = True) -> StepShape:
    p = rng.choice([0, 16, 64, 256, 512, 1024]) if prefill else 0
    c = rng.randint(0, 2000)
    d = rng.randint(0, 64) if decodes else 0
    chunks = rng.randint(1, 3) if p else 0
    return StepShape(p, p * c + p * (p + 1) // 2, d, d * rng.randint(10, 1500), chunks)


def fitted(seed: int = 0, n: int = 200, noise: float = 0.03, tpot_slo_s: float | None = 0.05,
           itl_cap_s: float | None = None) -> StepCostModel:
    rng = random.Random(seed)
    m = StepCostModel(tpot_slo_s=tpot_slo_s, max_tokens=2048, itl_cap_s=itl_cap_s)
    for _ in range(n):
        shape = synthetic(rng)
        m.observe(shape, TRUE.predict(shape) * (1 + rng.uniform(-noise, noise)))
    return m


def test_fit_recovers_the_cost_of_each_term() -> None:
    m = fitted()
    assert m.fit is not None and m.fit.samples >= 150
    for term in FEATURES:
        assert getattr(m.fit, term) == pytest.approx(getattr(TRUE, term), rel=0.15), term


def test_budget_fills_the_target_and_no_more() -> None:
    m = fitted()
    m.slack_s = 0.0  # no banked slack: the step itself must fit the target
    d, ctx = 24, 24 * 600
    budget = m.prefill_budget(d, ctx)
    assert 16 < budget < 2048
    def predicted(p: int) -> float:  # a fresh prompt's chunk: it attends over itself
        return m.fit.predict(StepShape(p, p * (p + 1) // 2, d, ctx, 1))

    assert predicted(budget) <= m.headroom * 0.05 < predicted(budget + 8)
    # Without decodes the step takes the whole budget; more decodes leave less room.
    assert m.prefill_budget(0, 0) == 2048
    assert m.prefill_budget(48, 48 * 600) < budget


def test_the_budget_prices_a_fresh_prompt_not_the_last_chunks_context() -> None:
    """Chunks deep into a long prompt (each token attending over 20k others) must not shrink
    the token budget a fresh short prompt gets in the next step: the scheduler cuts each chunk
    at its own context, and the budget is the fresh prompt's upper bound."""
    m = fitted()
    m.slack_s = 0.0
    d, ctx = 8, 8 * 300
    before = m.prefill_budget(d, ctx)
    for _ in range(64):
        deep = StepShape(64, 64 * 20_000 + 64 * 65 // 2, d, ctx, 1)
        m.observe(deep, TRUE.predict(deep))
    m.slack_s = 0.0
    assert m.prefill_budget(d, ctx) == pytest.approx(before, rel=0.03)
    assert m.chunk_tokens(m.prefill_room(d, ctx), 20_000, first=True) < 0.7 * before


def test_slack_left_by_fast_steps_lets_a_larger_chunk_through_and_is_spent() -> None:
    """TPOT is a mean: decode steps far under the target bank the difference (up to a few
    steps' worth), which a prefill chunk may spend; a slow step spends it."""
    m = fitted()
    m.slack_s = 0.0
    d, ctx = 4, 4 * 300
    plain = m.prefill_budget(d, ctx)
    fast = StepShape(0, 0, d, ctx)
    for _ in range(50):  # ~4 ms steps against a 50 ms target
        m.observe(fast, TRUE.predict(fast))
    assert m.slack_s == pytest.approx(m.slack_steps * 0.05)  # banked, but bounded
    banked = m.prefill_budget(d, ctx)
    assert banked > plain
    # the chunk ran, as long as the aim plus the slack
    m.observe(StepShape(banked, banked * 200, d, ctx, 1), m.headroom * 0.05 + m.slack_s)
    assert m.slack_s == pytest.approx(0.0, abs=1e-9)
    assert m.prefill_budget(d, ctx) == pytest.approx(plain, rel=0.02)  # (the fit moved a hair)


def test_a_loaded_engine_averages_the_aim_not_the_target() -> None:
    """Prompts always waiting, decodes always running: every step takes the budget, and the
    slack that fast steps bank is spent. The steps must average the aim below the target
    (headroom), or the requests' TPOT sits at the target itself and half of them miss it."""
    m = fitted()
    rng = random.Random(1)
    times = []
    for _ in range(400):
        d = rng.randint(8, 24)
        ctx = d * rng.randint(100, 600)
        p = m.prefill_budget(d, ctx)
        shape = StepShape(p, p * 300 + p * (p + 1) // 2, d, ctx, 1)
        t = TRUE.predict(shape) * (1 + rng.uniform(-0.05, 0.05))
        m.observe(shape, t)
        times.append(t)
    mean = sum(times[100:]) / len(times[100:])
    assert mean == pytest.approx(m.headroom * 0.05, rel=0.03)


def test_an_itl_cap_bounds_every_step_slack_or_not() -> None:
    """TPOT is a mean, so banked slack lets one step run long; an ITL cap bounds each step
    (the tail a client sees between two tokens), and with both set the smaller room wins."""
    d, ctx = 4, 4 * 300
    fast = StepShape(0, 0, d, ctx)
    both = fitted(itl_cap_s=0.02)
    tpot = fitted()
    itl = fitted(tpot_slo_s=None, itl_cap_s=0.02)
    for m in (both, tpot, itl):
        for _ in range(50):  # fast steps bank slack where a TPOT target is set
            m.observe(fast, TRUE.predict(fast))
    assert tpot.slack_s > 0 and itl.slack_s == 0.0
    capped = itl.prefill_budget(d, ctx)
    assert both.prefill_budget(d, ctx) == pytest.approx(capped, rel=0.02)
    assert 16 < capped < tpot.prefill_budget(d, ctx)
    def predicted(p: int) -> float:
        return itl.fit.predict(StepShape(p, p * (p + 1) // 2, d, ctx, 1))

    assert predicted(capped) <= itl.headroom * 0.02 < predicted(capped + 8)
    assert itl.prefill_budget(0, 0) == 2048  # no decodes in the step: no cap
    assert itl.num_capped_steps > 0


def test_no_target_or_no_fit_means_the_configured_budget() -> None:
    assert StepCostModel(None, 512).prefill_budget(8, 800) == 512
    m = StepCostModel(0.05, 512)
    m.observe(StepShape(10, 55, 1, 10), 0.01)  # one sample: still warming up
    assert m.fit is None and m.prefill_budget(8, 800) == 512


def test_prefills_keep_moving_when_decodes_alone_fill_the_target() -> None:
    m = fitted()
    assert m.prefill_budget(2000, 2000 * 1500) == m.min_prefill_tokens


def test_a_window_without_prefills_keeps_the_prefill_cost() -> None:
    """Decode-only stretches (every prefill finished) must not erase what was learned about
    prefill tokens, or the first prefill after them would get an unbounded budget."""
    m = fitted()
    before = m.fit.prefill_token
    rng = random.Random(5)
    for _ in range(400):
        shape = synthetic(rng, prefill=False)
        m.observe(shape, TRUE.predict(shape))
    assert m.fit.prefill_token == pytest.approx(before, rel=0.2)
    m.slack_s = 0.0  # (those fast steps banked slack; the fit is what this test is about)
    assert m.prefill_budget(24, 24 * 600) < 2048


def test_scheduler_caps_prefill_tokens_only_in_steps_with_decodes() -> None:
    s = make(num_blocks=256, max_num_batched_tokens=64, long_prefill_threshold=64)
    cost = StepCostModel(0.01, 64)
    # 1 ms per step, 0.1 ms per prefill token, 1 ms per decode: with two decodes a step has
    # 0.9 * 10 - 1 - 2 = 6 ms left, 60 tokens; with five decodes 30 tokens.
    cost.fit = StepCostFit(1e-3, 1e-4, 0.0, 1e-3, 0.0, samples=100)
    cost.min_prefill_tokens = 4
    cost.slack_steps = 0.0  # no banked slack here: each step is held to the target
    s.cost_model = cost
    add(s, "a", 8, max_tokens=50)
    add(s, "b", 8, max_tokens=50)
    out, _ = step(s)
    assert shares(out) == {"a": 8, "b": 8}  # no decodes yet: the whole budget
    add(s, "long", 500)
    out, _ = step(s)
    assert shares(out) == {"a": 1, "b": 1, "long": 60}
    for rid in ("c", "d", "e"):
        add(s, rid, 4, max_tokens=50)
    step(s)
    out, _ = step(s)
    sh = shares(out)
    assert len(sh) == 6 and sum(n for n in sh.values() if n > 1) == 30
    assert cost.num_capped_steps >= 2


def test_a_chunk_is_held_to_the_time_left_at_its_own_context() -> None:
    """The same room buys a fresh prompt more tokens than a chunk deep into a long one (whose
    every token attends over the whole prefix), each chunk pays its own fixed cost, and the
    chunk chosen is the longest whose predicted cost fits."""
    m = StepCostModel(0.05, 4096)
    m.fit = StepCostFit(base=1e-3, prefill_token=5e-5, attended_pair=2e-8, decode=3e-4,
                        decode_ctx_token=0.0, samples=100, prefill_chunk=2e-3)
    room = 0.02
    fresh = m.chunk_tokens(room, 0, first=True)
    deep = m.chunk_tokens(room, 3000, first=True)
    assert 16 < deep < fresh < 4096
    for n, ctx in ((fresh, 0), (deep, 3000)):
        assert m.fit.chunk_seconds(n, ctx) <= room < m.fit.chunk_seconds(n + 1, ctx)
    # Less room than a chunk's own cost: only the step's first chunk moves (by the minimum).
    assert m.chunk_tokens(1.5e-3, 0, first=False) == 0
    assert m.chunk_tokens(1.5e-3, 0, first=True) == m.min_prefill_tokens


def test_scheduler_charges_every_chunk_its_fixed_cost() -> None:
    """With 6 ms of room and 2 ms a chunk, a 20-token prompt (4 ms) leaves too little for a
    second chunk, which waits for the next step; without the chunk cost both would run."""
    s = make(num_blocks=256, max_num_batched_tokens=512, long_prefill_threshold=64)
    cost = StepCostModel(0.01, 512)
    cost.fit = StepCostFit(1e-3, 1e-4, 0.0, 1e-3, 0.0, samples=100, prefill_chunk=2e-3)
    cost.slack_steps = 0.0
    s.cost_model = cost
    add(s, "a", 8, max_tokens=50)
    add(s, "b", 8, max_tokens=50)
    step(s)
    add(s, "short", 20)
    add(s, "long", 500)
    out, _ = step(s)
    # 0.9 * 10 ms - 1 ms base - 2 decodes x 1 ms = 6 ms; "short" takes 2 + 20 x 0.1 = 4 ms
    assert shares(out) == {"a": 1, "b": 1, "short": 20}
    assert cost.fit.predict(out.shape) <= cost.headroom * 0.01
    out, _ = step(s)  # three decodes now: 5 ms of room, "long" gets (5 - 2) / 0.1 tokens
    assert shares(out) == {"a": 1, "b": 1, "short": 1, "long": 30}


def test_step_shape_counts_what_the_step_computes() -> None:
    s = make(max_num_batched_tokens=16, long_prefill_threshold=16)
    add(s, "a", 40)
    add(s, "b", 3)
    out, _ = step(s)  # a: 13 tokens of its prompt, b: all 3
    out = s.schedule()
    shape = out.shape
    chunks = {sc.seq.request_id: (sc.seq.num_computed_tokens, sc.num_new_tokens)
              for sc in out.scheduled}
    assert chunks["b"] == (3, 1)  # b decodes
    c, n = chunks["a"]
    assert shape == StepShape(n, n * c + n * (n + 1) // 2, 1, 4, 1)


def test_tpot_target_or_itl_cap_changes_scheduling_not_results(demo_model_dir) -> None:
    """An engine with a tight TPOT target (or ITL cap) learns its step cost, caps the prefill
    chunks that ride with decodes, and still produces exactly the tokens of an engine without
    one."""
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 4000) for _ in range(rng.choice([8, 40, 300]))]
               for _ in range(12)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run(**kw: object) -> tuple[dict[str, list[int]], EngineCore]:
        core = EngineCore(EngineConfig.from_kwargs(demo_model_dir, num_blocks=512,
                                                   max_num_batched_tokens=512, **kw))
        got: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            core.add_request(f"r{i}", p, sp)
            got[f"r{i}"] = []
            for o in core.step():  # arrivals interleave with steps
                got[o.request_id] += o.new_token_ids
        while core.has_unfinished():
            for o in core.step():
                got[o.request_id] += o.new_token_ids
        return got, core

    free, _ = run()
    # A target below any step's time: every step with decodes gets the minimum chunk.
    for target in ("tpot_slo_ms", "itl_cap_ms"):
        capped, core = run(**{target: 0.001})
        assert capped == free, target
        stats = core.stats()
        # It fitted its steps (the coefficients are timings: their values belong to the unit
        # tests).
        assert stats.step_cost is not None and stats.step_cost.samples > 0
        assert stats.num_capped_steps > 0, target


@pytest.mark.parametrize("name", ["tpot_slo_ms", "itl_cap_ms"])
def test_slo_targets_are_validated(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SchedulerConfig(**{name: 0})
    with pytest.raises(ValueError, match=name):
        SchedulerConfig(**{name: float("nan")})


def test_slo_flags_reach_the_scheduler_config(demo_model_dir: str) -> None:
    import argparse

    from kvrelay.common.options import add_engine_options, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_options(p)
    sc = engine_config_from_args(p.parse_args(["--model", demo_model_dir])).scheduler
    assert (sc.tpot_slo_ms, sc.itl_cap_ms) == (None, None)
    sc = engine_config_from_args(p.parse_args(
        ["--model", demo_model_dir, "--tpot-slo-ms", "50", "--itl-cap-ms", "25"])).scheduler
    assert (sc.tpot_slo_ms, sc.itl_cap_ms) == (50.0, 25.0)
    core = EngineCore(EngineConfig.from_kwargs(demo_model_dir, num_blocks=64, itl_cap_ms=25.0))
    assert core.step_cost.itl_cap_s == pytest.approx(0.025) and core.step_cost.tpot_slo_s is None
