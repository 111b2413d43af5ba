"""The ITL cap yields to a backed-up queue: in a step whose oldest queued prompt has waited
``itl_cap_max_queue_ms``, only the TPOT target (if any) limits the step's prefill."""

from __future__ import annotations

import argparse
import dataclasses
import time

import pytest
from test_scheduler import add, make, shares, step

from kvrelay.engine.config import EngineConfig, SchedulerConfig
from kvrelay.engine.engine_core import EngineCore, EngineStats
from kvrelay.engine.step_cost import StepCostFit, StepCostModel

# 1 ms a step, 0.1 ms a prefill token, 1 ms a decode (no chunk or context cost).
FIT = StepCostFit(1e-3, 1e-4, 0.0, 1e-3, 0.0, samples=100)


def model(tpot_slo_s: float | None, itl_cap_s: float | None = 0.01,
          max_queue_s: float | None = 0.25) -> StepCostModel:
    m = StepCostModel(tpot_slo_s, 512, itl_cap_s=itl_cap_s, itl_cap_max_queue_s=max_queue_s)
    m.fit = FIT
    m.slack_steps = 0.0
    return m


def test_the_cap_holds_until_the_oldest_queued_prompt_has_waited_long_enough() -> None:
    m = model(None)
    capped = 0.9 * 0.01 - 1e-3 - 2e-3  # two decodes: 6 ms of room
    for wait in (None, 0.0, 0.1, 0.2499):
        assert m.prefill_room(2, 0, wait) == pytest.approx(capped)
    assert m.num_cap_yields == 0
    assert m.prefill_room(2, 0, 0.25) is None  # only a cap, and it yields: no limit
    assert m.prefill_budget(2, 0, 3.0) == 512
    assert m.num_cap_yields == 2
    # With a TPOT target too, the yield leaves the target's (larger) room.
    both = model(0.05)
    assert both.prefill_room(2, 0, 0.1) == pytest.approx(capped)
    assert both.prefill_room(2, 0, 0.3) == pytest.approx(0.9 * 0.05 - 3e-3)
    # None: the cap never yields.
    never = model(None, max_queue_s=None)
    assert never.prefill_room(2, 0, 1e9) == pytest.approx(capped)
    assert never.num_cap_yields == 0
    # The scheduler reads the queue's wait only for a cap that may yield.
    assert m.watches_queue and not never.watches_queue and not model(0.05, None).watches_queue


def test_the_scheduler_drains_a_backed_up_queue_at_full_speed() -> None:
    s = make(num_blocks=512, max_num_batched_tokens=256, long_prefill_threshold=256)
    s.cost_model = model(None)
    add(s, "a", 8, max_tokens=50)
    add(s, "b", 8, max_tokens=50)
    step(s)
    fresh = add(s, "fresh", 200)
    out, _ = step(s)
    assert shares(out) == {"a": 1, "b": 1, "fresh": 60}  # capped: (6 ms) / 0.1 ms
    old = add(s, "old", 200)
    old.arrival_time = time.monotonic() - 0.3  # queued for 300 ms: past the 250 ms bound
    out, _ = step(s)
    assert shares(out)["fresh"] == 140 and shares(out)["old"] == 114  # the whole budget
    assert s.cost_model.num_cap_yields == 1
    assert fresh.num_computed_tokens == 200
    # The queue is empty again: the next step is capped.
    add(s, "c", 100)
    out, _ = step(s)
    assert sum(n for n in shares(out).values() if n > 1) < 100


def test_the_bound_is_validated_and_reaches_the_engine(demo_model_dir: str) -> None:
    from kvrelay.common.options import add_engine_options, engine_config_from_args

    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="itl_cap_max_queue_ms"):
            SchedulerConfig(itl_cap_max_queue_ms=bad)
    SchedulerConfig(itl_cap_max_queue_ms=float("inf"))
    p = argparse.ArgumentParser()
    add_engine_options(p)
    sc = engine_config_from_args(p.parse_args(["--model", demo_model_dir])).scheduler
    assert sc.itl_cap_max_queue_ms == SchedulerConfig().itl_cap_max_queue_ms == 250.0
    sc = engine_config_from_args(p.parse_args(
        ["--model", demo_model_dir, "--itl-cap-ms", "5", "--itl-cap-max-queue-ms", "100"]
    )).scheduler
    assert sc.itl_cap_max_queue_ms == 100.0
    core = EngineCore(EngineConfig.from_kwargs(demo_model_dir, num_blocks=64, itl_cap_ms=5.0,
                                               itl_cap_max_queue_ms=100.0))
    assert core.step_cost.itl_cap_max_queue_s == pytest.approx(0.1)
    assert core.stats().num_cap_yields == 0


def test_the_worker_exports_the_yields() -> None:
    from prometheus_client import generate_latest

    from kvrelay.worker.metrics import WorkerMetrics

    stats = EngineStats(**{f.name: {} if str(f.type).startswith("dict") else 1
                             for f in dataclasses.fields(EngineStats)})
    stats = dataclasses.replace(stats, step_cost=None, kv_transfer={}, num_cap_yields=7,
                                gemm_prefetch=None)
    text = generate_latest(WorkerMetrics(lambda: stats, "both", "w").registry).decode()
    assert 'kvrelay:itl_cap_yielded_steps_total{pool="both",worker="w"} 7.0' in text
