"""The per-pool autoscaling policy: hysteresis, cooldown, bounds, each pool on its own signal."""

from __future__ import annotations

import pytest

from kvrelay.deploy.autoscaler import AutoscaleConfig, PoolAutoscaler, PoolBounds, PoolSample

CFG = AutoscaleConfig(prefill=PoolBounds(1, 3), decode=PoolBounds(1, 3),
                      prefill_queued_tokens_per_replica=1000, decode_kv_usage=0.5,
                      decode_running_per_replica=4, sustain=2, idle_ticks=3, cooldown_s=5.0)


def run(scaler: PoolAutoscaler, samples: list[PoolSample], t0: float = 0.0,
        dt: float = 1.0) -> list[int]:
    return [scaler.decide(s, t0 + i * dt).delta for i, s in enumerate(samples)]


def test_prefill_scales_up_on_sustained_queue_only() -> None:
    s = PoolAutoscaler("prefill", CFG)
    assert run(s, [PoolSample(1, queued_prompt_tokens=5000)]) == [0]  # one tick is a blip
    s = PoolAutoscaler("prefill", CFG)
    assert run(s, [PoolSample(1, queued_prompt_tokens=5000)] * 2) == [0, 1]
    # decode signals do not move the prefill pool
    s = PoolAutoscaler("prefill", CFG)
    assert run(s, [PoolSample(1, kv_usage=0.99, running=100)] * 4) == [0, 0, 0, 0]


def test_decode_scales_on_kv_usage_or_running() -> None:
    s = PoolAutoscaler("decode", CFG)
    assert run(s, [PoolSample(1, kv_usage=0.9)] * 2)[-1] == 1
    s = PoolAutoscaler("decode", CFG)
    assert run(s, [PoolSample(2, running=20)] * 2)[-1] == 1
    s = PoolAutoscaler("decode", CFG)
    assert run(s, [PoolSample(1, queued_prompt_tokens=10**6)] * 4) == [0, 0, 0, 0]


def test_cooldown_and_max_bound() -> None:
    s = PoolAutoscaler("prefill", CFG)
    hot = PoolSample(1, queued_prompt_tokens=10**6)
    got = run(s, [hot, hot, hot, hot, hot, hot, hot, hot])
    assert got[1] == 1 and got[2:6] == [0, 0, 0, 0]  # cooldown of 5 s after the change
    s2 = PoolAutoscaler("prefill", CFG)
    assert run(s2, [PoolSample(3, queued_prompt_tokens=10**6)] * 4) == [0, 0, 0, 0]


def test_scale_down_when_idle_but_not_below_min() -> None:
    s = PoolAutoscaler("decode", CFG)
    assert run(s, [PoolSample(3)] * 3) == [0, 0, -1]
    s = PoolAutoscaler("decode", CFG)
    assert run(s, [PoolSample(1)] * 6) == [0] * 6
    # in between (not hot, not idle): steady
    s = PoolAutoscaler("decode", CFG)
    assert run(s, [PoolSample(2, kv_usage=0.3)] * 6) == [0] * 6


def test_latency_slo_signals() -> None:
    cfg = AutoscaleConfig(ttft_slo_ms=200, itl_slo_ms=50, sustain=1)
    assert PoolAutoscaler("prefill", cfg).decide(PoolSample(1, ttft_ms=900), 0).delta == 1
    d = PoolAutoscaler("decode", cfg).decide(PoolSample(1, itl_ms=80), 0)
    assert d.delta == 1 and "ITL" in d.reason


def test_out_of_bounds_corrects_and_reasons_are_given() -> None:
    d = PoolAutoscaler("prefill", CFG).decide(PoolSample(0), 0)
    assert d.delta == 1 and "minimum" in d.reason
    d = PoolAutoscaler("prefill", CFG).decide(PoolSample(5), 0)
    assert d.delta == -1 and "maximum" in d.reason


def test_bad_config() -> None:
    with pytest.raises(ValueError):
        PoolBounds(3, 1)
    with pytest.raises(ValueError):
        AutoscaleConfig(down_fraction=1.5)
