"""The planner and bursts: a period found in the request rate, the forecast it gives a start-up
ahead, the planner scaling up for a burst before it arrives, and a remembered burst's return
planned at its level."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvrelay.deploy.planner.planner import Planner, PlannerConfig
from kvrelay.deploy.planner.predictor import make_predictor
from kvrelay.deploy.planner.profile import Profile
from kvrelay.deploy.planner.season import Season, find_period
from kvrelay.deploy.planner.signals import Observation
from kvrelay.deploy.planner.simulator import SimConfig, simulate
from kvrelay.deploy.planner.trace import generate, shapes

PROFILE = Profile(model="synthetic", hardware="test", max_num_batched_tokens=2048,
                  kv_capacity_tokens=80_000, prefill_coef=(0.003, 3.5e-5, 2e-8),
                  decode_coef=(0.0015, 5e-5, 2.6e-7), startup_s=5.0)
SLO = (300.0, 8.0)


def noisy(rates: list[float], seed: int, interval: float = 2.0) -> list[float]:
    """Per-interval rates as a Poisson count would give them (normal approximation)."""
    rng = random.Random(seed)
    return [max(0.0, rng.gauss(r * interval, (r * interval) ** 0.5)) / interval for r in rates]


def bursts(n: int, period: int = 50, width: int = 10, base: float = 30.0,
           peak: float = 75.0) -> list[float]:
    return [peak if i % period >= period - width else base for i in range(n)]


def test_find_period_sees_repeating_bursts_and_nothing_in_noise_or_a_ramp() -> None:
    for seed in range(5):
        assert find_period(noisy(bursts(200), seed))[0] == 50
        assert find_period(noisy(bursts(200, period=30, width=6), seed))[0] == 30
        # no period in a flat load, a ramp, or a ramp that levels off, at any history length
        flat = noisy([60.0] * 300, seed)
        ramp = noisy([10.0 + 0.5 * i for i in range(300)], seed)
        plateau = noisy([min(120.0, 10.0 + i) for i in range(300)], seed)
        for series in (flat, ramp, plateau):
            for end in range(20, 301, 10):
                assert find_period(series[:end])[0] is None, (seed, end)
    # less than two periods seen: not trusted yet
    assert find_period(noisy(bursts(90), 0))[0] is None


def test_season_forecasts_a_burst_ahead_and_follows_a_level_shift() -> None:
    s = Season()
    xs = noisy(bursts(200), 1)
    for x in xs[:186]:  # the next burst starts at interval 190
        s.update(x)
    assert s.period == 50
    assert s.forecast(1) == pytest.approx(30, rel=0.3)  # still the base
    assert s.forecast(6) == pytest.approx(75, rel=0.25)  # the burst, a start-up ahead
    # the same shape, 20 req/s higher: the deviation carries the shift into the forecast
    shifted = noisy([x + 20 for x in bursts(250)], 2)
    for x in shifted[186:236]:
        s.update(x)
    assert s.forecast(5) == pytest.approx(95, rel=0.25)


def test_a_horizon_longer_than_the_period_reads_older_periods() -> None:
    s = Season()
    xs = noisy(bursts(200, period=10, width=3), 4)
    for x in xs:
        s.update(x)
    assert s.period == 10
    for h in range(1, 30):  # a start-up may outlast a short period
        burst = (len(xs) - 1 + h) % 10 >= 7
        near = any((len(xs) - 1 + h + d) % 10 >= 7 for d in (-1, 1))
        got = s.forecast(h)
        assert got is not None
        if burst:
            assert got == pytest.approx(75, rel=0.25), h
        elif not near:
            assert got == pytest.approx(30, rel=0.35), h


def test_seasonal_predictor_is_holt_until_a_period_is_found() -> None:
    seasonal, holt = make_predictor("seasonal"), make_predictor("holt")
    for x in noisy([10.0 + 0.5 * i for i in range(200)], 3):
        seasonal.update(x)
        holt.update(x)
        assert seasonal.period is None
        assert seasonal.predict(6) == pytest.approx(holt.predict(6))
        assert seasonal.error == pytest.approx(holt.error)


def run(trace: list, predictor: str):
    cfg = PlannerConfig(*SLO, max_replicas=8, predictor=predictor)
    sim = SimConfig(*SLO, prefill=1, decode=1, interval_s=cfg.interval_s)
    return simulate(PROFILE, trace, sim, Planner(PROFILE, cfg))


def test_planner_scales_up_before_known_bursts_for_fewer_replica_seconds() -> None:
    trace = generate(shapes(100.0, 600.0)["bursty"], seed=1)  # 20 s bursts every 100 s from 60 s
    holt, seasonal = run(trace, "holt"), run(trace, "seasonal")
    assert seasonal.failed == 0
    assert seasonal.attainment >= holt.attainment - 0.005
    assert seasonal.replica_seconds <= 0.9 * holt.replica_seconds
    horizon = PROFILE.startup_s + 2.0
    periods = [x for x in seasonal.timeline if x["load_period_s"] > 0]
    assert periods and {x["load_period_s"] for x in periods} == {100.0}
    assert "load repeats every 100s" in periods[-1]["reason"]
    for start in (360.0, 460.0, 560.0):  # bursts after the period was found
        ups = [x["t"] for x in seasonal.timeline
               if start - horizon - 4 <= x["t"] < start
               and x["target_prefill"] + x["target_decode"] > x["prefill"] + x["decode"]]
        assert ups, f"no scale-up ahead of the burst at {start:.0f}s"
        # and the capacity goes back down between bursts
        quiet = [x for x in seasonal.timeline if start - 40 <= x["t"] < start - 20]
        assert min(x["prefill"] + x["decode"] for x in quiet) == 2


def _obs(t: float, rate: float) -> Observation:
    n = round(rate * 2)
    return Observation(t=t, interval_s=2.0, prefill_replicas=2, decode_replicas=2, arrivals=n,
                       finished=n, prompt_tokens=512 * n, cached_tokens=0, output_tokens=64 * n)


def test_a_remembered_burst_coming_back_is_planned_at_its_level_not_its_edges_trend() -> None:
    def returning_edge(pl: Planner) -> float:
        t = 0.0
        for rate in [30.0] * 20 + [90.0] * 10 + [30.0] * 20 + [60.0, 90.0]:  # a burst, its edge
            t += 2.0
            d = pl.decide(_obs(t, rate))
        return d.details["predicted_rate"]

    prof = replace(PROFILE, startup_s=10.0)  # a start-up is 6 intervals of the edge's trend
    cfg = PlannerConfig(*SLO, max_replicas=8, predictor="holt")
    remembered = returning_edge(Planner(prof, cfg))
    forgotten = returning_edge(Planner(prof, replace(cfg, burst_memory_s=0)))
    # Holt alone extrapolates the edge's jump a start-up ahead, past the burst's level; with
    # the burst remembered the plan is that level plus the predictor's error headroom
    assert forgotten > 100
    assert 90 <= remembered < forgotten
    pl = Planner(prof, cfg)
    returning_edge(pl)
    assert remembered <= 90 + pl.predictor.error + 1e-6


def test_the_periodic_down_delay_is_a_flag_and_not_negative(tmp_path) -> None:
    import argparse

    from kvrelay.deploy.planner.cli import add_planner_options, build_planner

    PROFILE.save(tmp_path / "p.json")
    ap = argparse.ArgumentParser()
    add_planner_options(ap, slo_options=True)
    args = ap.parse_args(["--planner", "--profile", str(tmp_path / "p.json"), "--ttft-slo-ms",
                          "300", "--itl-slo-ms", "8", "--planner-periodic-down-delay", "6"])
    cfg = build_planner(args).config
    assert (cfg.predictor, cfg.periodic_down_delay_s, cfg.down_delay_s) == ("seasonal", 6.0, 20.0)
    with pytest.raises(ValueError, match="down delays"):
        PlannerConfig(*SLO, periodic_down_delay_s=-1.0)
