"""The hindsight bound on a trace's replica-seconds (``deploy/planner/oracle.py``): the choice of
one split per window at an attainment, and the bound below what any policy reaches."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvrelay.deploy.planner.oracle import Option, cheapest, window_options
from kvrelay.deploy.planner.planner import Planner, PlannerConfig
from kvrelay.deploy.planner.profile import Profile
from kvrelay.deploy.planner.simulator import SimConfig, simulate
from kvrelay.deploy.planner.trace import generate, shapes

PROFILE = Profile(model="synthetic", hardware="test", max_num_batched_tokens=2048,
                  kv_capacity_tokens=80_000, prefill_coef=(0.003, 3.5e-5, 2e-8),
                  decode_coef=(0.0015, 5e-5, 2.6e-7), startup_s=5.0)
SLO = (300.0, 8.0)


def test_cheapest_takes_the_cheap_split_where_it_costs_least_attainment() -> None:
    # Two windows of 100 requests: in the first the small split loses 50 of them, in the
    # second only 10. At 90 %, the second window goes small; at 70 % both; at 100 % neither.
    w = [(100, [Option(1, 1, 40, 50), Option(2, 2, 80, 100)]),
         (100, [Option(1, 1, 40, 90), Option(2, 2, 80, 100)])]
    at90 = cheapest(w, 0.90)
    assert at90["whole"] == 120 and at90["attainment"] == pytest.approx(0.95)
    # the relaxation: the first window a fifth small too (10 of its 50 losses left to spend)
    assert at90["replica_seconds"] == pytest.approx(120 - 40 * 10 / 50)
    assert cheapest(w, 0.70) == {"replica_seconds": 80, "whole": 80, "attainment": 0.70,
                                 "reached": True}
    assert cheapest(w, 1.0)["replica_seconds"] == pytest.approx(160)
    out = cheapest([(100, [Option(1, 1, 40, 50)])], 0.9)
    assert out["reached"] is False and out["attainment"] == 0.5


def test_the_bound_lies_below_what_the_planner_and_a_static_split_pay() -> None:
    trace = generate(shapes(60.0, 240.0)["ramp"], seed=3)
    sim = SimConfig(*SLO, prefill=1, decode=1, interval_s=2.0)
    windows = window_options(PROFILE, trace, sim, window_s=20.0, max_pool=3, max_total=6)
    assert len(windows) == 12 and sum(n for n, _ in windows) == len(trace)
    planned = simulate(PROFILE, trace, sim, Planner(PROFILE, PlannerConfig(*SLO,
                                                                          max_replicas=6)))
    bound = cheapest(windows, planned.attainment)
    assert bound["reached"]
    assert bound["replica_seconds"] <= planned.replica_seconds
    static = simulate(PROFILE, trace, replace(sim, prefill=2, decode=2))
    at = cheapest(windows, static.attainment)
    assert at["replica_seconds"] <= 4 * trace[-1].t + 4 * 20  # 2P2D over every window
    # the low plateaus need fewer than four replicas: the bound is well under a static 2P2D
    assert at["replica_seconds"] < 0.95 * static.replica_seconds
